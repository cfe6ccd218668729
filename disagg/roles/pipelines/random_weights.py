"""Checkpoints without weights: each role builds its own components from their configs, with random weights.

A folder holding `random_weights.json` beside `model_index.json` is one (benchmarks/gpu_models.py writes
them). Real-size models can so be measured on a machine that cannot download their weights: the
shapes, and so every cost, are the real ones. Each component's weights come from its own seed, so two
processes that build the same component (a denoiser, and a colocated instance) hold the same weights.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

MARKER = "random_weights.json"


def is_random(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def build_components(path: Path, index: dict, names: list[str], device: str, dtype: torch.dtype) -> dict:
    """The modules among `names` (not tokenizers or schedulers), built on `device` in `dtype`."""
    path = Path(path)
    seeds = json.loads((path / MARKER).read_text()).get("seeds", {})
    out = {}
    for name in names:
        library, cls_name = index[name]
        if not (path / name / "config.json").is_file() or library not in ("diffusers", "transformers"):
            continue  # tokenizers and schedulers: loaded from their files as usual
        cls = getattr(importlib.import_module(library), cls_name)
        default = torch.get_default_dtype()
        # built in place, in its dtype: a 12B transformer never exists in float32, nor on the host
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(int(seeds.get(name, 0)))
            torch.set_default_dtype(dtype)
            try:
                if library == "diffusers":
                    module = cls.from_config(cls.load_config(path / name))
                else:
                    from transformers import AutoConfig

                    module = cls._from_config(AutoConfig.from_pretrained(path / name), dtype=dtype)
            finally:
                torch.set_default_dtype(default)
        out[name] = module.eval()
    return out
