"""Encoding a decoder's output for the client: PNG, JPEG or WebP per image, MP4 per video."""

from __future__ import annotations

import io

import numpy as np

IMAGE_FORMATS = ("png", "jpeg", "webp")
#: png for a video model: every frame as its own lossless PNG, videos one after another
VIDEO_FORMATS = ("mp4", "png")


class FormatError(ValueError):
    """A response_format the model's output cannot take."""


def check_format(fmt: str | None, video: bool) -> str:
    """The format to encode with: the request's, else png (images) / mp4 (video)."""
    if fmt is None:
        return "mp4" if video else "png"
    if video and fmt not in VIDEO_FORMATS:
        raise FormatError(f"response_format {fmt!r}: this model makes video; use mp4 (or png for lossless frames)")
    if not video and fmt not in IMAGE_FORMATS:
        raise FormatError(f"response_format {fmt!r} is for video models; use png, jpeg or webp")
    return fmt


def encode_image(image, fmt: str = "png") -> bytes:
    buf = io.BytesIO()
    if fmt == "png":
        # lossless; level 1 keeps the decoder's CPU time on compute, not compression
        image.save(buf, format="PNG", compress_level=1)
    elif fmt == "jpeg":
        image.convert("RGB").save(buf, format="JPEG", quality=95)
    else:
        image.save(buf, format="WEBP", quality=95)
    return buf.getvalue()


def encode_mp4(frames, fps: int = 16) -> bytes:
    """H.264 in MP4 through imageio-ffmpeg; frames: PIL images or HxWx3 uint8 arrays of one size.

    quality 9 of 10; yuv420p (what players expect) needs even sizes: requests' sizes are multiples of 16."""
    import imageio.v3 as iio

    stack = np.stack([np.asarray(f.convert("RGB") if hasattr(f, "convert") else f) for f in frames])
    return iio.imwrite("<bytes>", stack, extension=".mp4", fps=fps, codec="libx264", quality=9,
                       pixelformat="yuv420p", macro_block_size=2)
