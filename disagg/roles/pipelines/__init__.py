"""Model adapters, one per family: each loads only what its role needs and splits the pipeline.

This module stays torch-free: the launcher reads model specs (payload sizes) from it to size
pools, and only role processes import an adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

ROLES = ("encoder", "denoiser", "decoder")


class ModelError(ValueError):
    """A model name or path that no adapter can serve."""


@dataclass(frozen=True)
class ModelSpec:
    """What the launcher must know about a model without loading it."""

    name: str
    max_width: int
    max_height: int
    #: bytes of what `role` stages for the next role, for one request of this size
    output_bytes: Callable[[str, int, int, int], int]
    #: its denoiser can run requests in a batch that they join at step boundaries (max_batch > 1)
    step_batching: bool = False
    #: a diffusers checkpoint's family (flux, sd3, sdxl, wan); empty for built-in models
    family: str = ""
    #: video models: the most frames per video its pools are sized for (0: not a video model)
    max_frames: int = 0
    #: how one denoiser instance may span devices (disagg/roles/parallel.py): "ulysses" and "ring" where diffusers'
    #: transformer has a context-parallel plan (Flux, Wan, Qwen-Image), "cfg" where the pipeline puts its
    #: negative and positive rows through one forward (SD3, SDXL)
    parallel: tuple[str, ...] = ()

    def largest_payload(self, role: str, max_images: int = 1) -> int:
        """The most bytes a request moves into or out of `role` at the maximum size."""
        if role not in ROLES:  # a monolithic instance stages nothing
            return 0
        i = ROLES.index(role)
        sizes = [self.output_bytes(role, self.max_width, self.max_height, max_images)]
        if i > 0:
            sizes.append(self.output_bytes(ROLES[i - 1], self.max_width, self.max_height, max_images))
        return max(sizes)


def _tiny_bytes(role: str, width: int, height: int, n: int) -> int:
    if role == "encoder":  # T5 embeddings (512 x 32) + CLIP pooled (32), float32, one per prompt
        return (512 * 32 + 32) * 4
    if role == "denoiser":  # packed latents: (h/16 * w/16) tokens x 16 channels, float32
        return n * (height // 16) * (width // 16) * 16 * 4
    return 0


def _payload_bytes(role: str, width: int, height: int, n: int) -> int:
    return width * height * 4 if role == "encoder" else (64 if role == "denoiser" else 0)


#: family -> (module, class) of its adapter
FAMILY_ADAPTERS = {
    "flux": ("disagg.roles.pipelines.flux", "FluxAdapter"),
    "sd3": ("disagg.roles.pipelines.sd3", "SD3Adapter"),
    "sdxl": ("disagg.roles.pipelines.sdxl", "SDXLAdapter"),
    "wan": ("disagg.roles.pipelines.wan", "WanAdapter"),
    "qwen": ("disagg.roles.pipelines.qwen", "QwenAdapter"),
}

#: families whose adapter batches denoising steps (denoise_start / denoise_steps / denoise_result)
STEP_BATCHING = {"flux"}
#: families -> how their denoiser may span devices (ModelSpec.parallel)
PARALLEL = {"flux": ("ulysses", "ring"), "wan": ("ulysses", "ring"), "qwen": ("ulysses", "ring"), "sd3": ("cfg",),
            "sdxl": ("cfg",)}

SPECS = {
    # the trained demo Flux (disagg/roles/pipelines/demo.py): draws coloured shapes at 64x64, the size it knows
    "demo": ModelSpec("demo", 64, 64, _tiny_bytes, step_batching=True),
    "tiny": ModelSpec("tiny", 1024, 1024, _tiny_bytes, step_batching=True, parallel=("ulysses", "ring")),
    "payload": ModelSpec("payload", 4096, 2048, _payload_bytes),
}


def model_spec(model: str) -> ModelSpec:
    if model.startswith("sim:"):
        from disagg.roles.pipelines.sim_profile import load_profile

        try:
            profile = load_profile(model[4:])
        except ValueError as exc:
            raise ModelError(str(exc)) from None
        # the encoder staged an input image too, at most: pools are sized for image requests
        return ModelSpec(model, 2048, 2048, lambda role, w, h, n: profile.payload(role, w * h, n, with_image=True),
                         step_batching=True)
    if model in SPECS:
        return SPECS[model]
    from disagg.roles.pipelines.checkpoint import MAX_FRAMES, CheckpointError, load_checkpoint, max_size, output_bytes

    try:
        ck = load_checkpoint(model)
    except CheckpointError as exc:
        raise ModelError(f"{exc}; built in: {', '.join(SPECS)}, sim:PROFILE") from None
    width, height = max_size(ck)
    return ModelSpec(model, width, height, lambda role, w, h, n: output_bytes(ck, role, w, h, n), family=ck.family,
                     step_batching=ck.family in STEP_BATCHING, max_frames=MAX_FRAMES if ck.video else 0,
                     parallel=PARALLEL.get(ck.family, ()))


def model_identity(model: str, dtype: str = "auto") -> dict[str, str]:
    """What makes two instances serve the same model (transport.messages.ModelIdentity's fields): a
    checkpoint's family and a digest of its model_index.json and component configs, so the same checkpoint
    in two folders (or as a hub id) is the same model, and dev against schnell, or a fine-tune with
    other configs, is not. Built-in and sim models: their name. Raises ModelError."""
    import hashlib
    import json

    spec = model_spec(model)
    if not spec.family:
        return {"name": model, "family": "", "dtype": dtype, "digest": hashlib.sha1(model.encode()).hexdigest()[:12]}
    from disagg.roles.pipelines.checkpoint import load_checkpoint

    ck = load_checkpoint(model)
    blob = json.dumps({"index": ck.index, "configs": ck.configs}, sort_keys=True, default=str)
    return {"name": model, "family": spec.family, "dtype": dtype, "digest": hashlib.sha1(blob.encode()).hexdigest()[:12]}


def load_adapter(model: str, role: str, device: str = "cpu", dtype: str = "auto", sim_slowdown: float = 1.0,
                 device_memory: int = 0, device_class: str = ""):
    """The adapter for `model`, holding only `role`'s components, on `device`.

    `dtype`: checkpoints only (auto = bf16 on a GPU, fp32 on the CPU); `sim_slowdown`: sim models
    only, every simulated time of this instance is multiplied by it; `device_memory`, `device_class`: sim models on
    declared devices (`devices`), their device's memory (0: no limit) and class."""
    spec = model_spec(model)
    if spec.family:
        import importlib

        module, cls = FAMILY_ADAPTERS[spec.family]
        return getattr(importlib.import_module(module), cls)(model, role, device, dtype)
    if model.startswith("sim:"):
        from disagg.roles.pipelines.sim import SimAdapter

        return SimAdapter(model[4:], role, device, slowdown=sim_slowdown, device_memory=device_memory,
                          device_class=device_class)
    if model == "tiny":
        from disagg.roles.pipelines.tiny import TinyFluxAdapter

        return TinyFluxAdapter("all" if role == "monolith" else role, device)
    if model == "demo":
        from disagg.roles.pipelines.demo import DemoFluxAdapter

        return DemoFluxAdapter("all" if role == "monolith" else role, device)
    from disagg.roles.pipelines.payload import PayloadAdapter

    return PayloadAdapter(role, device)


#: what a spare interpreter imports ahead (python -m disagg.roles --spare): every adapter, and through them
#: the diffusers and transformers classes they use; the rest of a role's start is its model's load
PRELOAD = ("disagg.roles.pipelines.tiny", "disagg.roles.pipelines.demo", "disagg.roles.pipelines.sim", "disagg.roles.pipelines.payload",
           *(module for module, _ in FAMILY_ADAPTERS.values()))


def adapter_modules(model: str) -> tuple[str, ...]:
    """The modules a role of `model` imports to load its adapter (the fork server imports them ahead)."""
    if model.startswith("sim:"):
        return ("disagg.roles.pipelines.sim",)
    if model in ("tiny", "demo", "payload"):
        return (f"disagg.roles.pipelines.{model}",)
    return (FAMILY_ADAPTERS[model_spec(model).family][0],)


def preload(model: str | None = None) -> None:
    """Import every adapter (a spare may become a role of any model), or only `model`'s: for a checkpoint also
    the classes its roles will load it with (its pipeline's and its task pipelines', its components' from
    model_index.json), so each forked role does not import diffusers' and transformers' models again."""
    import importlib

    for module in PRELOAD if model is None else adapter_modules(model):
        importlib.import_module(module)
    if model is None or model.startswith("sim:") or model in SPECS:
        return
    from disagg.roles.pipelines.checkpoint import TASKS, load_checkpoint

    ck = load_checkpoint(model)
    wanted = [("diffusers", name) for name in {ck.pipeline_class, *filter(None, TASKS.get(ck.pipeline_class, {}).values())}]
    wanted += [tuple(entry) for name in ck.components if len(entry := ck.index[name]) == 2]
    for library, name in wanted:
        try:
            getattr(importlib.import_module(library), name)
        except (ImportError, AttributeError):  # the role that loads it says what is missing
            pass
