"""Tiny diffusers checkpoints with random weights, saved with save_pretrained: one per family we serve."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

from roles.pipelines.tiny import SCHEDULER_CONFIG, TRANSFORMER_CONFIG, build_tiny_flux_pipeline


def save_tiny_flux(folder: Path, schnell: bool = False) -> None:
    """FLUX.1-dev's layout (guidance-distilled) at a tiny size; schnell: no guidance embedding, static shift."""
    pipe = build_tiny_flux_pipeline()
    if schnell:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            pipe.transformer = FluxTransformer2DModel(**{**TRANSFORMER_CONFIG, "guidance_embeds": False}).eval()
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(**{**SCHEDULER_CONFIG, "use_dynamic_shifting": False,
                                                             "shift": 1.0})
    pipe.save_pretrained(folder)


def save_tiny(family: str, folder: Path) -> None:
    """family: flux, flux-schnell, sd3, sdxl, wan21 or wan22."""
    if family.startswith("flux"):
        save_tiny_flux(folder, schnell=family == "flux-schnell")
    elif family in ("sd3", "sdxl"):
        from tests import ckpt_sd3_sdxl

        getattr(ckpt_sd3_sdxl, f"save_tiny_{family}")(folder)
    else:
        from tests.ckpt_wan import save_tiny_wan

        save_tiny_wan(folder, v22=family == "wan22")
