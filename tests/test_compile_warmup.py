"""A compiled denoiser's warm-up, in this process (disagg/roles/extensions/compile.py): every batch size a batching denoiser runs is
compiled at boot, so no request compiles (issue 44 M4), with the log telling the compile's progress; a step cache
beside it compiles nothing either; CUDA-graph modes are refused where torch would crash them (issue 44 H5)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from disagg.roles.extensions.compile import (
    CompileWatch,
    _Ticker,
    compile_stage,
    refuse_cudagraphs,
    warmup_batches,
    warmup_inputs,
)
from tests.conftest import COMPILE_CACHE

pytestmark = pytest.mark.usefixtures("one_thread")


# --- CUDA graphs and threads (H5) -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_are_refused_on_a_gpu_where_torch_crashes_them_off_the_compiling_thread(mode):
    for version in ("2.11.0+cu128", "2.12.1"):
        with pytest.raises(ValueError, match=f"compile.mode {mode} \\(--compile-mode\\) uses CUDA graphs, which crash "
                                             f"in torch {version.replace('+', '.')}"):
            refuse_cudagraphs(mode, "cuda:0", version)
    refuse_cudagraphs(mode, "cuda:0", "2.13.0+cu130")  # fixed there
    refuse_cudagraphs(mode, "cpu", "2.11.0")  # no CUDA graphs on the CPU


def test_modes_without_cuda_graphs_are_never_refused():
    for mode in ("default", "max-autotune-no-cudagraphs"):
        refuse_cudagraphs(mode, "cuda:0", "2.11.0+cu128")


# --- progress while compiling (M4) ------------------------------------------------------------------------------


def test_the_ticker_tells_what_compiles_and_for_how_long_until_it_ends(caplog):
    told, ticked = [], threading.Event()

    def hook(what, so_far):
        told.append((what, so_far))
        if len(told) >= 3:
            ticked.set()

    with caplog.at_level(logging.INFO, logger="disagg.role"), _Ticker(time.perf_counter(), hook, every_s=0.01) as t:
        t.say("warming up at 64x64, batch 2")
        assert ticked.wait(30)
    n = len(told)
    assert all(what == "warming up at 64x64, batch 2" for what, _ in told)
    assert [s for _, s in told] == sorted(s for _, s in told)
    assert "compiling: warming up at 64x64, batch 2 (0 s so far)" in caplog.messages
    assert t._thread is not None and not t._thread.is_alive() and len(told) == n  # it stopped with the block


def test_a_compile_after_boot_is_logged_and_counts_as_progress_while_it_runs(caplog):
    """A compile inside a request (here any dynamo compile: the watch is the process's) ticks the instance's
    progress while it runs, so the stall detector does not take a long compile for a hang; it stops with it."""
    ticks, ticked = [], threading.Event()

    def tick():
        ticks.append(1)
        ticked.set()

    def slow(x):
        assert ticked.wait(60)  # dynamo runs this while tracing: the compile lasts until a tick came
        return x + 1

    watch = CompileWatch(tick, every_s=0.01).install()
    try:
        with caplog.at_level(logging.INFO, logger="disagg.role"):
            assert torch.compile(slow, backend="eager")(torch.zeros(1)).item() == 1.0
    finally:
        watch.remove()
    # (the wait breaks the graph: dynamo compiles the frames around it, each one told)
    assert ticks and watch.compiles >= 1 and watch._ticker is None  # its ticker stopped (joined) with the compile
    assert any(m.startswith("compiling inside a request") for m in caplog.messages), caplog.messages
    assert any(m.startswith("compiled inside a request in ") for m in caplog.messages), caplog.messages


# --- every batch size compiled at boot (M4) ---------------------------------------------------------------------


def graphs() -> int:
    from torch._dynamo import utils

    return utils.counters["stats"]["unique_graphs"]


@pytest.mark.timeout(600)
def test_a_compiled_batching_denoiser_compiles_every_batch_size_at_boot_and_nothing_in_requests(caplog):
    """max_batch 2: a batch of 2 compiled inside a request for ~50 s on this CPU (no step's progress meanwhile)."""
    from disagg.roles.extensions.step_cache import make_caches
    from disagg.roles.pipelines.tiny import TinyFluxAdapter
    from disagg.roles.stage import Stage
    from disagg.transport.wire.messages import GenerationParams

    den = TinyFluxAdapter("denoiser")
    stage = Stage("denoiser", den, max_batch=2, caches=make_caches(den, "denoiser", None))
    assert warmup_batches(stage) == [1, 2]
    with caplog.at_level(logging.INFO, logger="disagg.role"):
        compile_stage(stage, "default", ["64x64"], str(COMPILE_CACHE), "blocks")
    assert any(m.startswith("compiling: warming up at 64x64, batch 2 (") and m.endswith(" s so far)")
               for m in caplog.messages), caplog.messages
    compiled = graphs()
    assert compiled > 0
    # a batch of 2, as the batcher runs it
    p = {**den.defaults(), "width": 64, "height": 64, "num_inference_steps": 3, "prompt": "a batch"}
    with torch.inference_mode():
        states = [den.denoise_start(warmup_inputs(den), p) for _ in range(2)]
        while not states[0].done:
            den.denoise_steps(states)
    assert graphs() == compiled, "a batch of 2 compiled inside a request"
    # a request with a step cache (uncompiled meanwhile), then one without: still nothing compiled
    for cache in ({"type": "first_block", "threshold": 0.3}, None):
        out = stage.run(GenerationParams(prompt="a cat", width=64, height=64, num_inference_steps=3, cache=cache),
                        warmup_inputs(den))
        assert out.tensors
    assert graphs() == compiled, "a cached request, or the next one, compiled"
