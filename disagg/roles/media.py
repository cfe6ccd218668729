"""Encoding a decoder's output for the client: PNG, JPEG or WebP per image, MP4 per video."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    from PIL.PngImagePlugin import PngInfo

from disagg.roles.errors import RequestError

IMAGE_FORMATS = ("png", "jpeg", "webp")
#: png for a video model: every frame as its own lossless PNG, videos one after another
VIDEO_FORMATS = ("mp4", "png")


class FormatError(RequestError):
    """A response_format the model's output cannot take."""

    def __init__(self, message: str):
        super().__init__(message, param="response_format")


def check_format(fmt: str | None, video: bool) -> str:
    """The format to encode with: the request's, else png (images) / mp4 (video)."""
    if fmt is None:
        return "mp4" if video else "png"
    if video and fmt not in VIDEO_FORMATS:
        raise FormatError(f"response_format {fmt!r}: this model makes video; use mp4 (or png for lossless frames)")
    if not video and fmt not in IMAGE_FORMATS:
        raise FormatError(f"response_format {fmt!r} is for video models; use png, jpeg or webp")
    return fmt


def png_text(params: dict) -> "PngInfo":
    """A PNG's text chunks for its generation parameters: one per field, and `parameters` in the
    one-line form image tools (AUTOMATIC1111's, ComfyUI's readers) show."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in params.items():
        info.add_itxt(key, str(value))
    tail = [f"Steps: {params.get('num_inference_steps')}", f"CFG scale: {params.get('guidance_scale')}",
            f"Seed: {params.get('seed')}", f"Size: {params.get('width')}x{params.get('height')}",
            f"Model: {params.get('model')}"]
    lines = [str(params.get("prompt", ""))]
    if params.get("negative_prompt"):
        lines.append(f"Negative prompt: {params['negative_prompt']}")
    info.add_itxt("parameters", "\n".join([*lines, ", ".join(tail)]))
    return info


def encode_image(image, fmt: str = "png", params: dict | None = None) -> bytes:
    """One image in `fmt`; a PNG carries `params` (its generation parameters) in text chunks."""
    buf = io.BytesIO()
    if fmt == "png":
        # lossless; level 1 keeps the decoder's CPU time on compute, not compression
        image.save(buf, format="PNG", compress_level=1, pnginfo=png_text(params) if params else None)
    elif fmt == "jpeg":
        image.convert("RGB").save(buf, format="JPEG", quality=95)
    else:
        image.save(buf, format="WEBP", quality=95)
    return buf.getvalue()


#: libx264 through imageio-ffmpeg. quality 8 of 10 is CRF 10 (imageio maps q to int((1 - q/10) * 51)):
#: visually lossless, well under the usual CRF 17-18 threshold, at a fraction of lossless' size; yuv420p
#: and the default High profile play everywhere (browsers, QuickTime); +faststart puts the index first
#: so a browser can start playing before the whole file has arrived.
MP4_SETTINGS = dict(codec="libx264", quality=8, pixelformat="yuv420p", output_params=["-movflags", "+faststart"])


def _rgb(frame) -> np.ndarray:
    return np.asarray(frame.convert("RGB") if isinstance(frame, Image.Image) else frame, dtype=np.uint8)


def encode_mp4(frames: list[Image.Image], fps: int = 16) -> bytes:
    """H.264 MP4 bytes from frames of one size (PIL images or HxWx3 uint8 arrays).

    yuv420p halves the chroma planes, so libx264 needs even widths and heights (ffmpeg fails on odd ones,
    and imageio then returns no bytes). Odd sizes are padded by one row / column repeating the edge,
    instead of imageio's default of rescaling every frame to a multiple of 16 (macro_block_size=1 turns
    that off): Wan's sizes are multiples of 16 already, so normally nothing changes.
    """
    import imageio.v3 as iio

    if not frames:
        raise ValueError("encode_mp4: no frames")
    stack = np.stack([_rgb(f) for f in frames])
    pad_h, pad_w = stack.shape[1] % 2, stack.shape[2] % 2
    if pad_h or pad_w:
        stack = np.pad(stack, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    data = iio.imwrite("<bytes>", stack, extension=".mp4", plugin="FFMPEG", fps=fps, macro_block_size=1,
                       **MP4_SETTINGS)
    if not data:  # ffmpeg failed: imageio logs its stderr and returns nothing
        raise RuntimeError(f"ffmpeg could not encode {len(frames)} frames of {stack.shape[2]}x{stack.shape[1]}")
    return data
