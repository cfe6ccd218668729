"""A model without compute: the encoder emits a float32 (height, width) tensor, i.e. 4*w*h bytes.

Used to measure handoffs (`disagg bench transfer`) and pool limits with the real runtime. Every
stage checks the bytes it received, so a transfer that corrupts data fails the request.
"""

from __future__ import annotations

import torch
from PIL import Image

from disagg.roles.pipelines.adapter import Capabilities


class PayloadAdapter:
    """Stages a tensor of the requested size; later stages verify it and pass a token on."""

    #: no per-call state (an instance's threads may run it at once); its encoding depends on the seed and size
    capabilities = Capabilities(thread_safe=True, conditioning_depends=("seed", "width", "height"))

    def __init__(self, role: str, device: str = "cpu"):
        self.role = role
        self.device = device

    @staticmethod
    def defaults() -> dict:
        return dict(width=64, height=64, num_inference_steps=1, guidance_scale=0.0, num_images_per_prompt=1, seed=0)

    @staticmethod
    def _value(p: dict) -> float:
        return float(p["seed"] % 251)

    def encode(self, p: dict) -> dict[str, torch.Tensor]:
        return {"x": torch.full((p["height"], p["width"]), self._value(p), device=self.device)}

    def denoise(self, inputs: dict[str, torch.Tensor], p: dict, progress=None) -> dict[str, torch.Tensor]:
        x = inputs["x"]
        if tuple(x.shape) != (p["height"], p["width"]) or not bool((x == self._value(p)).all()):
            raise ValueError("payload arrived corrupted")
        return {"x": x.reshape(-1)[:16].clone()}

    def decode(self, inputs: dict[str, torch.Tensor], p: dict) -> list[Image.Image]:
        x = inputs["x"]
        if not bool((x == self._value(p)).all()):
            raise ValueError("payload arrived corrupted")
        return [Image.new("L", (1, 1), int(self._value(p)))]

    def components_loaded(self) -> dict[str, int]:
        return {}
