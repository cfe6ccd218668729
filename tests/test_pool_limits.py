"""Payloads against pool limits over real processes (the compute-free `payload` model)."""

from __future__ import annotations

import time

import pytest

from disagg.client import Client
from disagg.transport.wire.messages import GenerationParams
from tests.conftest import Launched, wait_until

pytestmark = pytest.mark.e2e

CONFIG = """
model: payload
denoisers: {count: 1, capacity: 2, pool_mib: 16}
"""


@pytest.fixture(scope="module")
def deployment(module_tmp):
    cfg = module_tmp / "payload.yaml"
    cfg.write_text(CONFIG)
    dep = Launched(["--config", str(cfg), "--no-dashboard"], module_tmp)
    try:
        dep.wait_ready(3)
        yield dep
    finally:
        dep.stop()


def test_oversized_payload_fails_alone_with_both_sizes(deployment):
    too_big = GenerationParams(prompt="big", width=4096, height=2048, seed=1)  # 32 MiB into a 16 MiB pool
    fine = [GenerationParams(prompt=f"ok {i}", width=1024, height=1024, seed=i) for i in range(6)]  # 4 MiB each
    with Client(deployment.endpoint) as client:
        outcomes = client.run_all([fine[0], too_big, *fine[1:]], concurrency=4)
        by_prompt = {o.params.prompt: o for o in outcomes}
        bad = by_prompt.pop("big")
        assert not bad.ok
        # refused by the first stage before any compute, naming both sizes and the setting
        assert "encoder encoder-0" in bad.error and "32.0 MiB in a denoiser's pool" in bad.error, bad.error
        assert "holds 16.0 MiB" in bad.error and "pool_mib" in bad.error
        assert all(o.ok for o in by_prompt.values()), [o.error for o in by_prompt.values()]
        assert all(o.images and o.images[0].startswith(b"\x89PNG") for o in by_prompt.values())
        deadline = time.monotonic() + 5
        while True:
            report = client.status()
            if all(i.pool_free_bytes == i.pool_bytes for i in report.instances) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    for inst in report.instances:
        assert inst.pool_used_bytes == 0 and inst.pool_free_bytes == inst.pool_bytes, inst
        assert inst.free_slots == inst.capacity


def test_many_in_flight_on_pools_only_releases_make_room_in_all_succeed_and_the_pools_drain(deployment):
    """12 in flight, outputs of 4 MiB in pools of 16: the orchestrator dispatches on room that only the Releases
    make, so a Release that never reached its role would fail a Run with PoolFull and leave a pool full."""
    params = [GenerationParams(prompt=f"load {i}", width=1024, height=1024, seed=i) for i in range(24)]
    with Client(deployment.endpoint) as client:
        outcomes = client.run_all(params, concurrency=12)
        assert [o.error for o in outcomes if not o.ok] == []
        assert len(outcomes) == len(params)
        report = wait_until(lambda: (lambda r: r if all(i.pool_used_bytes == 0 for i in r.instances) else None)(
            client.status()), timeout=10, why=lambda: [(i.id, i.pool_used_bytes) for i in client.status().instances])
    for inst in report.instances:
        assert inst.free_slots == inst.capacity, inst
