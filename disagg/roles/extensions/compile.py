"""Compiled denoisers: torch.compile on the transformer (diffusers' own regional compilation,
`compile_repeated_blocks`, or the model's `compile`, in place), warmed up at boot over the configured sizes and,
for a batching denoiser, at batch 1 and its max_batch (a batch of another size is a new shape: dynamo would
recompile inside the request, with no step's progress for minutes), before the instance reports ready, so no
request pays the compile. While it warms up, the log says so every TICK_S ("compiling: ... (N s so far)"); a compile
inside a request afterwards (CompileWatch) is logged and counts as the instance's progress every TICK_S.

A request with a step cache (disagg/roles/extensions/step_cache.py) runs the transformer uncompiled (`eager`): diffusers' cache hooks
keep Python state (step counters, a skip decision per step) that torch.compile would guard on, recompiling for
seconds in most cached requests, and the hooks that count its steps are not seen by code compiled before they
were registered (dynamo does not guard on a submodule's forward hooks), so its counts would be false.

Inductor's caches (FX graphs, AOT autograd, kernels) go to the deployment's `compile.cache_dir` (by default
`<run dir>/inductor`): an instance restarted, or started from a spare, finds the compiled kernels there and
skips most of the work (benchmarks/compile_boot.py measures it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch

from disagg.settings.choices import CompileMode, CompileScope
from disagg.transport.environment import TORCHINDUCTOR_CACHE_DIR
from disagg.transport.wire.role_stats import CompileStats

log = logging.getLogger("disagg.role")

#: denoising steps of a warm-up run (enough that every step's graph has run once)
WARMUP_STEPS = 2

#: seconds between the log's "compiling: ... (N s so far)" lines while a warm-up compiles
TICK_S = 10.0

#: the first torch whose cudagraph trees work from a thread other than the one that compiled (pytorch#123177,
#: fixed by #184357, merged into main on 2026-06-01 when main was 2.13's development line: 2.13.0.dev20260518 still
#: failed; 2.13.0's `cudagraph_trees.get_obj` initialises a new thread's state instead of asserting)
CUDAGRAPH_THREADS_FIXED = (2, 13)


def refuse_cudagraphs(mode: str, device: str, torch_version: str = torch.__version__) -> None:
    """A ValueError naming the setting where `mode`'s CUDA graphs would crash at serving time: compiled and warmed
    up on the boot thread, they run on the executor and batcher threads, and torch before 2.13 keeps a CUDA graph
    tree's state in the compiling thread's storage only (`assert torch._C._is_key_in_tls` in another)."""
    if not CompileMode(mode).cuda_graphs or not device.startswith("cuda"):  # inductor's cudagraph trees
        return
    release = tuple(int(x) for x in torch_version.split("+")[0].split(".")[:2])
    if release < CUDAGRAPH_THREADS_FIXED:
        raise ValueError(f"compile.mode {mode} (--compile-mode) uses CUDA graphs, which crash in torch {torch_version} "
                         "when the compiled model runs on another thread than the one that compiled it, as a role's "
                         "requests do (pytorch#123177, fixed in torch 2.13): use compile.mode default or "
                         "max-autotune-no-cudagraphs, or torch >= 2.13")


class _Ticker:
    """While a warm-up runs: every TICK_S, a log line of what compiles and for how long so far, and `hook(what, s)`
    (a role that reports its boot phase takes it from there)."""

    def __init__(self, t0: float, hook=None, every_s: float | None = None):
        self.t0, self.hook, self.every_s = t0, hook, TICK_S if every_s is None else every_s
        self.what = ""
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def say(self, what: str) -> None:
        self.what = what
        self._tell()

    def _tell(self) -> None:
        so_far = time.perf_counter() - self.t0
        log.info("compiling: %s (%.0f s so far)", self.what, so_far)
        if self.hook is not None:
            self.hook(self.what, so_far)

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            self._tell()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, name="compile-ticker", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


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
        from disagg.roles.pipelines.flux import T5_MAX_LENGTH

        return {"prompt_embeds": torch.zeros(1, T5_MAX_LENGTH, cfg.joint_attention_dim, dtype=dtype, device=device),
                "pooled_prompt_embeds": torch.zeros(1, cfg.pooled_projection_dim, dtype=dtype, device=device)}
    if hasattr(cfg, "text_dim"):  # Wan
        from disagg.roles.pipelines.wan import MAX_SEQUENCE_LENGTH

        embeds = torch.zeros(1, MAX_SEQUENCE_LENGTH, cfg.text_dim, dtype=dtype, device=device)
        return {"prompt_embeds": embeds, "negative_prompt_embeds": embeds.clone()}
    return None


class CompileWatch:
    """Once the warm-up is done, a compile is one inside a request (a size not in compile.sizes, a batch of images,
    an adapter's new layers): it may take minutes, with no denoising step meanwhile. While one runs, every TICK_S:
    a log line, and `tick()` (the instance's progress counter, which its heartbeats carry), so the orchestrator's
    stall detector sees a compile that progresses, not a hung instance. Told by dynamo's compile callbacks."""

    def __init__(self, tick, every_s: float | None = None):
        self.tick, self.every_s = tick, TICK_S if every_s is None else every_s
        self._ticker: _Ticker | None = None
        self.compiles = 0

    def install(self) -> CompileWatch:
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def remove(self) -> None:
        from torch._dynamo.callback import callback_handler

        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)

    def _start(self, *_args) -> None:
        self.compiles += 1
        log.warning("compiling inside a request: a shape or adapter not warmed up at boot (compile.sizes, max_batch)")
        self._ticker = _Ticker(time.perf_counter(), lambda what, s: self.tick(), self.every_s).__enter__()
        self._ticker.what = "inside a request"

    def _end(self, *_args) -> None:
        if self._ticker is not None:
            self._ticker.__exit__(None, None, None)
            log.info("compiled inside a request in %.1f s", time.perf_counter() - self._ticker.t0)
            self._ticker = None


def warmup_batches(stage) -> list[int]:
    """The batch sizes a warm-up runs at each size: 1, and for a batching denoiser 2 and its max_batch (the second
    size of a dimension makes dynamo compile it dynamic, so the sizes between are compiled too)."""
    top = stage.batcher.max_batch if stage.batcher is not None else 1
    return sorted({1, min(2, top), top})


def compile_stage(stage, mode: str, sizes: list[str], cache_dir: str, scope: str = CompileScope.BLOCKS,
                  hook=None) -> CompileStats:
    """Compile the stage's transformer(s) and run a warm-up denoise at each size and batch size (warmup_batches);
    what its heartbeats say of it: the seconds it took. `scope`: blocks (diffusers' compile_repeated_blocks, where the model names its repeated
    blocks) or model (the whole transformer). `hook(what, seconds_so_far)`: told at each warm-up and every TICK_S."""
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ[TORCHINDUCTOR_CACHE_DIR] = cache_dir
    adapter = stage.adapter
    pipe = adapter.pipe if stage.caps.family else None  # only a diffusers pipeline's transformer compiles
    models = [getattr(pipe, name, None) for name in ("transformer", "transformer_2")] if pipe is not None else []
    models = [m for m in models if isinstance(m, torch.nn.Module)]
    if not models:
        raise ValueError(f"model {stage.model!r} has no diffusers transformer to compile")
    default = getattr(getattr(stage, "caches", None), "default", None)
    if default and default.get("type") != "none":
        log.warning("the cache setting (%s) gives every request a step cache, and a request with one runs the "
                    "transformer uncompiled: only requests with cache {type: none} use the compiled one",
                    default.get("type"))
    mode = CompileMode(mode).value  # torch.compile's own spelling
    t0 = time.perf_counter()
    for m in models:
        if scope == CompileScope.BLOCKS and getattr(m, "_repeated_blocks", None):
            # diffusers' regional compilation: each repeated block class compiles once, reused by every block
            m.compile_repeated_blocks(mode=mode)
        else:
            m.compile(mode=mode)
    inputs = warmup_inputs(adapter)
    defaults = adapter.defaults()
    if inputs is None:
        log.warning("no warm-up inputs for %s: its first request compiles", type(adapter).__name__)
        return CompileStats(seconds=round(time.perf_counter() - t0, 3))
    with _Ticker(t0, hook) as ticker:
        for size in sizes or [f"{defaults['width']}x{defaults['height']}"]:
            w, h = parse_size(size)
            p = {**defaults, "width": w, "height": h, "num_inference_steps": WARMUP_STEPS, "prompt": "warm-up",
                 "guidance_scale": defaults.get("guidance_scale", 1.0)}
            for batch in warmup_batches(stage):
                ticker.say(f"warming up at {size}, batch {batch}")
                with torch.inference_mode():
                    if stage.batcher is not None:  # the batched path's forward, as the batcher runs it
                        states = [adapter.denoise_start(inputs, p) for _ in range(batch)]
                        while not states[0].done:
                            adapter.denoise_steps(states)
                    else:
                        adapter.denoise(inputs, p)
            log.info("compiled and warmed up at %s (%.1f s so far)", size, time.perf_counter() - t0)
    return CompileStats(seconds=round(time.perf_counter() - t0, 3))
