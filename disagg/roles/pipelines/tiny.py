"""Tiny, randomly initialised FluxPipeline split into encoder / denoiser / decoder roles."""

from __future__ import annotations

import string

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.image_processor import VaeImageProcessor
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

from disagg.roles.pipelines.flux import T5_MAX_LENGTH, FluxSplit

# Seeds are per component so that a process building only one component gets the same weights as one building all.
COMPONENT_SEEDS = {"text_encoder": 1, "text_encoder_2": 2, "transformer": 3, "vae": 4}

ROLE_COMPONENTS = {
    "encoder": ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
    "denoiser": ("transformer", "scheduler"),
    "decoder": ("vae",),
}
ROLE_COMPONENTS["all"] = tuple(c for names in ROLE_COMPONENTS.values() for c in names)

_WORDS = ("a the an of and in on with at cat dog man woman car tree house sky sun red blue green photo "
          "painting portrait city night forest river mountain beach flower bird").split()
_CHARS = string.ascii_lowercase + string.digits + ".,!?'-"

CLIP_MAX_LENGTH = 77
HIDDEN = 32  # shared width: CLIP pooled dim == pooled_projection_dim, T5 d_model == joint_attention_dim

TRANSFORMER_CONFIG = dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=HIDDEN, pooled_projection_dim=HIDDEN, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
)
# Four blocks -> vae_scale_factor 8, the value FluxPipeline assumes when it has no VAE.
VAE_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16, 16), layers_per_block=1,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=4,
    sample_size=128, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
)
VAE_SCALE_FACTOR = 2 ** (len(VAE_CONFIG["block_out_channels"]) - 1)
# FLUX.1-dev's scheduler config; without dynamic shifting the pipeline's resolution-dependent `mu` is ignored.
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096,
)


def _clip_tokenizer() -> CLIPTokenizer:
    # Byte-level BPE: every char alone and as a word end, plus left-to-right merges spelling out common words.
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for tok in [*_CHARS, *(c + "</w>" for c in _CHARS)]:
        vocab.setdefault(tok, len(vocab))
    merges = []
    for word in _WORDS:
        pieces = [*word[:-1], word[-1] + "</w>"]
        left = pieces[0]
        for right in pieces[1:]:
            if (left, right) not in merges:
                merges.append((left, right))
            left += right
            vocab.setdefault(left, len(vocab))
    # vocab=/merges= are the transformers-5 in-memory spelling; vocab_file= would be silently ignored.
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)


def _t5_tokenizer() -> T5Tokenizer:
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    # T5 does not lowercase, so upper-case letters need their own pieces.
    chars = _CHARS + string.ascii_uppercase
    pieces += [(c, -5.0) for c in chars] + [("\u2581" + c, -4.0) for c in chars]
    pieces += [("\u2581" + w, -1.0) for w in _WORDS if len(w) > 1]
    # extra_ids=0: otherwise 100 sentinel tokens are appended beyond our vocab.
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


def _clip_text_model() -> CLIPTextModel:
    tok = _clip_tokenizer()
    config = CLIPTextConfig(
        vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=64, projection_dim=HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=CLIP_MAX_LENGTH, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    return CLIPTextModel(config)


def _t5_encoder() -> T5EncoderModel:
    tok = _t5_tokenizer()
    config = T5Config(
        vocab_size=len(tok), d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id,
    )
    return T5EncoderModel(config)


_BUILDERS = {
    "text_encoder": _clip_text_model,
    "tokenizer": _clip_tokenizer,
    "text_encoder_2": _t5_encoder,
    "tokenizer_2": _t5_tokenizer,
    "transformer": lambda: FluxTransformer2DModel(**TRANSFORMER_CONFIG),
    "vae": lambda: AutoencoderKL(**VAE_CONFIG),
    "scheduler": lambda: FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
}


def build_component(name: str):
    """Build one pipeline component with weights that depend only on its name."""
    if name not in COMPONENT_SEEDS:
        return _BUILDERS[name]()
    # fork_rng keeps the caller's global RNG untouched; devices=[] avoids touching CUDA generators.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(COMPONENT_SEEDS[name])
        module = _BUILDERS[name]()
    # Default dtype is float32 already; an explicit .to(float32) makes diffusers warn about fp32 modules.
    return module.eval()


def _pipeline(names, device: str = "cpu") -> FluxPipeline:
    return assemble({name: build_component(name) if name in names else None for name in ROLE_COMPONENTS["all"]}, device)


def assemble(components: dict, device: str = "cpu") -> FluxPipeline:
    """A FluxPipeline of these components (None for the ones a role does not hold), pinned to the tiny sizes."""
    pipe = FluxPipeline(**components)
    # Without a VAE / CLIP tokenizer the constructor falls back to defaults; pin them to the tiny configs.
    pipe.vae_scale_factor = VAE_SCALE_FACTOR
    pipe.image_processor = VaeImageProcessor(vae_scale_factor=VAE_SCALE_FACTOR * 2)
    pipe.tokenizer_max_length = CLIP_MAX_LENGTH
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def build_tiny_flux_pipeline(device: str = "cpu") -> FluxPipeline:
    """Build the full tiny FluxPipeline (the single-process reference)."""
    return _pipeline(ROLE_COMPONENTS["all"], device)


class TinyFluxAdapter(FluxSplit):
    """Runs one stage (or all) of the tiny FluxPipeline built in memory."""

    def __init__(self, role: str, device: str = "cpu"):
        if role not in ROLE_COMPONENTS:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(ROLE_COMPONENTS)}")
        self.role = role
        self.device = device
        self.pipe = _pipeline(ROLE_COMPONENTS[role], device)

    @staticmethod
    def defaults() -> dict:
        return dict(width=128, height=128, num_inference_steps=4, guidance_scale=3.5, num_images_per_prompt=1,
                    negative_prompt=None, seed=0)

    def components_loaded(self) -> dict[str, int]:
        out = {}
        for name in ROLE_COMPONENTS[self.role]:
            comp = getattr(self.pipe, name)
            out[name] = sum(t.numel() for t in comp.parameters()) if isinstance(comp, torch.nn.Module) else 0
        return out
