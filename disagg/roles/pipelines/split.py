"""The base of every diffusers-checkpoint adapter: load only one role's components, split the pipeline.

A family adapter (flux.py, sd3.py, sdxl.py, wan.py, qwen.py) subclasses `SplitPipeline` and provides the
`ModelAdapter` methods (pipelines/adapter.py):
    defaults()                         request defaults, as the diffusers pipeline's own
    encode(p) -> tensors               the text encoders' outputs (negatives too when CFG is on)
    denoise(inputs, p, progress) -> tensors   the denoising loop, ending in latents
    decode(inputs, p) -> list[PIL.Image] for images, list[list[PIL.Image]] (frames) for video
and `fix_without_vae()` when the pipeline derives sizes from the VAE it does not hold. Every checkpoint adapter
has image tasks, diffusers LoRA and its family's pipeline (`capabilities`); `family_capabilities` adds the
family's own (Flux: step batching; Wan: decodes that yield).
The composition decode(denoise(encode(p))) must equal the diffusers pipeline called with the same
arguments and `generator=torch.Generator("cpu").manual_seed(seed)`.
"""

from __future__ import annotations

import torch

from disagg.roles.pipelines.adapter import Capabilities, LoraSupport
from disagg.roles.pipelines.checkpoint import Checkpoint, load_checkpoint, vae_scale_factors
from disagg.settings.choices import Dtype

#: what encode_prompt returns for the CFG families (SD3, SDXL), in its order
CFG_EMBEDS = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")

DTYPES = {Dtype.FLOAT32: torch.float32, Dtype.BFLOAT16: torch.bfloat16, Dtype.FLOAT16: torch.float16}


def resolve_dtype(dtype: str | None, device: str) -> torch.dtype:
    """bf16 on a GPU, fp32 on the CPU, unless `dtype` names one."""
    if not dtype or dtype == Dtype.AUTO:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DTYPES[dtype]


def step_callback(progress):
    """A diffusers step-end callback that reports progress (the stall detector's heartbeat): `progress(latents)`,
    the latents after the step as {"latents": tensor} where the pipeline passes them (a preview may be staged
    from them: disagg/roles/compute.py), else `progress()`."""
    if progress is None:
        return None

    def on_step_end(pipe, step, timestep, kwargs):
        latents = kwargs.get("latents")
        if latents is None:
            progress()
        else:  # the latents after this step: a preview may be staged from them (disagg/roles/compute.py)
            progress({"latents": latents})
        return kwargs

    return on_step_end


def repeat_rows(t: torch.Tensor | None, n: int, device) -> torch.Tensor | None:
    """Embeddings of one prompt, repeated for n images exactly as encode_prompt would (rows adjacent)."""
    return None if t is None else t.to(device).repeat_interleave(n, dim=0)


class SplitPipeline:
    """One role's part of a diffusers pipeline loaded from a checkpoint."""

    #: what the family adds to every checkpoint's capabilities (Capabilities' fields)
    family_capabilities: dict = {}
    #: the name the family's task pipelines take the request's guidance_scale under (conditioned.py call_kwargs)
    guidance_kwarg = "guidance_scale"

    def __init__(self, source: str | Checkpoint, role: str, device: str = "cpu", dtype: str | None = None):
        import diffusers

        self.ck = source if isinstance(source, Checkpoint) else load_checkpoint(source)
        self.role = "all" if role == "monolith" else role
        self.device = device
        self.dtype = resolve_dtype(dtype, device)
        mine = self.ck.role_components(self.role)
        skip = {name: None for name in self.ck.components if name not in mine}
        cls = getattr(diffusers, self.ck.pipeline_class)
        built = {}
        if not self.ck.hub:
            from disagg.roles.pipelines.random_weights import build_components, is_random

            if is_random(self.ck.path):  # a checkpoint without weights: our components from their configs
                built = build_components(self.ck.path, self.ck.index, mine, device, self.dtype)
        # a hub id, not its snapshot folder: diffusers then downloads only the components not skipped
        self.pipe = cls.from_pretrained(self.ck.source if self.ck.hub else self.ck.path, torch_dtype=self.dtype,
                                        **skip, **built)
        self.pipe.set_progress_bar_config(disable=True)
        self.pipe.to(device)
        self.loaded = mine
        vae = getattr(self.pipe, "vae", None)
        if type(vae).__name__ == "AutoencoderKL" and self.role in ("encoder", "decoder"):
            # the encoder only encodes images, the decoder only decodes latents: each drops the other half
            # (the 3D VAEs of Wan and Qwen-Image count both halves' convolutions on every call: kept whole)
            setattr(vae, "decoder" if self.role == "encoder" else "encoder", None)
        if "vae" not in mine:
            self.fix_without_vae(*vae_scale_factors(self.ck))
        from disagg.roles.pipelines.conditioned import ConditionedTasks

        #: the checkpoint's tasks (text, image, inpaint) and the task pipelines that run them
        self.tasks = ConditionedTasks(self, self.ck.tasks)
        # a video's step callback passes latents too, but a video has no previews (disagg/roles/compute.py)
        self.capabilities = Capabilities(video=self.video, previews=not self.video, image_tasks=True,
                                         loras=LoraSupport.DIFFUSERS, family=self.ck.family,
                                         **self.family_capabilities)

    @property
    def video(self) -> bool:
        return self.ck.video

    def fix_without_vae(self, spatial: int, temporal: int) -> None:
        """Set what the pipeline derives from its VAE, for a role that holds none."""

    def encode(self, p: dict) -> dict[str, torch.Tensor]:
        """The request's encoding through its task's pipeline, up to its denoising loop (conditioned.py): a family
        with no encode of its own (Qwen-Image) encodes every request so; the others override it."""
        return self.tasks.encode(p, self.tasks.check(p))

    def denoise(self, inputs: dict[str, torch.Tensor], p: dict, progress=None) -> dict[str, torch.Tensor]:
        """The pipeline from precomputed CFG_EMBEDS (those the encoder sent) to latents (SD3, SDXL)."""
        n = p["num_images_per_prompt"]
        # batch-1 embeds would not match the pipeline's own batch: expand as encode_prompt does
        embeds = {name: repeat_rows(inputs.get(name), n, self.device) for name in CFG_EMBEDS}
        with torch.inference_mode():
            latents = self.pipe(
                **embeds, height=p["height"], width=p["width"], num_inference_steps=p["num_inference_steps"],
                guidance_scale=p["guidance_scale"], num_images_per_prompt=1, generator=self.generator(p),
                output_type="latent", callback_on_step_end=step_callback(progress),
            ).images
        return {"latents": latents}

    def generator(self, p: dict) -> torch.Generator:
        return torch.Generator("cpu").manual_seed(p["seed"])

    def components_loaded(self) -> dict[str, int]:
        """Parameters held per component (0 for tokenizers and schedulers), and only this role's."""
        out = {}
        for name in self.ck.components:
            comp = getattr(self.pipe, name, None)
            if comp is not None:
                out[name] = sum(t.numel() for t in comp.parameters()) if isinstance(comp, torch.nn.Module) else 0
        return out
