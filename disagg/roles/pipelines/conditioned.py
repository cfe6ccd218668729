"""Image-conditioned tasks (img2img, inpainting, editing, image-to-video) and whole-pipeline families, split
across roles by running diffusers' own task pipeline in two halves: record in the encoder, replay in the denoiser.

The encoder runs the task pipeline (FluxImg2ImgPipeline, FluxKontextPipeline, WanImageToVideoPipeline, ...)
with its text encoders, image encoders and VAE, and a weightless stand-in for the transformer that stops
the call at its first forward: the start of the denoising loop. On the way it records what the pipeline's
encoders returned (`encode_prompt`, `encode_image`, and each `vae.encode`: the latent distribution's
moments, not a sample), in call order. Those tensors, and the decoded input image and mask, are its
staged output.

The denoiser runs the same task pipeline with the same arguments, holding only the transformer: its
`encode_prompt` and `encode_image` return the recorded outputs, and a ReplayVAE returns the recorded
distributions. Everything else happens as in one process, in the same order: the pipeline samples the
image latents and the noise from the request's generator itself, so the output equals the pipeline's
own call on the same inputs. It stages the latents (output_type="latent") and the size they are of.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import io
import re

import torch
from PIL import Image

from disagg.roles.errors import RequestError
from disagg.roles.pipelines.checkpoint import MAX_INPUT_PIXELS
from disagg.roles.pipelines.replay import (  # noqa: F401 - LAYOUT, TASK, task_class: what the roles read of a task's tensors
    LAYOUT,
    METHODS,
    TASK,
    Recorder,
    ReplayVAE,
    StopBeforeDenoise,
    meta_model,
    name_tensor,
    pixels,
    replay,
    replaying,
    task_class,
    unpixel,
)
from disagg.roles.pipelines.split import step_callback
from disagg.transport.data.manifest import dtype_of

#: what a request's inputs ask for: none, an image, an image and a mask
TEXT, IMAGE, INPAINT = "text", "image", "inpaint"
#: the largest input image, in pixels (decoded): bigger uploads are refused before any compute (pools are
#: sized for it: disagg/roles/pipelines/checkpoint.py)
MAX_PIXELS = MAX_INPUT_PIXELS


class InputError(RequestError):
    """A request's image inputs that this model cannot take (not an image, wrong size, wrong task)."""



def describe(tasks, video: bool = False) -> str:
    names = {TEXT: "text-to-video (a prompt)" if video else "text-to-image (a prompt)",
             IMAGE: "image-to-video (an image)" if video else "image editing or img2img (an image)",
             INPAINT: "inpainting (an image and a mask)"}
    return ", ".join(names[t] for t in tasks)


def request_task(p: dict) -> str:
    if p.get("mask") is not None:
        if p.get("image") is None:
            raise InputError("a mask needs an image: send the image to inpaint with it", param="image")
        return INPAINT
    return IMAGE if p.get("image") is not None else TEXT


def open_image(data: bytes, field: str, mode: str) -> Image.Image:
    """The upload as a PIL image in `mode` (RGB for images, L for masks); an InputError naming the field."""
    try:
        im = Image.open(io.BytesIO(data))
        if im.width * im.height > MAX_PIXELS:
            raise InputError(f"{field}: {im.width}x{im.height} is over the {MAX_PIXELS}-pixel limit", param=field)
        im.load()
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a bad file
        # without the repr of the in-memory file Pillow names ("<_io.BytesIO object at 0x...>")
        why = re.sub(r"\s*<_io\.\w+ object at 0x[0-9a-fA-F]+>", "", str(exc)).rstrip(": ") or type(exc).__name__
        raise InputError(f"{field}: not an image Pillow can read ({why})", param=field) from None
    return im.convert(mode)


