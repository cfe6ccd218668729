"""Tiny diffusers checkpoints with random weights, saved with save_pretrained: one per family we serve."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

from disagg.roles.pipelines.tiny import SCHEDULER_CONFIG, TRANSFORMER_CONFIG, build_tiny_flux_pipeline


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


def save_tiny_flux_kontext(folder: Path) -> None:
    """FluxKontextPipeline: FLUX.1's components (Kontext's transformer has the same layout)."""
    from diffusers import FluxKontextPipeline

    FluxKontextPipeline(**build_tiny_flux_pipeline().components).save_pretrained(folder)


def save_tiny_flux_fill(folder: Path) -> None:
    """FluxFillPipeline: the transformer also takes the masked image's latents (16 packed channels here) and
    the mask (vae_scale_factor^2 x 4 packed = 256), beside its own 16, and returns 16."""
    from diffusers import FluxFillPipeline

    components = {k: v for k, v in build_tiny_flux_pipeline().components.items()
                  if k not in ("image_encoder", "feature_extractor")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(6)
        components["transformer"] = FluxTransformer2DModel(**{**TRANSFORMER_CONFIG, "in_channels": 16 + 16 + 256,
                                                               "out_channels": 16}).eval()
    FluxFillPipeline(**components).save_pretrained(folder)


def save_tiny(family: str, folder: Path) -> None:
    """family: flux, flux-schnell, flux-kontext, flux-fill, sd3, sdxl, wan21, wan22, wan21-i2v, qwen or qwen-edit."""
    if family == "flux-kontext":
        save_tiny_flux_kontext(folder)
    elif family == "flux-fill":
        save_tiny_flux_fill(folder)
    elif family.startswith("flux"):
        save_tiny_flux(folder, schnell=family == "flux-schnell")
    elif family in ("sd3", "sdxl"):
        from tests import ckpt_sd3_sdxl

        getattr(ckpt_sd3_sdxl, f"save_tiny_{family}")(folder)
    elif family == "wan21-i2v":
        from tests.ckpt_wan import save_tiny_wan_i2v

        save_tiny_wan_i2v(folder)
    elif family.startswith("qwen"):
        from tests.ckpt_qwen import save_tiny_qwen

        save_tiny_qwen(folder, edit=family == "qwen-edit")
    else:
        from tests.ckpt_wan import save_tiny_wan

        save_tiny_wan(folder, v22=family == "wan22")
