"""Tiny Wan 2.1 / 2.2 text-to-video checkpoints (WanPipeline) with random weights, saved with save_pretrained.

The layout is the real one (UMT5 text encoder, WanTransformer3DModel, AutoencoderKLWan, UniPC flow scheduler;
Wan 2.2 A14B adds `transformer_2` and `boundary_ratio`; Wan 2.2 TI2V-5B has one transformer, per-token
timesteps and a 48-channel VAE that downsamples 16x) at a size that runs 2 steps of 32x32, 9 frames in
well under a second on a CPU.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

# Per-component seeds: the weights of one component do not depend on which others are built.
COMPONENT_SEEDS = {"text_encoder": 11, "transformer": 12, "transformer_2": 13, "vae": 14}

TEXT_DIM = 32  # UMT5 d_model == the transformer's text_dim
MAX_LENGTH = 512  # WanPipeline.__call__'s max_sequence_length

TRANSFORMER_CONFIG = dict(
    # head dim 12 splits into rope axes (t, h, w) = (4, 4, 4)
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
    text_dim=TEXT_DIM, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
)
# Three down stages (two of them temporal) -> 8x spatial, 4x temporal, as the real Wan 2.1 VAE.
VAE_CONFIG = dict(
    base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
)
# Wan 2.2 TI2V-5B's VAE: residual blocks, 2x2 patchified pixels (12 channels), 48 latent channels; three down
# stages and the patching make 16x spatial, which only the config's scale_factor_spatial says.
TI2V_Z_DIM = 48
TI2V_VAE_CONFIG = dict(
    base_dim=4, z_dim=TI2V_Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
    is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
    scale_factor_temporal=4,
    # not 0 / 1, so that the decoder's un-normalisation is exercised
    latents_mean=[round(0.1 * (i % 7 - 3), 2) for i in range(TI2V_Z_DIM)],
    latents_std=[round(1.0 + 0.2 * (i % 5), 2) for i in range(TI2V_Z_DIM)],
)
# Wan2.1-T2V's scheduler (flow matching through UniPC, shift 3.0 for 480p).
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
)
# Wan2.2-T2V-A14B switches from `transformer` (high noise) to `transformer_2` at t < 0.875 * 1000; with the
# shift above, 2 steps run at t = 999 and 750, one on each.
BOUNDARY_RATIO = 0.875

_WORDS = ("a the an of and in on with at cat dog man woman car tree house sky sun red blue green photo "
          "video painting city night forest river mountain beach flower bird walks runs flies").split()


def tiny_tokenizer() -> T5Tokenizer:
    """A T5-style unigram tokenizer built in memory (Wan uses UMT5's; transformers 5 takes `vocab=` pieces)."""
    chars = string.ascii_letters + string.digits + ".,!?'-"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -5.0) for c in chars] + [("\u2581" + c, -4.0) for c in chars]
    pieces += [("\u2581" + w, -1.0) for w in _WORDS if len(w) > 1]
    # extra_ids=0: no 100 sentinel tokens beyond our vocab
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=MAX_LENGTH)


def _text_encoder(tok: T5Tokenizer) -> UMT5EncoderModel:
    config = UMT5Config(
        vocab_size=len(tok), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id,
    )
    return UMT5EncoderModel(config)


def _seeded(name: str, build):
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
        torch.manual_seed(COMPONENT_SEEDS[name])
        return build().eval()


def build_tiny_wan(v22: bool = False, *, ti2v: bool = False) -> WanPipeline:
    tok = tiny_tokenizer()
    if ti2v:
        vae_config = TI2V_VAE_CONFIG
        transformer_config = {**TRANSFORMER_CONFIG, "in_channels": TI2V_Z_DIM, "out_channels": TI2V_Z_DIM}
    else:
        vae_config, transformer_config = VAE_CONFIG, TRANSFORMER_CONFIG
    two = v22 and not ti2v
    return WanPipeline(
        tokenizer=tok,
        text_encoder=_seeded("text_encoder", lambda: _text_encoder(tok)),
        vae=_seeded("vae", lambda: AutoencoderKLWan(**vae_config)),
        scheduler=UniPCMultistepScheduler(**SCHEDULER_CONFIG),
        transformer=_seeded("transformer", lambda: WanTransformer3DModel(**transformer_config)),
        transformer_2=_seeded("transformer_2", lambda: WanTransformer3DModel(**transformer_config)) if two else None,
        boundary_ratio=BOUNDARY_RATIO if two else None,
        expand_timesteps=ti2v,
    )


def save_tiny_wan(folder: str | Path, v22: bool = False, *, ti2v: bool = False) -> None:
    """Wan 2.1 T2V's layout at a tiny size; v22: Wan 2.2 T2V-A14B's (two transformers, boundary_ratio);
    ti2v: Wan 2.2 TI2V-5B's (one transformer, expand_timesteps, 48-channel VAE at 16x)."""
    build_tiny_wan(v22, ti2v=ti2v).save_pretrained(folder)


# --- Wan 2.1 image-to-video (WanImageToVideoPipeline) ----------------------------------------------------
# A CLIP vision tower (its penultimate hidden states condition the transformer through image_dim), and a
# transformer that takes the noisy latents (16), the first frame's mask (4: one per frame of a temporal
# group) and the conditioning video's latents (16): in_channels 36, as Wan2.1-I2V's.
CLIP_VISION_HIDDEN = 16


def _image_encoder():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    return CLIPVisionModel(CLIPVisionConfig(hidden_size=CLIP_VISION_HIDDEN, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, image_size=32, patch_size=8, projection_dim=16))


def build_tiny_wan_i2v():
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor

    tok = tiny_tokenizer()
    inner = TRANSFORMER_CONFIG["num_attention_heads"] * TRANSFORMER_CONFIG["attention_head_dim"]
    transformer_config = {**TRANSFORMER_CONFIG, "in_channels": 36, "image_dim": CLIP_VISION_HIDDEN,
                          "added_kv_proj_dim": inner}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(15)
        image_encoder = _image_encoder().eval()
    return WanImageToVideoPipeline(
        tokenizer=tok,
        text_encoder=_seeded("text_encoder", lambda: _text_encoder(tok)),
        vae=_seeded("vae", lambda: AutoencoderKLWan(**VAE_CONFIG)),
        scheduler=UniPCMultistepScheduler(**SCHEDULER_CONFIG),
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        image_encoder=image_encoder,
        transformer=_seeded("transformer", lambda: WanTransformer3DModel(**transformer_config)),
    )


def save_tiny_wan_i2v(folder: str | Path) -> None:
    build_tiny_wan_i2v().save_pretrained(folder)
