"""Compiled denoisers: torch.compile on the transformer (diffusers' own regional compilation,
`compile_repeated_blocks`, or the model's `compile`, in place), warmed up at boot over the configured sizes
before the instance reports ready, so no request pays the compile.

A request with a step cache (roles/step_cache.py) runs the transformer uncompiled (`eager`): diffusers' cache hooks
keep Python state (step counters, a skip decision per step) that torch.compile would guard on, recompiling for
seconds in most cached requests, and the hooks that count its steps are not seen by code compiled before they
were registered (dynamo does not guard on a submodule's forward hooks), so its counts would be false.

Inductor's caches (FX graphs, AOT autograd, kernels) go to the deployment's `compile_cache_dir` (by default
`<run dir>/inductor`): an instance restarted, or started from a spare, finds the compiled kernels there and
skips most of the work (benchmarks/compile_boot.py measures it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

log = logging.getLogger("disagg.role")

#: denoising steps of a warm-up run (enough that every step's graph has run once)
WARMUP_STEPS = 2


def compiled_modules(models) -> list[torch.nn.Module]:
    """The modules of `models` that nn.Module.compile compiled (compile_stage's blocks, or the whole model)."""
    return [mod for m in models for mod in m.modules() if getattr(mod, "_compiled_call_impl", None) is not None]


@contextlib.contextmanager
def eager(models):
    """Run `models` uncompiled inside the block: their compiled modules call their plain `_call_impl` (the same
    forward, hooks and all) until it ends, when the compiled code, untouched, serves again. For every thread: a
    forward that another runs meanwhile (a batching denoiser's image task) runs uncompiled too, to the same result."""
    held = [(mod, mod._compiled_call_impl) for mod in compiled_modules(models)]
    for mod, _ in held:
        mod._compiled_call_impl = None
    try:
        yield
    finally:
        for mod, impl in held:
            mod._compiled_call_impl = impl


def parse_size(size: str) -> tuple[int, int]:
    w, _, h = size.lower().partition("x")
    return int(w), int(h)


def warmup_inputs(adapter) -> dict[str, torch.Tensor] | None:
    """Encoder outputs of the right shapes (zeros) for a warm-up denoise; None when the adapter's family has none."""
    pipe = adapter.pipe
    cfg = pipe.transformer.config
    dtype = next(pipe.transformer.parameters()).dtype
    device = adapter.device
    if hasattr(cfg, "pooled_projection_dim") and hasattr(cfg, "joint_attention_dim"):  # Flux
        from roles.pipelines.flux import T5_MAX_LENGTH

        return {"prompt_embeds": torch.zeros(1, T5_MAX_LENGTH, cfg.joint_attention_dim, dtype=dtype, device=device),
                "pooled_prompt_embeds": torch.zeros(1, cfg.pooled_projection_dim, dtype=dtype, device=device)}
    if hasattr(cfg, "text_dim"):  # Wan
        from roles.pipelines.wan import MAX_SEQUENCE_LENGTH

        embeds = torch.zeros(1, MAX_SEQUENCE_LENGTH, cfg.text_dim, dtype=dtype, device=device)
        return {"prompt_embeds": embeds, "negative_prompt_embeds": embeds.clone()}
    return None


def compile_stage(stage, mode: str, sizes: list[str], cache_dir: str, scope: str = "blocks") -> float:
    """Compile the stage's transformer(s) and run a warm-up denoise at each size; the seconds it took. `scope`:
    blocks (diffusers' compile_repeated_blocks, where the model names its repeated blocks) or model (the whole
    transformer)."""
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    adapter = stage.adapter
    pipe = getattr(adapter, "pipe", None)
    models = [getattr(pipe, name, None) for name in ("transformer", "transformer_2")] if pipe is not None else []
    models = [m for m in models if isinstance(m, torch.nn.Module)]
    if not models:
        raise ValueError(f"model {stage.model!r} has no diffusers transformer to compile")
    default = getattr(getattr(stage, "caches", None), "default", None)
    if default and default.get("type") != "none":
        log.warning("the cache setting (%s) gives every request a step cache, and a request with one runs the "
                    "transformer uncompiled: only requests with cache {type: none} use the compiled one",
                    default.get("type"))
    t0 = time.perf_counter()
    for m in models:
        if scope == "blocks" and getattr(m, "_repeated_blocks", None):
            # diffusers' regional compilation: each repeated block class compiles once, reused by every block
            m.compile_repeated_blocks(mode=mode)
        else:
            m.compile(mode=mode)
    inputs = warmup_inputs(adapter)
    defaults = adapter.defaults()
    for size in sizes or [f"{defaults['width']}x{defaults['height']}"]:
        if inputs is None:
            log.warning("no warm-up inputs for %s: its first request compiles", type(adapter).__name__)
            break
        w, h = parse_size(size)
        p = {**defaults, "width": w, "height": h, "num_inference_steps": WARMUP_STEPS, "prompt": "warm-up",
             "guidance_scale": defaults.get("guidance_scale", 1.0)}
        with torch.inference_mode():
            if stage.batcher is not None:  # the batched path's forward (one request: batch 1)
                state = adapter.denoise_start(inputs, p)
                while not state.done:
                    adapter.denoise_steps([state])
            else:
                adapter.denoise(inputs, p)
        log.info("compiled and warmed up at %s (%.1f s so far)", size, time.perf_counter() - t0)
    return time.perf_counter() - t0
