"""A deployment killed whole (every process SIGKILLed at once: the OOM killer, a container's kill) leaves its pools
and lane socket behind; the next launch on the machine removes them, and never a live deployment's (issue 44)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile

import psutil
import pytest

from disagg.launcher.leftovers import RunRecord, remove_leftovers, runs_folder
from disagg.transport.wire.lane import _private_folder, lane_in_use, lane_path
from tests.conftest import Launched, deployment_id, disagg, free_port_pair, pid_alive, segments_of, wait_until

pytestmark = pytest.mark.e2e

PAYLOAD = ["--model", "payload", "-e", "1", "-d", "1", "-k", "1", "--no-dashboard"]


def kill_whole(dep: Launched) -> list[int]:
    """SIGKILL the launcher and every process under it at once (all stopped first, so none cleans up)."""
    procs = [psutil.Process(dep.proc.pid), *psutil.Process(dep.proc.pid).children(recursive=True)]
    for p in procs:
        p.send_signal(signal.SIGSTOP)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    dep.proc.wait(timeout=30)
    wait_until(lambda: not any(pid_alive(p.pid) for p in procs), timeout=30)
    return [p.pid for p in procs]


@pytest.fixture
def own_temp_dir(monkeypatch):
    """A temp dir of this test's own for its launches and itself: run records (and lane sockets) live in
    $TMPDIR/disagg-UID, machine-wide, so another pytest-xdist worker's launch would clean the killed deployment
    up first and this test's next launch find nothing left. The folder must exist (tempfile.gettempdir() passes
    over a TMPDIR that does not and answers /tmp) and be short (a lane socket's path has at most 107 bytes)."""
    folder = tempfile.mkdtemp(prefix="dl-", dir="/tmp")
    monkeypatch.setenv("TMPDIR", folder)  # the launches inherit it
    monkeypatch.setattr(tempfile, "tempdir", folder)  # this process (lane_path) cached its answer before
    assert lane_path(1).startswith(folder + "/") and len(lane_path(65535)) < 108
    yield folder
    remove_leftovers(os.path.join(folder, f"disagg-{os.getuid()}", "runs"))  # a failed test's, which no other launch sees
    shutil.rmtree(folder, ignore_errors=True)


def test_the_next_launch_removes_what_a_deployment_killed_whole_left_and_nothing_of_a_live_one(tmp_path, own_temp_dir):
    for name in ("live", "killed"):
        (tmp_path / name).mkdir()
    live = Launched(PAYLOAD, tmp_path / "live")
    killed = Launched(PAYLOAD, tmp_path / "killed")
    try:
        live.wait_ready(3)
        killed.wait_ready(3)
        gone_id, live_id = deployment_id(killed.run_dir), deployment_id(live.run_dir)
        pids = kill_whole(killed)
        assert len(pids) >= 5  # launcher, orchestrator, fork server, three roles
        left = segments_of(gone_id)
        assert len(left) == 3 and os.path.exists(lane_path(killed.port)), left  # what it left
        assert os.path.exists(os.path.join(runs_folder(), f"{gone_id}.lock"))  # its record: in this test's folder
        live_segments = segments_of(live_id)
        assert len(live_segments) == 3

        prompts = tmp_path / "one.json"
        prompts.write_text(json.dumps({"prompt": "after a kill", "width": 32, "height": 32}))
        res = disagg("launch", *PAYLOAD, "--spares", "0", "--port", str(free_port_pair()), "--run-dir",
                     str(tmp_path / "next"), "--submit", str(prompts), "--out", str(tmp_path / "out"), timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        said = " ".join(res.stdout.split())
        assert "removed 3 shared-memory segment(s)" in said and f"left by deployment {gone_id}" in said, said
        assert lane_path(killed.port) in said, said
        assert segments_of(gone_id) == [] and not os.path.exists(lane_path(killed.port))
        # the live deployment keeps everything, and serves
        assert segments_of(live_id) == live_segments and lane_in_use(lane_path(live.port))
        assert live_id not in said
        assert all(i.state == "ready" for i in live.status().instances)
    finally:
        live.stop()
        killed.stop()


def test_a_record_is_left_alone_while_its_launcher_lives_and_taken_once_it_is_gone(tmp_path):
    """The lock, not the pid: a record whose lock is held is never cleaned, whatever its content says."""
    name = f"disagg-feedbeef-encoder-0-{2**22 + 12345}"  # an owner pid that cannot run
    path = f"/dev/shm/{name}"
    record = RunRecord("feedbeef", folder=str(tmp_path))
    record.claim()
    try:
        open(path, "wb").close()
        assert remove_leftovers(str(tmp_path)) == [] and os.path.exists(path)  # held: a live deployment
        os.close(record.fd)  # as the kernel does when the launcher dies
        record.fd = None
        [said] = remove_leftovers(str(tmp_path))
        assert "deployment feedbeef" in said and not os.path.exists(path)
        assert os.listdir(tmp_path) == []  # nothing of it is left: the record goes too
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_the_first_record_on_a_machine_leaves_its_folder_private_for_the_lanes(tmp_path):
    """The records folder ($TMPDIR/disagg-UID/runs) is made inside the user's private folder that the lane sockets
    share, which refuses to hold a lane when others may write into it: a first launch on a machine (or a fresh
    TMPDIR) must not make that folder open to all, as os.makedirs does with the folders above the one it makes."""
    private = tmp_path / "fresh" / f"disagg-{os.getuid()}"
    record = RunRecord("feedbeef", folder=str(private / "runs"))
    record.claim()
    try:
        assert os.stat(private).st_mode & 0o077 == 0, oct(os.stat(private).st_mode)
        _private_folder(str(private / "lane-1.sock"))  # the orchestrator's check: it may make its lane here
    finally:
        record.release()


def test_a_gone_runs_unowned_files_go_once_no_process_of_it_runs_and_other_hosts_runs_are_not_touched(tmp_path):
    """A node whose processes were killed one by one (the Slurm recipe's task epilog runs `disagg clean --wait`): a
    pool whose owner still runs keeps the run pending, and its simulated devices' files (no owner in their name)
    stay with it; once the owner is gone, both go. A record written on another host (a /tmp shared between
    hosts) is never taken: its segments are in that host's /dev/shm."""
    import json
    import subprocess

    owner = subprocess.Popen(["sleep", "60"])
    pool, device = f"disagg-feedbee1-denoiser-0-{owner.pid}", "disagg-feedbee1-simdev0"
    other = f"disagg-feedbee2-denoiser-0-{2**22 + 7}"
    here, away = RunRecord("feedbee1", folder=str(tmp_path)), RunRecord("feedbee2", folder=str(tmp_path))
    try:
        for r in (here, away):
            r.claim()
            os.close(r.fd)  # its launcher died
            r.fd = None
        data = json.loads(open(away.path).read())
        open(away.path, "w").write(json.dumps({**data, "host": "another-host"}))
        for name in (pool, device, other):
            open(f"/dev/shm/{name}", "wb").close()
        pending: list = []
        assert remove_leftovers(str(tmp_path), pending=pending) == [] and pending == ["feedbee1"]
        assert os.path.exists(f"/dev/shm/{device}") and os.path.exists(f"/dev/shm/{other}")
        owner.kill()
        owner.wait()
        pending = []
        [said] = remove_leftovers(str(tmp_path), pending=pending)
        assert "2 shared-memory segment(s)" in said and pending == []
        assert not os.path.exists(f"/dev/shm/{pool}") and not os.path.exists(f"/dev/shm/{device}")
        assert os.path.exists(f"/dev/shm/{other}") and os.listdir(tmp_path) == ["feedbee2.lock"]
    finally:
        owner.kill()
        for name in (pool, device, other):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
