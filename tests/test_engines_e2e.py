"""The tiny pipeline end to end once per transfer engine, each checked against diffusers itself."""

from __future__ import annotations

import importlib.util
import io

import numpy as np
import pytest
from PIL import Image

from disagg.client import Client
from disagg.transport.wire.messages import GenerationParams
from tests.conftest import Launched, wait_until

pytestmark = pytest.mark.e2e

#: shm is what `auto` picks on one host: tests/test_e2e.py checks it there (parity, the engine, free pools)
ENGINES = ["inline"] + (["mooncake"] if importlib.util.find_spec("mooncake") else [])


@pytest.fixture(scope="module", params=ENGINES)
def deployment(request, tmp_path_factory):
    dep = Launched(["-e", "1", "-d", "1", "-k", "1", "--no-dashboard", "--transfer", request.param],
                   tmp_path_factory.mktemp(f"engine-{request.param}"))
    dep.engine = request.param
    try:
        dep.wait_ready(3)
        yield dep
    finally:
        dep.stop()


def test_parity_and_engine_and_no_leaks(deployment):
    import torch

    from disagg.roles.pipelines.tiny import build_tiny_flux_pipeline

    cases = [dict(prompt="a cat in a city at night", width=96, height=64, num_inference_steps=3, seed=11),
             dict(prompt="a mountain river", width=128, height=128, seed=12, num_images_per_prompt=2, num_inference_steps=2)]
    with Client(deployment.endpoint) as client:
        outcomes = client.run_all([GenerationParams(**c) for c in cases], concurrency=2)
        assert all(o.ok for o in outcomes), [o.error for o in outcomes]
        pipe = build_tiny_flux_pipeline()
        for case, outcome in zip(cases, outcomes):
            p = dict(case)
            ref = pipe(p.pop("prompt"), generator=torch.Generator("cpu").manual_seed(p.pop("seed")), **p).images
            for data, want in zip(outcome.images, ref):
                got = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)
                assert np.abs(got - np.asarray(want, dtype=np.int16)).max() <= 1
            assert outcome.timings["fetch_denoiser"] > 0 and outcome.timings["fetch_decoder"] > 0
        report = client.status()
        consumers = [i for i in report.instances if i.role != "encoder"]
        assert all(i.engine == deployment.engine for i in consumers), [(i.id, i.engine) for i in consumers]
        if deployment.engine == "mooncake":
            assert all(i.session_id.startswith("127.0.0.1:") and i.base_addr > 0 for i in report.instances)
        # every slot comes back: the orchestrator's view and what each role reports
        def all_free():
            r = client.status()
            return r if all(i.pool_free_bytes == i.pool_bytes for i in r.instances) else None

        report = wait_until(all_free, timeout=5, step=0.2, why=lambda: client.status().instances)
        for inst in report.instances:
            assert inst.pool_used_bytes == 0 and inst.pool_free_bytes == inst.pool_bytes, inst
            assert inst.free_slots == inst.capacity
