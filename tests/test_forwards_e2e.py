"""Forwards end to end (disagg/orchestrator/forwards.py): a real deployment of the demo model (an orchestrator and four
role processes over real sockets and peer lanes), with `forward.max_wait_ms` raised so that its stages qualify, and
requests at most two at a time. The stages forward (status counts the hops), and the requests in flight when a
denoiser or the orchestrator is SIGKILLed come back with the same pixels as the same requests without a kill."""

from __future__ import annotations

import psutil
import pytest

from disagg.client import Client
from disagg.transport.wire.messages import GenerationParams
from tests.conftest import Launched, Load, wait_until

pytestmark = pytest.mark.e2e

N = 8


@pytest.fixture(scope="module")
def deployment(module_tmp):
    dep = Launched(["-e", "1", "-d", "2", "-k", "1", "--no-dashboard", "--heartbeat-timeout", "2", "--spares", "1",
                    "--forward-max-wait-ms", "5000"], module_tmp)
    yield from dep.serve(4)


def status(dep):
    with Client(dep.endpoint) as client:
        return client.status(timeout_s=5)


def requests() -> list[GenerationParams]:
    return [GenerationParams(prompt=f"a red circle on the left {i}", width=64, height=64, num_inference_steps=3, seed=i)
            for i in range(N)]


def images(outcomes) -> dict[int, list[bytes]]:
    assert [o.error for o in outcomes if not o.ok] == []
    return {o.params.seed: o.images for o in outcomes}


@pytest.fixture(scope="module")
def reference(deployment):
    """The requests' images without a kill; and that their stages forwarded."""
    before = status(deployment).orchestrator["forwarded"]
    got = images(Load(deployment.endpoint, requests(), concurrency=2).join())
    assert status(deployment).orchestrator["forwarded"] >= before + N  # most hops of N requests, each of two
    return got


def settled(dep):
    """Every slot free and every pool empty again: nothing reserved for a forward was left taken."""
    def free():
        report = status(dep)
        return all(i.state == "ready" and i.free_slots == i.capacity and i.pool_used_bytes == 0
                   for i in report.instances) and len(report.instances) == 4
    wait_until(free, timeout=60, why=lambda: [(i.id, i.state, i.free_slots, i.pool_used_bytes)
                                              for i in status(dep).instances])


def test_a_denoiser_killed_under_forwarding_loses_nothing_and_changes_no_pixel(deployment, reference):
    victim = next(i for i in status(deployment).instances if i.id == "denoiser-0")
    load = Load(deployment.endpoint, requests(), concurrency=2)
    wait_until(lambda: next(i for i in status(deployment).instances if i.id == "denoiser-0").completed > 0,
               timeout=60, step=0.02)
    psutil.Process(victim.pid).kill()
    assert images(load.join()) == reference
    settled(deployment)


def test_the_orchestrator_killed_under_forwarding_loses_nothing_and_changes_no_pixel(deployment, reference):
    report = status(deployment)
    old = psutil.Process(int(report.orchestrator["pid"]))
    load = Load(deployment.endpoint, requests(), concurrency=2)
    wait_until(lambda: status(deployment).requests.completed > report.requests.completed, timeout=60, step=0.02)
    old.kill()
    assert images(load.join()) == reference
    wait_until(lambda: status(deployment).orchestrator["pid"] != old.pid, timeout=60)
    settled(deployment)
    before = status(deployment).orchestrator["forwarded"]
    assert images(Load(deployment.endpoint, requests(), concurrency=2).join()) == reference
    assert status(deployment).orchestrator["forwarded"] > before  # the successor forwards too
