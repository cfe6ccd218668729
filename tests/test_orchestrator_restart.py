"""kill -9 of the orchestrator with requests in flight: every request still finishes, once, and no stage
already done is done again. Real processes: a 2:2:2 tiny deployment with an HTTP gateway, `disagg
submit` as a user runs it, and an HTTP client."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import launch_with_http, wait_until

pytestmark = pytest.mark.e2e

N = 50
ROLES = ("encoder", "denoiser", "decoder")


@pytest.fixture(scope="module")
def dep(module_tmp):
    yield from launch_with_http(["-e", "2", "-d", "2", "-k", "2", "--no-dashboard", "--heartbeat-timeout", "2"],
                                module_tmp).serve(6)


def status(dep):
    return dep.status()


def computed(dep) -> dict[str, int]:
    """Stages each role kind finished, by the role processes' own counts (they survive the orchestrator)."""
    report = status(dep)
    return {role: sum(i.computed for i in report.instances if i.role == role) for role in ROLES}


def settled(dep) -> dict[str, int]:
    """The counts once nothing runs and every role has heartbeated since (twice the same reading)."""
    wait_until(lambda: all(i.in_flight == 0 and i.state == "ready" for i in status(dep).instances), timeout=60)
    last = None
    for _ in range(60):
        time.sleep(1.1)
        now = computed(dep)
        if now == last:
            return now
        last = now
    raise AssertionError(f"role counts never settled: {last}")


def kill_orchestrator_midway(dep) -> int:
    """Once some requests are done and many in flight, kill -9 the orchestrator; its pid."""
    done0 = status(dep).requests.completed
    report = wait_until(lambda: (r := status(dep)).requests.completed - done0 >= 5 and r, timeout=120, step=0.02)
    assert report.requests.in_flight >= 20, f"the load ended before the kill: {report.requests}"
    pid = int(report.orchestrator["pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


def check_recovered(dep, old_pid: int, before: dict[str, int]) -> None:
    report = wait_until(lambda: (r := status(dep)).orchestrator["pid"] != old_pid and r, timeout=60)
    after = settled(dep)
    # each stage of each request ran once: nothing redone, nothing run twice
    assert {role: after[role] - before[role] for role in ROLES} == {role: N for role in ROLES}
    report = status(dep)
    assert all(i.free_slots == i.capacity and i.pool_used_bytes == 0 for i in report.instances), report.instances


def test_kill_9_orchestrator_under_disagg_submit_loses_nothing_and_redoes_nothing(dep, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"restart {i}", "width": 64, "height": 64,
                                           "num_inference_steps": 4, "seed": i}) + "\n" for i in range(N)))
    before = settled(dep)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "submit", str(prompts), "--endpoint", dep.endpoint,
                             "--concurrency", str(N), "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        old = kill_orchestrator_midway(dep)
        output, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert "error" not in output.lower() and "fail" not in output.lower(), output
    assert len(list(out.glob("*.png"))) == N
    check_recovered(dep, old, before)


def test_kill_9_orchestrator_under_http_load_loses_nothing_and_redoes_nothing(dep):
    before = settled(dep)
    results: list = []

    async def load():
        async with httpx.AsyncClient(base_url=dep.http, timeout=180) as http:
            async def one(i):
                r = await http.post("/v1/images/generations", json={"prompt": f"http restart {i}", "size": "64x64",
                                                                     "seed": i, "num_inference_steps": 4})
                return r.status_code, r.json()
            results.extend(await asyncio.gather(*(one(i) for i in range(N))))

    thread = threading.Thread(target=lambda: asyncio.run(load()), daemon=True)
    thread.start()
    old = kill_orchestrator_midway(dep)
    thread.join(180)
    assert not thread.is_alive()
    assert [code for code, _ in results] == [200] * N, [body for code, body in results if code != 200]
    assert all(base64.b64decode(body["data"][0]["b64_json"])[:4] == b"\x89PNG" for _, body in results)
    check_recovered(dep, old, before)
