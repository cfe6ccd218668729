"""Readiness that tells a slow boot from a stuck one (issue 44): `timeouts.ready` counts only time without progress.

The role side is held on purpose with the test hook DISAGG_TEST_BOOT_HOLD (disagg/roles/boot.py): `progress` holds a
role's boot while it keeps reporting progress (a slow download or load), `hang` holds it silently (a stuck one)."""

from __future__ import annotations

import os
import time

import pytest

from disagg.launcher.cli.dashboard import _cells, events_between
from disagg.launcher.readiness import StallWatch, stall_error
from disagg.roles.boot import BootMeter, BootProgress
from disagg.transport.wire.messages import BootStats, GenerationParams, InstanceStatus, RequestCounts, StatusReport
from tests.conftest import Launched, wait_until

#: small, so the tests are quick: every hold below lasts several times longer
READY_TIMEOUT_S = 3.0


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_stall_clock_counts_only_time_without_progress():
    clock = Clock()
    watch = StallWatch(10.0, clock=clock)
    watch.see("denoiser-0", None, "starting (its process has not registered yet)", cpu_s=1.0)
    for _ in range(10):  # importing: its CPU time grows, 9 s a look, 90 s in all
        clock.t += 9
        watch.see("denoiser-0", None, "starting (its process has not registered yet)", cpu_s=clock.t)
    assert watch.stalled(["denoiser-0"]) == []
    for n in range(10):  # registered, loading: its progress count grows
        clock.t += 9
        watch.see("denoiser-0", ("starting", "loading", "", 0, n), "loading (last: 2.00 GB in memory)", cpu_s=0.0)
    assert watch.stalled(["denoiser-0"]) == []
    clock.t += 9  # the same report again: no progress for 9 s, then 11 s
    watch.see("denoiser-0", ("starting", "loading", "", 0, 9), "loading (last: 2.00 GB in memory)")
    assert watch.stalled(["denoiser-0"]) == []
    clock.t += 2
    watch.see("denoiser-0", ("starting", "loading", "", 0, 9), "loading (last: 2.00 GB in memory)")
    [(name, idle, what)] = watch.stalled(["denoiser-0"])
    assert (name, idle, what) == ("denoiser-0", 11.0, "loading (last: 2.00 GB in memory)")
    msg = stall_error([(name, idle, what)], 10.0, {})
    assert msg.startswith("denoiser-0 made no progress for 11 s while loading (last: 2.00 GB in memory)")
    assert "--ready-timeout" in msg


