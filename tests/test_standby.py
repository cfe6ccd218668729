"""Warm standbys (`--standby 0,1,0`): a loaded, registered denoiser that gets no work until the serving one
dies, then serves at once; the dead one's replacement (a spare interpreter) becomes the new standby."""

from __future__ import annotations

import io
import os
import signal
import threading
import time

import pytest
from rich.console import Console

from disagg.client import Client
from disagg.launcher.cli.dashboard import status_view
from disagg.transport.wire.messages import GenerationParams
from tests.conftest import Launched, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def dep(module_tmp):
    yield from Launched(["-e", "1", "-d", "1", "-k", "1", "--standby", "0,1,0", "--spares", "1", "--no-dashboard"],
                        module_tmp).serve(3)


def status(dep):
    return dep.status()


def denoisers(report):
    return {i.id: i for i in report.instances if i.role == "denoiser"}


def test_a_standby_gets_no_work_and_shows_as_standby(dep):
    report = wait_until(lambda: (r := status(dep)) and sorted(i.state for i in denoisers(r).values()) == ["ready", "standby"]
                        and r, timeout=60)
    with Client(dep.endpoint) as client:
        outcomes = client.run_all([GenerationParams(prompt=f"s {i}", width=64, height=64, num_inference_steps=2, seed=i)
                                   for i in range(8)], concurrency=4)
    assert all(o.ok for o in outcomes)
    report = status(dep)
    standby = next(i for i in denoisers(report).values() if i.state == "standby")
    assert standby.completed == 0 and standby.computed == 0
    console = Console(record=True, file=io.StringIO(), width=160)
    console.print(status_view(report, title="t", width=160))
    assert "standby" in console.export_text()


def test_killing_the_serving_denoiser_hands_its_work_to_the_standby_at_once(dep):
    report = status(dep)
    serving = next(i for i in denoisers(report).values() if i.state == "ready")
    standby = next(i for i in denoisers(report).values() if i.state == "standby")
    outcomes = []
    load = threading.Thread(target=lambda: outcomes.extend(Client(dep.endpoint).run_all(
        [GenerationParams(prompt=f"k {i}", width=64, height=64, num_inference_steps=4, seed=i) for i in range(40)],
        concurrency=4)), daemon=True)
    load.start()
    wait_until(lambda: denoisers(status(dep))[serving.id].in_flight > 0, timeout=30, step=0.02)
    os.kill(serving.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    wait_until(lambda: denoisers(status(dep))[standby.id].state == "ready", timeout=30, step=0.02)
    took_over_s = time.monotonic() - t_kill
    load.join(120)
    assert len(outcomes) == 40 and [o.error for o in outcomes if not o.ok] == []
    # the dead one comes back (from the spare) as the new standby; the old standby did the work since
    back = wait_until(lambda: (d := denoisers(status(dep))[serving.id]).pid != serving.pid and d.state == "standby" and d,
                      timeout=60)
    assert back.restarts == 1
    assert "denoiser" in dep.output() and "from a spare interpreter" in dep.output()
    assert denoisers(status(dep))[standby.id].completed > 0
    print(f"\nstandby serving {took_over_s:.2f} s after the kill")
