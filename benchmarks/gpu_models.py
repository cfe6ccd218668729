"""Write a diffusers checkpoint without weights, that each role fills with random weights of the real shapes.

    python benchmarks/gpu_models.py flux /tmp/flux-random            # FLUX.1-dev's shapes (12B DiT, T5-XXL)
    python benchmarks/gpu_models.py flux /tmp/flux-toy --scale toy   # the same layout at toy sizes (CPU)
    python benchmarks/gpu_models.py wan /tmp/wan-random              # Wan 2.1 T2V 1.3B's shapes (UMT5-XXL)

The folder holds model_index.json, each component's config.json, the scheduler's and the tokenizers'
files, and `random_weights.json`: disagg's roles then build their own components from the configs
(disagg/roles/pipelines/random_weights.py), on their device, instead of loading weights. Nothing is
downloaded: the tokenizers are the tiny in-memory ones (their ids fit any vocabulary).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: FLUX.1-dev, as diffusers' and transformers' configs for black-forest-labs/FLUX.1-dev give them
FLUX = {
    "transformer": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                        guidance_embeds=True, axes_dims_rope=[16, 56, 56]),
    "vae": dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
                layers_per_block=2, down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
                use_quant_conv=False, use_post_quant_conv=False, force_upcast=True),
    "text_encoder": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768,
                         num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
                         hidden_act="quick_gelu"),
    "text_encoder_2": dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                           relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}
#: the same layout at toy sizes: what the CPU dry run and tests build in a second
TOY = {
    "transformer": dict(FLUX["transformer"], in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6]),
    "vae": dict(FLUX["vae"], latent_channels=4, block_out_channels=[8, 16, 16, 16], layers_per_block=1,
                norm_num_groups=4, sample_size=128),
    "text_encoder": dict(FLUX["text_encoder"], hidden_size=32, intermediate_size=64, projection_dim=32,
                         num_hidden_layers=2, num_attention_heads=4),
    "text_encoder_2": dict(FLUX["text_encoder_2"], d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                           relative_attention_num_buckets=8),
}
CLASSES = {"transformer": ("diffusers", "FluxTransformer2DModel"), "vae": ("diffusers", "AutoencoderKL"),
           "text_encoder": ("transformers", "CLIPTextModel"), "text_encoder_2": ("transformers", "T5EncoderModel"),
           "tokenizer": ("transformers", "CLIPTokenizer"), "tokenizer_2": ("transformers", "T5TokenizerFast"),
           "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler")}
SEEDS = {"text_encoder": 1, "text_encoder_2": 2, "transformer": 3, "vae": 4}


def write_flux(folder: Path, scale: str = "real") -> Path:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, T5Config

    from disagg.roles.pipelines.random_weights import MARKER
    from disagg.roles.pipelines.tiny import SCHEDULER_CONFIG, _clip_tokenizer, _t5_tokenizer

    sizes = FLUX if scale == "real" else TOY
    folder.mkdir(parents=True, exist_ok=True)
    clip_tok, t5_tok = _clip_tokenizer(), _t5_tokenizer()
    clip_tok.save_pretrained(folder / "tokenizer")
    t5_tok.save_pretrained(folder / "tokenizer_2")
    CLASSES["tokenizer_2"] = ("transformers", type(t5_tok).__name__)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(folder / "scheduler")
    for name, cls in (("transformer", FluxTransformer2DModel), ("vae", AutoencoderKL)):
        (folder / name).mkdir(exist_ok=True)
        config = {"_class_name": cls.__name__, "_diffusers_version": "0.42.1", **sizes[name]}
        (folder / name / "config.json").write_text(json.dumps(config, indent=1))
    ids = dict(bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id)
    CLIPTextConfig(**sizes["text_encoder"], **ids).save_pretrained(folder / "text_encoder")
    T5Config(**sizes["text_encoder_2"], pad_token_id=t5_tok.pad_token_id, eos_token_id=t5_tok.eos_token_id,
             decoder_start_token_id=t5_tok.pad_token_id).save_pretrained(folder / "text_encoder_2")
    index = {"_class_name": "FluxPipeline", "_diffusers_version": "0.42.1", **{k: list(v) for k, v in CLASSES.items()}}
    (folder / "model_index.json").write_text(json.dumps(index, indent=1))
    (folder / MARKER).write_text(json.dumps({"scale": scale, "seeds": SEEDS}, indent=1))
    return folder


#: Wan 2.1 T2V 1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers): the DiT, UMT5-XXL and the Wan 2.1 VAE
WAN = {
    "transformer": dict(patch_size=[1, 2, 2], num_attention_heads=12, attention_head_dim=128, in_channels=16,
                        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    "vae": dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]),
    "text_encoder": dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                         relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


def write_wan(folder: Path, scale: str = "real") -> Path:
    """The tiny Wan 2.1 checkpoint's files (tokenizer, scheduler, model_index), its models' configs replaced by
    Wan 2.1 1.3B's (real) or kept (toy), and no weights."""
    from transformers import UMT5Config

    from disagg.roles.pipelines.random_weights import MARKER
    from tests.ckpt_wan import save_tiny_wan

    save_tiny_wan(folder)
    for name in ("transformer", "vae", "text_encoder"):
        for weights in (folder / name).glob("*.safetensors"):
            weights.unlink()
        if scale != "real":
            continue
        if name == "text_encoder":
            old = json.loads((folder / name / "config.json").read_text())
            UMT5Config(**WAN[name], pad_token_id=old["pad_token_id"], eos_token_id=old["eos_token_id"],
                       decoder_start_token_id=old["decoder_start_token_id"]).save_pretrained(folder / name)
        else:
            config = json.loads((folder / name / "config.json").read_text())
            config.update(WAN[name])
            (folder / name / "config.json").write_text(json.dumps(config, indent=1))
    (folder / MARKER).write_text(json.dumps({"scale": scale, "seeds": {"text_encoder": 11, "transformer": 12, "vae": 14}}))
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", choices=["flux", "wan"])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--scale", choices=["real", "toy"], default="real")
    args = ap.parse_args()
    print((write_flux if args.family == "flux" else write_wan)(args.folder, args.scale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
