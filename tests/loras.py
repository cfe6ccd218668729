"""Real LoRA adapters for the tests: made with peft on a checkpoint's own denoiser (random, nonzero weights) and
saved with the pipeline's save_lora_weights, as a user's trained adapter would be."""

from __future__ import annotations

from pathlib import Path

import torch

#: attention projections of Flux's transformer and of SDXL's UNet
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def make_lora(checkpoint: Path, out: Path, seed: int, rank: int = 4, text_encoder: bool = False,
              alpha: int | None = None) -> Path:
    """An adapter for the checkpoint's denoiser (and, with text_encoder, its CLIP text encoder) saved to
    OUT/pytorch_lora_weights.safetensors; returns OUT. `alpha` (default: rank) other than rank: the denoiser part's
    lora_alpha, saved in the file's adapter metadata, as diffusers' training scripts save it."""
    import diffusers
    from peft import LoraConfig, get_peft_model_state_dict

    index = __import__("json").loads((checkpoint / "model_index.json").read_text())
    pipe_cls = getattr(diffusers, index["_class_name"])
    name = "unet" if "unet" in index else "transformer"
    module_cls = getattr(diffusers, index[name][1])
    module = module_cls.from_pretrained(checkpoint / name)
    layers = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=TARGETS, init_lora_weights=False)
        module.add_adapter(config)
        layers[f"{name}_lora_layers"] = get_peft_model_state_dict(module)
        if alpha is not None:
            layers[f"{name}_lora_adapter_metadata"] = config.to_dict()
        if text_encoder:
            import transformers
            from peft import inject_adapter_in_model

            te = getattr(transformers, index["text_encoder"][1]).from_pretrained(checkpoint / "text_encoder")
            # peft's own injection (transformers' add_adapter asks for a newer peft than PyPI has for transformers 5)
            te = inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                                                    target_modules=["q_proj", "k_proj", "v_proj", "out_proj"]), te)
            layers["text_encoder_lora_layers"] = get_peft_model_state_dict(te)
    # peft's random init draws lora_B small: scale it up, so an adapter visibly changes the image
    for part_name, part in layers.items():
        if part_name.endswith("_metadata"):
            continue
        for key, value in part.items():
            if "lora_B" in key:
                value.mul_(50.0)
    out.mkdir(parents=True, exist_ok=True)
    pipe_cls.save_lora_weights(out, **layers)
    return out


def reference(checkpoint: Path, loras: list[tuple[str, Path, float]]):
    """diffusers' own pipeline in this process, with the adapters loaded by load_lora_weights + set_adapters."""
    import diffusers

    index = __import__("json").loads((checkpoint / "model_index.json").read_text())
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    for name, path, _ in loras:
        pipe.load_lora_weights(path, adapter_name=name)
    if loras:
        pipe.set_adapters([n for n, _, _ in loras], [s for _, _, s in loras])
    return pipe
