"""What a role asks of a model adapter: the `ModelAdapter` Protocol and the `Capabilities` each adapter declares.

A role (disagg/roles/stage.py) calls an adapter's methods for its part of the pipeline and reads what else the
adapter can do from its `capabilities`, never by probing for attributes: an adapter that declares a capability
has the methods it names (`check_adapter` asserts it; tests/test_adapters.py runs it over every adapter).
Torch-free, like the rest of the package's top level.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

#: tensors by name (torch.Tensor values); kept as Any here so that this module imports no torch
Tensors = dict[str, Any]
#: called at each denoising step: with the latents after the step ({"latents": ...}) where the adapter has them
Progress = Callable[..., None] | None


class LoraSupport(enum.Enum):
    """How an adapter applies LoRA adapters (disagg/roles/extensions/loras.py make_bank)."""

    #: it takes none: a request that names one fails, naming the model
    NONE = "none"
    #: diffusers' own LoRA support (peft) on its pipeline's components (disagg/roles/extensions/lora_backends.py)
    DIFFUSERS = "diffusers"
    #: a simulated model: loads and restores cost its profile's times (SimLoras)
    SIM = "sim"


@dataclass(frozen=True)
class Capabilities:
    """What an adapter can do beyond encode / denoise / decode, for the role it was loaded for."""

    #: step-level batching (`StepBatching`: batch_key, denoise_start, denoise_steps, denoise_result): a denoiser
    #: with max_batch > 1 runs requests together, joining at step boundaries (disagg/roles/batcher.py)
    batching: bool = False
    #: no per-call state: an instance's threads may run it at once (else they take turns, or each runs on its own
    #: copy of the pipeline's per-call state where it hands the device over mid-way)
    thread_safe: bool = False
    #: its computes take turns on one (simulated) device anyway: schedule slo orders them by urgency
    one_device: bool = False
    #: makes videos: decode returns one list of frames per video (mp4 is a format it can answer in)
    video: bool = False
    #: denoise calls progress({"latents": ...}) after each step: a denoiser can stage previews from them
    previews: bool = False
    #: its own encode takes a request's image and mask (a simulated model); otherwise only `image_tasks` do
    image_inputs: bool = False
    #: `tasks` (pipelines/conditioned.py ConditionedTasks): the checkpoint's task pipelines, which run the
    #: image-conditioned tasks (img2img, inpainting, editing, image-to-video) and check what a request asks for
    image_tasks: bool = False
    #: decode(..., progress=) calls progress between a video's latent frames: under schedule slo it hands the
    #: device to a more urgent request there
    decode_yields: bool = False
    #: `EncodedOutput.decode_encoded`: decode returns the encoded images itself (a simulated model keeps them)
    encoded_output: bool = False
    #: `MemoryModel`: it knows its weights' bytes and how many requests a batch may hold on its device (a simulated
    #: device of a declared class, `devices`), and a compute that would not fit fails as out of memory
    memory_model: bool = False
    #: what an encoding depends on besides the prompt (the conditioning cache's key: disagg/roles/extensions/conditioning.py)
    conditioning_depends: tuple[str, ...] = ()
    #: how it applies LoRA adapters
    loras: LoraSupport = LoraSupport.NONE
    #: the diffusers family of its pipeline (`DiffusersModel.pipe`: flux, sd3, sdxl, wan, qwen): step caches,
    #: compile, multi-rank parallelism and per-call pipeline copies work on that pipeline; "" for a model with none
    family: str = ""


@runtime_checkable
class ModelAdapter(Protocol):
    """One role's part of a model (pipelines/__init__.py load_adapter makes one per role process).

    decode(denoise(encode(p))) is the whole pipeline; a colocated instance ("monolith") calls all three.
    `p`: the request's parameters, the adapter's `defaults()` filled in."""

    capabilities: Capabilities

    def defaults(self) -> dict: ...

    def encode(self, p: dict) -> Tensors: ...

    def denoise(self, inputs: Tensors, p: dict, progress: Progress = None) -> Tensors: ...

    #: images (PIL), or one list of frames per video; `progress=` only where `decode_yields`
    def decode(self, inputs: Tensors, p: dict, **kw) -> list: ...

    #: parameters held per component (0 for tokenizers and schedulers), this role's only
    def components_loaded(self) -> dict[str, int]: ...


@runtime_checkable
class StepBatching(Protocol):
    """`Capabilities.batching`: the denoising loop one step at a time, over a batch of requests' states."""

    def batch_key(self, p: dict) -> Any: ...

    def denoise_start(self, inputs: Tensors, p: dict) -> Any: ...

    def denoise_steps(self, states: list) -> None: ...

    def denoise_result(self, state) -> Tensors: ...


@runtime_checkable
class EncodedOutput(Protocol):
    """`Capabilities.encoded_output`."""

    def decode_encoded(self, inputs: Tensors, p: dict, fmt: str, progress: Progress = None) -> list[bytes]: ...


@runtime_checkable
class ImageTasks(Protocol):
    """`Capabilities.image_tasks`: its task pipelines."""

    tasks: Any  # pipelines/conditioned.py ConditionedTasks


@runtime_checkable
class DiffusersModel(Protocol):
    """`Capabilities.family`: a diffusers pipeline holding this role's components."""

    pipe: Any


@runtime_checkable
class MemoryModel(Protocol):
    """`Capabilities.memory_model`."""

    device_memory: int
    device_class: str
    activation_peak: int
    #: what the other processes on its device hold there
    others_bytes: int

    def weights_bytes(self) -> int: ...

    #: the most requests like `p` one denoising batch holds on the device (0: no limit)
    def batch_limit(self, p: dict) -> int: ...


#: each capability -> the Protocol an adapter that declares it implements
REQUIRES = {"batching": StepBatching, "encoded_output": EncodedOutput, "image_tasks": ImageTasks,
            "family": DiffusersModel, "memory_model": MemoryModel}


def check_adapter(adapter) -> Capabilities:
    """The adapter's capabilities, once checked against its methods; a TypeError naming what is missing."""
    if not isinstance(adapter, ModelAdapter):
        raise TypeError(f"{type(adapter).__name__} is not a model adapter (pipelines/adapter.py ModelAdapter)")
    caps = adapter.capabilities
    for name, protocol in REQUIRES.items():
        if getattr(caps, name) and not isinstance(adapter, protocol):
            raise TypeError(f"{type(adapter).__name__} declares {name} but does not implement {protocol.__name__}")
    return caps
