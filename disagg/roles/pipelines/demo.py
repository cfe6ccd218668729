"""A tiny *trained* FluxPipeline that draws coloured shapes: a newcomer's first run that shows the prompt matters.

The text encoders and tokenizers are the frozen, random-weight ones of `roles.pipelines.tiny`; the transformer
and VAE were trained by `tools/train_demo.py` on pictures it draws itself (one shape on a white background) and
live in `disagg/roles/pipelines/demo/` (safetensors + config.json). The model knows only `caption()`'s prompts:

    a {colour} {shape} on the left | in the center | on the right

with colour in COLOURS, shape in SHAPES. It draws at 64x64 (the size it was trained at) in ~8 steps; the
transformer has no guidance embedding (like FLUX.1-schnell), so guidance_scale is ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel

from disagg.roles.pipelines.tiny import HIDDEN, ROLE_COMPONENTS, TinyFluxAdapter, build_component

DEMO_DIR = Path(__file__).resolve().parent / "demo"  # transformer.safetensors, vae.safetensors, config.json

# --- what the model knows ---
COLOURS = {"red": (220, 40, 40), "green": (30, 160, 60), "blue": (40, 80, 220), "yellow": (235, 195, 20)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("left", "center", "right")
BACKGROUND = (255, 255, 255)
# centre x of the shape as a fraction of the width (before jitter), per position
POSITION_X = {"left": 0.25, "center": 0.5, "right": 0.75}


def caption(colour: str, shape: str, position: str) -> str:
    """The one prompt template the model was trained on, e.g. 'a red circle on the left'."""
    where = "in the center" if position == "center" else f"on the {position}"
    return f"a {colour} {shape} {where}"


# --- architecture (scaling_factor / shift_factor are measured on the training latents and saved in config.json) ---
TRANSFORMER_CONFIG = dict(
    patch_size=1, in_channels=16, out_channels=None, num_layers=2, num_single_layers=2, attention_head_dim=32,
    num_attention_heads=3, joint_attention_dim=HIDDEN, pooled_projection_dim=HIDDEN, guidance_embeds=False,
    axes_dims_rope=(8, 12, 12),
)
# Four blocks -> vae_scale_factor 8: a 64x64 picture is an 8x8x4 latent, packed 2x2 into 16 tokens of 16 channels.
VAE_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 32, 64), layers_per_block=1,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=4,
    sample_size=64, use_quant_conv=False, use_post_quant_conv=False,
)
VAE_SCALE_FACTOR = 2 ** (len(VAE_CONFIG["block_out_channels"]) - 1)
# Inference defaults the model was trained for (any size that is a multiple of 16 runs; 64 is what it knows).
DEFAULTS = dict(width=64, height=64, num_inference_steps=8, guidance_scale=1.0, num_images_per_prompt=1,
                negative_prompt=None, seed=0)


def load_config(weights_dir: str | Path | None = None) -> dict:
    """config.json written by tools/train_demo.py: transformer, vae (with its scaling/shift factor), scheduler."""
    return json.loads((Path(weights_dir or DEMO_DIR) / "config.json").read_text())


def _load_module(cls, config: dict, path: Path):
    from safetensors.torch import load_file

    # fork_rng: the random init that load_state_dict overwrites must not move the caller's global RNG
    with torch.random.fork_rng(devices=[]):
        module = cls(**config)
    module.load_state_dict(load_file(str(path)), strict=True)
    return module.eval().requires_grad_(False)


def build_demo_component(name: str, weights_dir: str | Path | None = None):
    """One pipeline component: the trained transformer / VAE, or tiny.py's frozen text encoders and tokenizers."""
    weights_dir = Path(weights_dir or DEMO_DIR)
    if name == "transformer":
        return _load_module(FluxTransformer2DModel, load_config(weights_dir)["transformer"],
                            weights_dir / "transformer.safetensors")
    if name == "vae":
        return _load_module(AutoencoderKL, load_config(weights_dir)["vae"], weights_dir / "vae.safetensors")
    if name == "scheduler":
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(**load_config(weights_dir)["scheduler"])
    return build_component(name)  # text_encoder(_2), tokenizer(_2): exactly tiny.py's


def _pipeline(names, device: str = "cpu", weights_dir: str | Path | None = None) -> FluxPipeline:
    from disagg.roles.pipelines.tiny import assemble

    return assemble({n: build_demo_component(n, weights_dir) if n in names else None for n in ROLE_COMPONENTS["all"]},
                    device)


def build_demo_flux_pipeline(device: str = "cpu", weights_dir: str | Path | None = None) -> FluxPipeline:
    """The full trained demo FluxPipeline; call it with height=width=64, num_inference_steps=8."""
    return _pipeline(ROLE_COMPONENTS["all"], device, weights_dir)


class DemoFluxAdapter(TinyFluxAdapter):
    """Runs one stage (or all) of the trained demo FluxPipeline (the tiny adapter's split, other weights)."""

    def __init__(self, role: str, device: str = "cpu", weights_dir: str | Path | None = None):
        if role not in ROLE_COMPONENTS:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(ROLE_COMPONENTS)}")
        self.role = role
        self.device = device
        self.pipe = _pipeline(ROLE_COMPONENTS[role], device, weights_dir)

    @staticmethod
    def defaults() -> dict:
        return dict(DEFAULTS)
