"""Compiled denoisers (compile: true, disagg/roles/extensions/compile.py) over real processes: the denoiser shows `compiling` while
it warms up, reports its compile time once ready, and its images equal the uncompiled pipeline's within 2/255;
requests with a step cache report the uncompiled denoiser's step counts, request after request."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from disagg.client import Client, Unreachable
from disagg.transport.wire.messages import GenerationParams
from tests.conftest import COMPILE_CACHE, Launched, wait_until

pytestmark = pytest.mark.e2e

#: the compiled deployment's timeouts.ready: less than its compile takes, even with inductor's caches warm
READY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def compiled(module_tmp):
    """A compiled tiny deployment once ready, with the phases its denoiser showed while it booted."""
    config = module_tmp / "compiled.yaml"
    # timeouts.ready far below the compile's time: it counts only time without progress, and a compile progresses
    config.write_text(f"model: tiny\ncompile: true\ncompile_sizes: [64x64]\ncompile_cache_dir: {COMPILE_CACHE}\n"
                      f"timeouts: {{ready: {READY_TIMEOUT_S}}}\n"
                      "encoders: {count: 1, capacity: 1}\ndenoisers: {count: 1, capacity: 1}\n"
                      "decoders: {count: 1, capacity: 1}\n")
    dep = Launched(["--config", str(config), "--no-dashboard"], module_tmp)
    dep.phases = set()

    def denoiser():
        try:
            found = [i for i in dep.status().instances if i.role == "denoiser"]
        except Unreachable:  # the orchestrator is not up yet
            return None
        for d in found:
            dep.phases.add(d.boot.phase if d.state == "starting" else d.state)
        return found[0] if found else None

    dep.denoiser = denoiser
    try:
        wait_until(lambda: (d := denoiser()) is not None and d.boot.phase == "compiling", 120)  # the warm-up takes seconds
        dep.wait_ready(3, timeout=300)
        yield dep
    finally:
        dep.stop()


def test_a_compiled_tiny_flux_warms_up_before_ready_and_equals_the_uncompiled_pipeline(compiled):
    from disagg.roles.pipelines.tiny import build_tiny_flux_pipeline

    d = compiled.denoiser()
    assert d.compile.seconds > 0 and d.boot.phase == "" and "compiling" in compiled.phases
    # it compiled for longer than timeouts.ready and the launch went on: the compile reported progress all along
    assert d.compile.seconds > READY_TIMEOUT_S, d.compile.seconds
    assert any(COMPILE_CACHE.iterdir())  # inductor's caches went where compile_cache_dir says
    params = GenerationParams(prompt="a red cat", width=64, height=64, num_inference_steps=4, seed=2)
    with Client(compiled.endpoint) as client:
        [outcome] = client.run_all([params])
    assert outcome.ok, outcome.error
    got = np.asarray(Image.open(io.BytesIO(outcome.images[0])).convert("RGB"), dtype=int)
    pipe = build_tiny_flux_pipeline()
    want = np.asarray(pipe(prompt="a red cat", width=64, height=64, num_inference_steps=4, guidance_scale=3.5,
                           generator=torch.Generator("cpu").manual_seed(2)).images[0], dtype=int)
    assert np.abs(got - want).max() <= 2


def test_a_compiled_denoiser_counts_cached_steps_as_the_uncompiled_one_request_after_request(compiled):
    """Issue D2 (tester 2026-12-04): the counting hooks were not in the compiled blocks' code, so after the first
    cached request the counts were false (first_block 0 computed / 8 skipped); a cached request now runs the
    transformer uncompiled (disagg/roles/extensions/compile.py eager)."""
    from disagg.roles.extensions.step_cache import make_caches
    from disagg.roles.pipelines.tiny import TinyFluxAdapter
    from disagg.roles.stage import Stage, params_dict

    first_block = {"type": "first_block", "threshold": 0.3}
    taylorseer = {"type": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1}
    requests = [GenerationParams(prompt=f"a blue circle {i}", width=64, height=64, num_inference_steps=8, seed=13,
                                 cache=spec)
                for i, spec in enumerate([first_block, taylorseer, first_block, None, first_block])]
    with Client(compiled.endpoint) as client:
        outcomes = [client.run_all([params])[0] for params in requests]  # one after another
    # the same requests on an uncompiled denoiser, in this process
    enc, den = TinyFluxAdapter("encoder"), TinyFluxAdapter("denoiser")
    stage = Stage("denoiser", den, caches=make_caches(den, "denoiser", None))
    for params, outcome in zip(requests, outcomes):
        assert outcome.ok, outcome.error
        inputs = enc.encode({**enc.defaults(), **params_dict(params)})
        want = stage.run(params, inputs).cache_steps
        got = {k: outcome.resolved[k] for k in ("cache", "steps_computed", "steps_skipped") if k in outcome.resolved}
        assert got == want, (params.cache, got, want)
        assert params.cache is None or want["steps_skipped"] > 0  # the cache skipped steps: the counts say something
