"""One generation request's parameters, as clients send them and every stage reads them. Part of the
wire schema (disagg/transport/wire/messages.py re-exports them)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

#: Largest input image or mask a request carries (its file's bytes: PNG, JPEG, WebP ...)
MAX_INPUT_BYTES = 16 * 1024 * 1024


#: an adapter's name: what `loras.dir`'s file stems and `loras.adapters`' keys may be, and what a request names
LoraName = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
#: the most adapters the wire takes in one request (the deployment's loras.max_per_request is at most this)
MAX_LORAS = 16


class LoraRef(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One LoRA adapter a request applies: a registered adapter's name (never a path) and its scale."""

    name: LoraName
    scale: Annotated[float, Meta(ge=-8.0, le=8.0)] = 1.0


#: a request's step cache (disagg/roles/extensions/step_cache.py): {"type": "first_block", "threshold": 0.2, ...}; the other keys are
#: the diffusers config's own fields. Its type and fields are checked where the transformer is (the denoiser)
CacheValue = str | int | float | bool | list[float | str] | None
CacheSpec = Annotated[dict[Annotated[str, Meta(min_length=1, max_length=64)], CacheValue], Meta(max_length=32)]


def cache_label(cache) -> str:
    """A request's step cache as a manifest and a PNG record it: "first_block threshold=0.2"."""
    if not cache:
        return ""
    rest = " ".join(f"{k}={v}" for k, v in sorted(cache.items()) if k != "type")
    return f"{cache.get('type')}{' ' + rest if rest else ''}"


def conditioning_key(params, depends: tuple[str, ...] = ()) -> str | None:
    """What an encoder's output depends on for a text request: its prompts, its guidance (a model with
    classifier-free guidance encodes the negative prompt only when it is on), its images per prompt (a task
    pipeline's encode_prompt repeats its rows) and its adapters (their text-encoder parts), and `depends`: the
    other fields a model's encoder reads (the compute-free models' payloads: their size, their seed). Requests
    with equal keys may reuse one encoding (disagg/roles/extensions/conditioning.py); None for a request with an input image or
    mask, whose encoding is the image's too."""
    import hashlib

    if params.image is not None or params.mask is not None:
        return None
    blob = msgspec.json.encode([params.prompt, params.negative_prompt, params.guidance_scale,
                                params.num_images_per_prompt, [[r.name, r.scale] for r in params.loras or ()],
                                [getattr(params, name) for name in depends]])
    return hashlib.sha1(blob).hexdigest()[:20]


def lora_key(loras) -> tuple:
    """The adapters of a request as a hashable key, in its order: requests may share a batched forward only
    when their keys are equal."""
    return tuple((r.name, r.scale) for r in loras or ())


def lora_label(loras) -> str:
    """The adapters as a manifest and a PNG record them: "A:1,B:0.5"."""
    return ",".join(f"{r.name}:{r.scale:g}" for r in loras or ())


class GenerationParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """One generation request, named as in diffusers; unset fields take the model's defaults.

    Unset fields are left off the wire, so a request that uses no new field still reaches an
    orchestrator of an older version."""

    prompt: Annotated[str, Meta(min_length=1, max_length=20_000)]
    negative_prompt: Annotated[str, Meta(max_length=20_000)] | None = None
    width: Annotated[int, Meta(ge=16, le=8192, multiple_of=16)] | None = None
    height: Annotated[int, Meta(ge=16, le=8192, multiple_of=16)] | None = None
    num_inference_steps: Annotated[int, Meta(ge=1, le=1000)] | None = None
    guidance_scale: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    #: Wan 2.2 (two experts): guidance of the low-noise expert; None = the model's default
    guidance_scale_2: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    #: images (videos, for a video model) per prompt
    num_images_per_prompt: Annotated[int, Meta(ge=1, le=16)] = 1
    #: video models: frames per video
    num_frames: Annotated[int, Meta(ge=1, le=1024)] | None = None
    #: video models: frames per second of the MP4 (None = the model's, 16 for Wan)
    fps: Annotated[int, Meta(ge=1, le=240)] | None = None
    #: png, jpeg or webp for images; mp4 for video, or png for its frames one by one (lossless);
    #: None = png, or mp4 for a video model
    response_format: Literal["png", "jpeg", "webp", "mp4"] | None = None
    #: image tasks: the input image's file (img2img, editing, image-to-video), and a mask (white: repaint)
    #: of the same size for inpainting. They travel to the encoder only; the orchestrator never decodes them
    image: Annotated[bytes, Meta(min_length=1, max_length=MAX_INPUT_BYTES)] | None = None
    mask: Annotated[bytes, Meta(min_length=1, max_length=MAX_INPUT_BYTES)] | None = None
    #: img2img and inpainting: how far from the input image (0: keep it, 1: ignore it); None = the model's
    strength: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    #: LoRA adapters applied to this request's own compute turns, in order (registered names only: loras.dir,
    #: loras.adapters); none = the base model
    loras: Annotated[list[LoraRef], Meta(max_length=MAX_LORAS)] | None = None
    #: scheduling (`schedule: slo`): higher goes first; None = 0. Under overload the lowest is shed first
    priority: Annotated[int, Meta(ge=-1000, le=1000)] | None = None
    #: a deadline, in milliseconds from the request's arrival: `schedule: slo` orders queues and denoising steps
    #: by the slack it leaves, and `admission: slo` refuses a request that cannot meet it
    slo_ms: Annotated[float, Meta(gt=0, le=86_400_000)] | None = None
    #: denoisers: a step cache for this request (diffusers' cache hooks), e.g. {"type": "first_block",
    #: "threshold": 0.2}; {"type": "none"} turns the deployment's `cache` default off; None = that default
    cache: CacheSpec | None = None
    #: live previews (OpenAI's partial_images): at this many evenly spaced steps the denoiser stages a copy of
    #: the latents, a decoder decodes it, and the client gets a Partial; images only. None = 0
    previews: Annotated[int, Meta(ge=0, le=3)] | None = None
