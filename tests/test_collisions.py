"""Deployments that must not disturb each other: a second launch on a busy port, `stop` then an immediate
relaunch, and a role of another deployment at our orchestrator (real processes, sim:zero)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import zmq

from disagg.client import Client
from disagg.transport.wire.lane import lane_path
from disagg.transport.wire.messages import (
    ErrorCode,
    GenerationParams,
    OrchestratorCommand,
    PoolInfo,
    Register,
    Rejected,
    decode,
    encode,
)
from tests.conftest import ROOT, Launched, disagg, free_port_pair, heard_from_all, pid_alive

pytestmark = pytest.mark.e2e

N = 3  # -d 1: encoder, denoiser, decoder


def pids(endpoint: str) -> dict[str, int]:
    with Client(endpoint) as client:
        report = client.status()
    return {"orchestrator": int(report.orchestrator["pid"]), **{i.id: i.pid for i in report.instances}}


def serves(endpoint: str) -> bool:
    with Client(endpoint) as client:
        [outcome] = client.run_all([GenerationParams(prompt="still here", width=64, height=64)], timeout_s=30)
    return outcome.ok


@pytest.fixture(scope="module")
def running(module_tmp):
    dep = Launched(["--model", "sim:zero", "-d", "1", "--no-dashboard"], module_tmp)
    try:
        dep.wait_ready(N)
        yield dep
    finally:
        dep.stop()


@pytest.mark.parametrize("offset", [0, 1, -1])
def test_a_second_launch_on_a_busy_port_exits_2_and_leaves_the_first_alone(running, offset, tmp_path):
    before = pids(running.endpoint)
    t0 = time.monotonic()
    res = disagg("launch", "--model", "sim:zero", "-d", "1", "--no-dashboard", "--port", str(running.port + offset),
                 "--run-dir", str(tmp_path / "run"), timeout=30)
    took = time.monotonic() - t0
    assert res.returncode == 2, res.stdout + res.stderr
    assert took < 2.0 + 1.5  # the CLI's own start (~1 s here) plus the check
    busy = running.port + 1 if offset == 1 else running.port  # P-1's role port is P
    assert f"port {busy} on 127.0.0.1" in res.stderr and "disagg status --endpoint" in res.stderr, res.stderr
    assert not (tmp_path / "run").exists()  # nothing was spawned
    heard_from_all(running.endpoint)
    assert pids(running.endpoint) == before
    assert serves(running.endpoint)


def test_a_live_lane_of_another_address_counts_as_busy(running, tmp_path):
    """127.0.0.2 has the same port free, but the lane file (named by port) belongs to the running one."""
    res = disagg("launch", "--model", "sim:zero", "--no-dashboard", "--host", "127.0.0.2", "--port", str(running.port),
                 "--run-dir", str(tmp_path / "run"), timeout=30)
    assert res.returncode == 2 and lane_path(running.port) in res.stderr, res.stderr
    with Client(running.endpoint) as client:
        assert all(i.lane for i in client.status().instances)


def test_an_orchestrator_that_cannot_bind_fails_the_launch_with_its_reason(running, tmp_path):
    """Past the port check (a race): the launcher must not mistake the other orchestrator for its own."""
    before = pids(running.endpoint)
    script = (
        "import sys; from rich.console import Console; from disagg.launcher.run import run_deployment;"
        "from disagg.settings import RolePool, Settings;"
        f"c = Settings(model='sim:zero', port={running.port}, denoisers=RolePool(count=1));"
        f"sys.exit(run_deployment(c, Console(width=200), {str(tmp_path / 'run')!r}, False, None, None, 1))"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "orchestrator failed to start" in res.stdout and "Address already in use" in res.stdout, res.stdout
    assert "ready:" not in res.stdout
    heard_from_all(running.endpoint)
    assert pids(running.endpoint) == before
    assert serves(running.endpoint)


def test_a_role_of_another_deployment_is_refused_and_takes_over_nothing(running):
    with Client(running.endpoint) as client:
        report = client.status()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"otherdeployment/encoder-0")
    sock.connect(f"tcp://127.0.0.1:{running.port + 1}")
    pool = PoolInfo(host_id="x", engines=["shm"], pool_name="nope", pool_bytes=1)
    sock.send_multipart([encode(Register(role="encoder", instance_id="encoder-0", pid=1, host_id="x", device="cpu",
                                         capacity=1, pool=pool, deployment_id="otherdeployment"))])
    assert sock.poll(5000), "no answer to a foreign Register"
    reply = decode(sock.recv_multipart()[0], OrchestratorCommand)
    assert isinstance(reply, Rejected)
    assert reply.code == ErrorCode.FOREIGN_DEPLOYMENT and "otherdeployment" in reply.reason
    sock.close()
    heard_from_all(running.endpoint)
    with Client(running.endpoint) as client:
        after = client.status()
    assert {i.id: (i.pid, i.state) for i in after.instances} == {i.id: (i.pid, "ready") for i in report.instances}
    assert serves(running.endpoint)
    log = (running.run_dir / "logs" / "orchestrator.log").read_text()
    assert "otherdeployment" in log and "this orchestrator serves" in log


def test_stop_then_an_immediate_relaunch_three_times_keeps_each_new_deployment(tmp_path):
    port = free_port_pair()
    old = Launched(["--model", "sim:zero", "-d", "1", "--no-dashboard"], tmp_path, port=port, log_name="launch-0.log")
    try:
        old.wait_ready(N)
        for k in range(1, 4):
            res = disagg("stop", "--endpoint", old.endpoint, timeout=30)
            assert res.returncode == 0, res.stderr
            new = Launched(["--model", "sim:zero", "-d", "1", "--no-dashboard"], tmp_path, port=port,
                           log_name=f"launch-{k}.log")
            try:
                new.wait_ready(N)
                mine = pids(new.endpoint)
                assert old.proc.wait(timeout=20) == 0, old.output()  # the old launcher's cleanup is over
                heard_from_all(new.endpoint)
                assert pids(new.endpoint) == mine, f"relaunch {k}: the old launcher disturbed the new deployment"
                assert all(pid_alive(p) for p in mine.values())
                with Client(new.endpoint) as client:
                    report = client.status()
                assert all(i.lane for i in report.instances), f"relaunch {k}: lost its lane"
                assert serves(new.endpoint)
            except BaseException:
                new.stop()
                raise
            old = new
    finally:
        old.stop()
