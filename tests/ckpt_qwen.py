"""Tiny Qwen-Image checkpoints (QwenImagePipeline, QwenImageEditPipeline) with random weights, saved with save_pretrained.

The real layout at toy sizes: a Qwen2.5-VL text encoder (its vision tower too, which the edit pipeline uses
to read the input image into the prompt), a byte-level BPE tokenizer with Qwen's special tokens, the
QwenImage MMDiT, Qwen-Image's 3D VAE (Wan-like, 8x spatial) and its flow-matching scheduler.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: Qwen's chat and vision tokens, at fixed ids after the 256 byte tokens
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>")
TEXT_HIDDEN = 32
Z_DIM = 4
SEEDS = {"text_encoder": 21, "transformer": 22, "vae": 23}
# Qwen-Image's scheduler config: dynamic (exponential) shifting towards a terminal sigma
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiny_tokenizer():
    from transformers import Qwen2TokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(_bytes_to_unicode().values()))}
    for tok in SPECIAL:
        vocab[tok] = len(vocab)
    tok = Qwen2TokenizerFast(vocab=vocab, merges=[], model_max_length=1024 + 64)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL[1:])})
    return tok


def _seeded(name: str, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEEDS[name])
        return build().eval()


def _text_encoder(tok):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (("image_token_id", "<|image_pad|>"),
           ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
           ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=None,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), **ids),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), **ids,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def build_tiny_qwen(edit: bool = False):
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    tok = tiny_tokenizer()
    parts = dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=_seeded("vae", lambda: AutoencoderKLQwenImage(
            base_dim=4, z_dim=Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
            # not 0 / 1, so that the (de)normalisation is exercised
            latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.2, 0.9, 1.1, 1.0])),
        text_encoder=_seeded("text_encoder", lambda: _text_encoder(tok)),
        tokenizer=tok,
        transformer=_seeded("transformer", lambda: QwenImageTransformer2DModel(
            patch_size=2, in_channels=Z_DIM * 4, out_channels=Z_DIM, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=TEXT_HIDDEN, axes_dims_rope=(4, 6, 6))),
    )
    if not edit:
        return QwenImagePipeline(**parts)
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    image_processor = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2,
                                            min_pixels=56 * 56, max_pixels=224 * 224)
    return QwenImageEditPipeline(**parts, processor=Qwen2VLProcessor(image_processor=image_processor, tokenizer=tok))


def save_tiny_qwen(folder: str | Path, edit: bool = False) -> None:
    build_tiny_qwen(edit).save_pretrained(folder)
