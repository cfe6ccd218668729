"""Tiny Stable Diffusion 3 and SDXL checkpoints: the real model classes at toy sizes, random weights.

Sizes follow the spirit of diffusers' own fast tests, smaller still: a 64x64 generation with 2 steps
takes a few tens of milliseconds on a CPU. Each VAE has two blocks (vae_scale_factor 2, not the 8 a
pipeline assumes without a VAE), so a denoiser that forgets to fix its latent size fails loudly.
Every component is built under its own seed, so a checkpoint is the same on every save.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from disagg.roles.pipelines.tiny import _clip_tokenizer, _t5_tokenizer

CLIP_MAX_LENGTH = 77  # position embeddings; the tokenizers pad to it


def _seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def _clip(hidden: int, projection: bool):
    tok = _clip_tokenizer()
    config = CLIPTextConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, projection_dim=hidden,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def _t5(d_model: int) -> T5EncoderModel:
    tok = _t5_tokenizer()
    config = T5Config(
        vocab_size=len(tok), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id,
    )
    return T5EncoderModel(config)


def _vae(latent_channels: int = 4, **kw) -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
        sample_size=64, **kw,
    )


# --- Stable Diffusion 3 -------------------------------------------------------------------------
# CLIP-L + CLIP-G hidden states (16 + 16) are padded to T5's width (32) = joint_attention_dim;
# the two CLIP projections (16 + 16) make the pooled embedding (32), as 768 + 1280 = 2048 at full size.
SD3_CLIP_HIDDEN = 16
SD3_JOINT_DIM = 32


def _sd3_transformer() -> SD3Transformer2DModel:
    return SD3Transformer2DModel(
        # 16 latent channels, as SD3's: its inpainting pipeline takes no other count
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=SD3_JOINT_DIM, caption_projection_dim=32,
        pooled_projection_dim=2 * SD3_CLIP_HIDDEN, pos_embed_max_size=64, qk_norm="rms_norm",
    )


def build_tiny_sd3() -> StableDiffusion3Pipeline:
    return StableDiffusion3Pipeline(
        transformer=_seeded(11, _sd3_transformer),
        # SD3's own scheduler config (shift 3.0, no dynamic shifting)
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        # SD3's VAE: no quant convs, a shift factor
        vae=_seeded(12, lambda: _vae(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                                     use_post_quant_conv=False)),
        text_encoder=_seeded(13, lambda: _clip(SD3_CLIP_HIDDEN, projection=True)),
        tokenizer=_clip_tokenizer(),
        text_encoder_2=_seeded(14, lambda: _clip(SD3_CLIP_HIDDEN, projection=True)),
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=_seeded(15, lambda: _t5(SD3_JOINT_DIM)),
        tokenizer_3=_t5_tokenizer(),
    )


def save_tiny_sd3(folder: Path) -> None:
    build_tiny_sd3().save_pretrained(folder)


# --- SDXL ---------------------------------------------------------------------------------------
# text_encoder (CLIP-L, no projection) 16 + text_encoder_2 (CLIP-G, projection) 24 = cross_attention_dim 40;
# the added embedding takes 6 time ids x 8 + the pooled 24.
SDXL_CLIP_HIDDEN = (16, 24)
SDXL_TIME_EMBED = 8


def _sdxl_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, transformer_layers_per_block=(1, 1),
        cross_attention_dim=sum(SDXL_CLIP_HIDDEN), norm_num_groups=4, addition_embed_type="text_time",
        addition_time_embed_dim=SDXL_TIME_EMBED,
        projection_class_embeddings_input_dim=6 * SDXL_TIME_EMBED + SDXL_CLIP_HIDDEN[1],
    )


def build_tiny_sdxl(latents_mean_std: bool = False) -> StableDiffusionXLPipeline:
    """latents_mean_std: a VAE configured with per-channel latent statistics (as Playground v2.5's)."""
    stats = dict(latents_mean=(0.1, -0.2, 0.05, 0.3), latents_std=(0.9, 1.1, 1.2, 0.8)) if latents_mean_std else {}
    return StableDiffusionXLPipeline(
        vae=_seeded(22, lambda: _vae(scaling_factor=0.13025, force_upcast=True, **stats)),
        text_encoder=_seeded(23, lambda: _clip(SDXL_CLIP_HIDDEN[0], projection=False)),
        text_encoder_2=_seeded(24, lambda: _clip(SDXL_CLIP_HIDDEN[1], projection=True)),
        tokenizer=_clip_tokenizer(),
        tokenizer_2=_clip_tokenizer(),
        unet=_seeded(21, _sdxl_unet),
        # SDXL base's scheduler config
        scheduler=EulerDiscreteScheduler(
            num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            steps_offset=1, timestep_spacing="leading", interpolation_type="linear", prediction_type="epsilon",
            use_karras_sigmas=False,
        ),
        force_zeros_for_empty_prompt=True,
    )


def save_tiny_sdxl(folder: Path, latents_mean_std: bool = False) -> None:
    build_tiny_sdxl(latents_mean_std).save_pretrained(folder)
