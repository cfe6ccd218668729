"""One role's compute, free of sockets: inputs in, outputs (tensors or encoded images) out."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import msgspec
import torch

from transport.messages import GenerationParams


@dataclass
class StageOutput:
    """What a stage produced: tensors to stage for the next role, or the final encoded images."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    images: list[bytes] = field(default_factory=list)
    image_format: str = "png"


def params_dict(params: GenerationParams) -> dict:
    """Request parameters as a plain dict, without the ones left to the model's defaults."""
    return {k: v for k, v in msgspec.structs.asdict(params).items() if v is not None}


def encode_png(image) -> bytes:
    buf = io.BytesIO()
    # PNG is lossless; level 1 keeps the decoder's CPU time on compute, not compression
    image.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


class Stage:
    """Runs one role's part of the pipeline through a model adapter."""

    def __init__(self, role: str, adapter):
        self.role = role
        self.adapter = adapter

    def run(self, params: GenerationParams, inputs: dict[str, torch.Tensor], progress=None) -> StageOutput:
        """`progress()` is called at each denoising step, so a live role is told from a hung one."""
        p = {**self.adapter.defaults(), **params_dict(params)}
        if self.role == "encoder":
            return StageOutput(tensors=self.adapter.encode(p))
        if self.role == "denoiser":
            return StageOutput(tensors=self.adapter.denoise(inputs, p, progress=progress))
        if self.role == "monolith":  # colocated: all three stages here, nothing leaves the process
            inputs = self.adapter.denoise(self.adapter.encode(p), p, progress=progress)
        images = self.adapter.decode(inputs, p)
        return StageOutput(images=[encode_png(im) for im in images])