def test_a_download_into_the_hub_cache_is_progress(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    progress = BootProgress()
    progress.set("loading", "model org/name")
    meter = BootMeter("org/name", progress=progress, memory=lambda: 0)
    blobs = tmp_path / "models--org--name" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc.incomplete").write_bytes(b"\0" * (3 << 20))
    count = progress.count
    meter.look()
    snap = progress.snapshot()
    assert snap.phase == "downloading" and snap.bytes == 3 << 20 and snap.progress > count
    assert "org/name" in snap.detail, snap
    meter.look()  # no more bytes: the download is over, the weights load
    assert progress.snapshot().phase == "loading"


def test_a_compile_that_writes_kernels_or_calls_the_phase_hook_is_progress(tmp_path):
    """What disagg/roles/extensions/compile.py has for the launcher: `phase("compiling", ...)` / `tick(...)` from its thread, and the
    inductor cache growing meanwhile."""
    import threading

    from disagg.roles import boot

    progress = BootProgress()
    work = [0.0]  # CPU seconds of the boot thread and its compile workers
    meter = BootMeter("tiny", compile_cache_dir=str(tmp_path), progress=progress, memory=lambda: 0,
                      work=lambda: work[0])
    progress.set("compiling", "torch.compile default")
    count = progress.count
    meter.look()  # nothing written yet
    assert progress.count == count
    (tmp_path / "kernel.so").write_bytes(b"\0" * (2 << 20))
    meter.look()
    assert progress.count == count + 1 and progress.snapshot().phase == "compiling"
    meter.look()  # no kernel, no CPU: a blocked compile
    assert progress.count == count + 1
    work[0] = 0.5  # tracing, lowering: CPU all along, nothing written yet
    meter.look()
    assert progress.count == count + 2
    # the module-level hook, from another thread, is what the heartbeat sends
    before = boot.PROGRESS.snapshot().progress
    t = threading.Thread(target=lambda: (boot.phase("warming up", "size 64x64 batch 1"), boot.tick("size 64x64 batch 2")))
    t.start()
    t.join()
    snap = boot.PROGRESS.snapshot()
    assert snap.phase == "warming up" and snap.detail == "size 64x64 batch 2"
    assert snap.progress == before + 2


def instance(state="starting", **boot) -> InstanceStatus:
    base = dict(id="denoiser-0", role="denoiser", state=state, pid=1, host="h", device="cpu", capacity=1,
                free_slots=1, in_flight=0, completed=0, failed=0, engine="shm", pool_bytes=0, pool_used_bytes=0)
    return InstanceStatus(**base, boot=BootStats(**boot))


def test_the_table_and_the_event_log_show_the_boot_phase():
    downloading = instance(phase="downloading", detail="3.20 GB of org/name", bytes=3_200_000_000)
    assert _cells(downloading)["state"] == "downloading 3.20 GB"
    assert _cells(instance(phase="compiling"))["state"] == "compiling"
    assert _cells(instance(phase="", state="ready"))["state"] == "ready"

    def report(*instances):
        return StatusReport(orchestrator={}, instances=list(instances), queues={}, requests=RequestCounts())

    lines = events_between(report(instance(phase="loading")), report(instance(phase="compiling", detail="64x64")))
    assert lines == ["denoiser-0 is compiling (64x64)"]


def hold(tmp_path, mode: str) -> tuple[Launched, str]:
    marker = str(tmp_path / "go")
    env = {**os.environ, "DISAGG_TEST_BOOT_HOLD": f"denoiser-0:{mode}:{marker}"}
    dep = Launched(["--model", "payload", "-e", "1", "-d", "1", "-k", "1", "--no-dashboard",
                    "--ready-timeout", str(READY_TIMEOUT_S)], tmp_path, env=env)
    return dep, marker


def held(dep: Launched) -> InstanceStatus | None:
    """denoiser-0 when it is held by the test hook, reporting so."""
    from disagg.client import Unreachable

    try:
        report = dep.status(timeout_s=2)
    except Unreachable:
        return None
    return next((i for i in report.instances if i.id == "denoiser-0" and "test hook" in i.boot.detail), None)


@pytest.mark.e2e
def test_a_slow_boot_that_progresses_outlives_the_ready_timeout_and_serves(tmp_path):
    dep, marker = hold(tmp_path, "progress")
    try:
        first = wait_until(lambda: held(dep), timeout=120, why=dep.output)
        t0 = time.monotonic()
        assert first.state == "starting" and first.boot.phase == "loading"
        # held for three ready timeouts while it reports progress: the launch goes on
        wait_until(lambda: dep.proc.poll() is not None or time.monotonic() - t0 > 3 * READY_TIMEOUT_S, timeout=60)
        assert dep.proc.poll() is None, dep.output()
        last = held(dep)
        assert last is not None and last.boot.progress > first.boot.progress, (first, last)
        open(marker, "w").close()
        dep.wait_ready(3, timeout=60)
        from disagg.client import Client

        with Client(dep.endpoint) as client:
            [outcome] = client.run_all([GenerationParams(prompt="slow boot", width=32, height=32)])
        assert outcome.ok, outcome.error
        assert "denoiser-0 is loading (test hook" in dep.output()  # the event log says what it did meanwhile
    finally:
        dep.stop()


@pytest.mark.e2e
def test_a_boot_without_progress_is_reported_stuck_naming_instance_phase_and_setting(tmp_path):
    dep, marker = hold(tmp_path, "hang")
    try:
        wait_until(lambda: held(dep) or dep.proc.poll() is not None, timeout=120, why=dep.output)
        assert dep.proc.wait(timeout=60) == 1, dep.output()
        out = " ".join(dep.output().split())  # the console wraps long lines
        assert "denoiser-0 made no progress for" in out and "while loading (last: test hook" in out, out
        assert "raise --ready-timeout" in out, out
        assert "encoder-0" not in out.split("error:")[1], out  # only the stuck one is named
    finally:
        dep.stop()
