"""Compiled denoisers (compile: true, roles/compile.py) over real processes: the denoiser shows `compiling` while
it warms up, reports its compile time once ready, and its images equal the uncompiled pipeline's within 2/255."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from client import Client, Unreachable
from tests.conftest import COMPILE_CACHE, Launched, wait_until
from transport.messages import GenerationParams

pytestmark = pytest.mark.e2e


def test_a_compiled_tiny_flux_warms_up_before_ready_and_equals_the_uncompiled_pipeline(tmp_path):
    from roles.pipelines.tiny import build_tiny_flux_pipeline

    config = tmp_path / "compiled.yaml"
    config.write_text(f"model: tiny\ncompile: true\ncompile_sizes: [64x64]\ncompile_cache_dir: {COMPILE_CACHE}\n"
                      "encoders: {count: 1, capacity: 1}\ndenoisers: {count: 1, capacity: 1}\n"
                      "decoders: {count: 1, capacity: 1}\n")
    dep = Launched(["--config", str(config), "--no-dashboard"], tmp_path)
    try:
        phases = set()

        def denoiser():
            try:
                found = [i for i in dep.status().instances if i.role == "denoiser"]
            except Unreachable:  # the orchestrator is not up yet
                return None
            for d in found:
                phases.add(d.phase if d.state == "starting" else d.state)
            return found[0] if found else None

        wait_until(lambda: (d := denoiser()) is not None and d.phase == "compiling", 120)  # the warm-up takes seconds
        dep.wait_ready(3, timeout=300)
        d = denoiser()
        assert d.compile_s > 0 and d.phase == "" and "compiling" in phases
        assert any(COMPILE_CACHE.iterdir())  # inductor's caches went where compile_cache_dir says
        params = GenerationParams(prompt="a red cat", width=64, height=64, num_inference_steps=4, seed=2)
        with Client(dep.endpoint) as client:
            [outcome] = client.run_all([params])
        assert outcome.ok, outcome.error
        got = np.asarray(Image.open(io.BytesIO(outcome.images[0])).convert("RGB"), dtype=int)
    finally:
        dep.stop()
    pipe = build_tiny_flux_pipeline()
    want = np.asarray(pipe(prompt="a red cat", width=64, height=64, num_inference_steps=4, guidance_scale=3.5,
                           generator=torch.Generator("cpu").manual_seed(2)).images[0], dtype=int)
    assert np.abs(got - want).max() <= 2