def input_images(p: dict) -> tuple[Image.Image | None, Image.Image | None]:
    image = open_image(p["image"], "image", "RGB") if p.get("image") is not None else None
    mask = open_image(p["mask"], "mask", "L") if p.get("mask") is not None else None
    if image is not None and mask is not None and image.size != mask.size:
        raise InputError(f"mask: {mask.width}x{mask.height} differs from the image's {image.width}x{image.height}",
                         param="mask")
    return image, mask


#: task pipelines that make a fixed size (1024^2) unless told one: without width and height a request keeps its
#: input image's size instead, as OpenAI's edits do (Kontext and Qwen-Image-Edit choose from the image's aspect;
#: SD3's and SDXL's img2img keep its size already)
KEEP_INPUT_SIZE = ("FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxFillPipeline", "QwenImageImg2ImgPipeline",
                   "QwenImageInpaintPipeline")


def call_kwargs(cls, p: dict, image, mask, video: bool, guidance: str = "guidance_scale") -> dict:
    """The task pipeline's arguments for request `p`: the same in both halves."""
    accepted = inspect.signature(cls.__call__).parameters
    if image is not None and p.get("width") is None and p.get("height") is None and cls.__name__ in KEEP_INPUT_SIZE:
        p = {**p, "width": max(16, image.width // 16 * 16), "height": max(16, image.height // 16 * 16)}
    per_prompt = "num_images_per_prompt" if "num_images_per_prompt" in accepted else "num_videos_per_prompt"
    kw = {"prompt": p["prompt"], "num_inference_steps": p["num_inference_steps"], per_prompt: p["num_images_per_prompt"]}
    for name in ("height", "width", "negative_prompt", "strength"):
        if p.get(name) is not None:
            if name not in accepted:
                if name == "strength":
                    raise InputError(f"strength: {cls.__name__} does not take one", param="strength")
                continue
            kw[name] = p[name]
    if p.get("guidance_scale") is not None and guidance in accepted:
        # `guidance`: the family's name for it (Qwen-Image's real classifier-free guidance is true_cfg_scale)
        kw[guidance] = p["guidance_scale"]
    if video and p.get("num_frames") is not None:
        kw["num_frames"] = p["num_frames"]
    if image is not None:
        kw["image"] = image
    if mask is not None:
        kw["mask_image"] = mask
    return kw


# --- the encoder's half ---------------------------------------------------------------------------------

class ConditionedTasks:
    """The task pipelines of one checkpoint, for one role, built once from the role's components.

    `classes`: task -> diffusers pipeline class name (None: the family adapter's own text path)."""

    def __init__(self, adapter, classes: dict[str, str | None]):
        self.adapter = adapter
        self.classes = classes
        self._pipes: dict[str, object] = {}

    def supports(self, task: str) -> bool:
        return task in self.classes

    def generic(self, task: str) -> bool:
        return self.classes.get(task) is not None

    def check(self, p: dict) -> str:
        task = request_task(p)
        if task not in self.classes:
            ck = self.adapter.ck
            raise InputError(f"model {ck.source!r} ({ck.pipeline_class}) takes {describe(self.classes, ck.video)}; "
                             f"this request is {describe([task], ck.video)}", param="image")
        return task

    def _pipe(self, task: str):
        pipe = self._pipes.get(task)
        if pipe is None:
            pipe = self._pipes[task] = self._build(task)
        return pipe

    def _build(self, task: str):
        import diffusers

        a = self.adapter
        cls = getattr(diffusers, self.classes[task])
        accepted = inspect.signature(cls.__init__).parameters
        parts = {k: v for k, v in a.pipe.components.items() if k in accepted}
        model_name = "unet" if "unet" in accepted else "transformer"
        if a.role == "encoder":
            library, class_name = a.ck.index[model_name][:2]
            model_cls = getattr(importlib.import_module(library), class_name)
            parts[model_name] = meta_model(model_cls, model_cls.load_config(a.ck.path / model_name), a.dtype)
        elif a.role == "denoiser":
            parts["vae"] = ReplayVAE(a.ck.configs["vae"], a.device, a.dtype)
        pipe = cls(**parts)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def encode(self, p: dict, task: str) -> dict[str, torch.Tensor]:
        image, mask = input_images(p)
        pipe = self._pipe(task)
        pipe.scheduler = copy.deepcopy(self.adapter.pipe.scheduler)  # its timesteps are this call's own
        rec = Recorder(pipe)
        try:
            with torch.inference_mode():
                pipe(**call_kwargs(type(pipe), p, image, mask, self.adapter.video, self.adapter.guidance_kwarg),
                     generator=self.adapter.generator(p), output_type="latent")
        except StopBeforeDenoise:
            pass
        else:
            raise RuntimeError(f"{type(pipe).__name__} finished without reaching its denoising loop")
        finally:
            for name in METHODS:  # the wrappers go with this call
                pipe.__dict__.pop(name, None)
            if getattr(pipe, "vae", None) is not None:
                pipe.vae.__dict__.pop("encode", None)
        out = rec.tensors(type(pipe).__name__)
        if image is not None:
            out["image_pixels"] = pixels(image)
        if mask is not None:
            out["mask_pixels"] = pixels(mask)
        return out

    def denoise(self, inputs: dict[str, torch.Tensor], p: dict, progress=None) -> dict[str, torch.Tensor]:
        layout, calls = replay(inputs, self.adapter.device)
        task = next(t for t, c in self.classes.items() if c == layout["class"])
        pipe = self._pipe(task)
        pipe.scheduler = copy.deepcopy(self.adapter.pipe.scheduler)
        for name in METHODS:
            if name in calls:
                setattr(pipe, name, replaying(name, calls[name]))
        pipe.vae.recorded = calls.get("vae.encode", [])
        if layout.get("vae_dtype"):
            pipe.vae.to(dtype=dtype_of(layout["vae_dtype"]))
        image, mask = unpixel(inputs.get("image_pixels"), "RGB"), unpixel(inputs.get("mask_pixels"), "L")
        return self._run(pipe, p, image, mask, progress)

    def whole(self, p: dict, task: str, progress=None) -> dict[str, torch.Tensor]:
        """A colocated instance: the task pipeline with every real component, up to its latents."""
        image, mask = input_images(p)
        pipe = self._pipe(task)
        pipe.scheduler = copy.deepcopy(self.adapter.pipe.scheduler)
        return self._run(pipe, p, image, mask, progress)

    def _run(self, pipe, p: dict, image, mask, progress) -> dict[str, torch.Tensor]:
        size = {}
        prepare = pipe.prepare_latents

        def prepare_latents(*args, **kw):  # what size the latents are of (the decoder unpacks them so)
            bound = inspect.signature(prepare).bind(*args, **kw).arguments
            size.update({k: int(bound[k]) for k in ("height", "width") if bound.get(k) is not None})
            return prepare(*args, **kw)

        pipe.prepare_latents = prepare_latents
        try:
            with torch.inference_mode():
                result = pipe(**call_kwargs(type(pipe), p, image, mask, self.adapter.video, self.adapter.guidance_kwarg),
                              generator=self.adapter.generator(p), output_type="latent",
                              callback_on_step_end=step_callback(progress))
            latents = result.frames if self.adapter.video else result.images
        finally:
            for name in (*METHODS, "prepare_latents"):
                pipe.__dict__.pop(name, None)
        out = {"latents": latents, TASK: name_tensor(type(pipe).__name__)}
        if len(size) == 2:
            out["out_size"] = torch.tensor([size["height"], size["width"]], dtype=torch.int64)
        return out


def out_size(inputs: dict[str, torch.Tensor], p: dict) -> tuple[int, int]:
    """(height, width) the denoiser's latents are of: its own report, else the request's."""
    t = inputs.get("out_size")
    if t is not None:
        h, w = t.tolist()
        return int(h), int(w)
    return p["height"], p["width"]
