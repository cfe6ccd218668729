"""No request lost: kill -9, SIGSTOP, a killed orchestrator, garbage floods and timeouts, over real
processes. One 2:2:2 tiny deployment (with a spare interpreter and an HTTP gateway) shared by the module.
kill -9 of the orchestrator with requests in flight, from `disagg submit` as a user runs it and from HTTP
clients: every request still finishes, once, and no stage already done is done again; the last kill comes
last."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import msgspec
import psutil
import pytest
import zmq

from disagg.client import Client
from disagg.transport.wire.messages import (
    Bundle,
    GenerationParams,
    Heartbeat,
    Register,
    StatusQuery,
    Submit,
    encode,
)
from tests.conftest import Load, heard_from_all, launch_with_http, pid_alive, wait_until

pytestmark = pytest.mark.e2e

N_INSTANCES = 6
N = 50  # requests in flight when the orchestrator is killed (the restart tests)
ROLES = ("encoder", "denoiser", "decoder")
RECOVERY = {}  # what the closing note reports: kill -> replacement ready, per role


@pytest.fixture(scope="module")
def deployment(module_tmp):
    dep = launch_with_http(["-e", "2", "-d", "2", "-k", "2", "--no-dashboard", "--heartbeat-timeout", "2", "--spares", "1"],
                           module_tmp)
    try:
        dep.wait_ready(N_INSTANCES)
        yield dep
    finally:
        dep.stop()
        if RECOVERY:
            print("\nrecovery:", RECOVERY)


def small(n: int, tag: str) -> list[GenerationParams]:
    return [GenerationParams(prompt=f"{tag} {i}", width=64, height=64, num_inference_steps=2, seed=i) for i in range(n)]


def status(dep):
    with Client(dep.endpoint) as client:
        return client.status(timeout_s=5)


def instance(dep, iid):
    return next(i for i in status(dep).instances if i.id == iid)


def wait_busy(dep, iid):
    """Until instance `iid` holds work (so the fault lands on requests in flight)."""
    wait_until(lambda: instance(dep, iid).in_flight > 0, timeout=30, step=0.02)


def runs_sent(i) -> int:
    """Every run the orchestrator has sent instance `i` (each is completed, failed or in flight)."""
    return i.completed + i.failed + i.in_flight


def stop_holding_work(dep, iid, pid):
    """SIGSTOP role process `pid` at a moment it surely holds unfinished work, so that a kill -9 next hits requests in
    flight. `in_flight > 0` alone can be stale: the run may have ended, its result not yet read by the orchestrator.
    Held for sure: a run sent after the stop (the orchestrator's count grew since a status read after it), or runs
    the orchestrator still counted just before it gave up on hearing from the stopped process (seconds after the
    stop: its results would have come). Given up on while it held nothing, it is let go on and stopped again."""
    for _ in range(5):
        os.kill(pid, signal.SIGSTOP)
        sent = runs_sent(instance(dep, iid))
        last = [None]

        def caught():
            i = instance(dep, iid)
            if i.state == "ready":
                last[0] = i
            return i.state != "ready" or runs_sent(i) > sent

        wait_until(caught, timeout=30, step=0.01)
        if last[0] is not None and (runs_sent(last[0]) > sent or last[0].in_flight > 0):
            return
        os.kill(pid, signal.SIGCONT)  # declared dead holding nothing: it registers again, and is stopped again
        wait_until(lambda: (i := instance(dep, iid)).state == "ready" and i.pid == pid, timeout=30)
        wait_busy(dep, iid)
    raise AssertionError(f"{iid} was never stopped holding work")


def pool_of(pid: int) -> str:
    """The shared-memory pool of role process `pid` (its name ends with the pid)."""
    [name] = [n for n in os.listdir("/dev/shm") if n.startswith("disagg-") and n.endswith(f"-{pid}")]
    return name


def mapping(dep, pool: str) -> list[str]:
    """The other live instances whose process maps `pool` (a consumer's shm engine maps the pools it pulled from)."""
    holders = []
    for i in status(dep).instances:
        if pool.endswith(f"-{i.pid}"):
            continue  # its owner
        try:
            with open(f"/proc/{i.pid}/maps") as f:
                if f"/dev/shm/{pool}" in f.read():
                    holders.append(i.id)
        except OSError:
            continue  # exited meanwhile
    return holders


@pytest.mark.parametrize("role", ["denoiser", "encoder", "decoder"])
def test_kill_9_under_load_loses_nothing(deployment, role):
    iid = f"{role}-0"
    old_pid = instance(deployment, iid).pid
    old_pool = pool_of(old_pid)
    load = Load(deployment.endpoint, small(80, f"kill {role}"), concurrency=50)
    if role != "decoder":  # its consumers map its pool as they pull (nobody pulls from a decoder)
        wait_until(lambda: mapping(deployment, old_pool), timeout=30, step=0.02)
    wait_busy(deployment, iid)
    stop_holding_work(deployment, iid, old_pid)
    os.kill(old_pid, signal.SIGKILL)
    t_kill = time.monotonic()
    outcomes = load.join()
    assert len(outcomes) == 80
    assert [o.error for o in outcomes if not o.ok] == []
    # the killed instance comes back under its id, with a new pid, and registers again
    back = wait_until(lambda: (i := instance(deployment, iid)).state == "ready" and i.pid != old_pid and i, timeout=90)
    RECOVERY[role] = round(time.monotonic() - t_kill, 1)
    RECOVERY[f"{role}_retried"] = sum(o.attempts > 1 for o in outcomes)
    assert back.restarts >= 1 and not pid_alive(old_pid)
    assert any(o.attempts > 1 for o in outcomes)  # the kill hit requests in flight, which were retried
    # the orchestrator tells its consumers that the dead pool is nobody's (Alive.forget_pools): they unmap it
    wait_until(lambda: not mapping(deployment, old_pool), timeout=30, step=0.1,
               why=lambda: f"{old_pool} is still mapped by {mapping(deployment, old_pool)}")


def fork_server(dep) -> psutil.Process:
    [server] = [p for p in psutil.Process(dep.proc.pid).children() if "--fork-server" in " ".join(p.cmdline())]
    return server


def test_roles_are_forked_and_a_killed_fork_server_loses_nothing(deployment):
    """The CPU roles are forks of one server (disagg/launcher/forks.py), each titled with its own command line; with
    the server killed -9 under load they go on serving, and a role that dies later starts afresh."""
    server = fork_server(deployment)
    instances = status(deployment).instances
    roles = {i.id: i.pid for i in instances}
    forked = {p.pid: " ".join(p.cmdline()) for p in server.children()}
    first = {i.id: i.pid for i in instances if i.restarts == 0}  # a restart took a spare interpreter
    assert len(first) >= 2 and set(first.values()) <= set(forked), (first, forked)
    for iid, pid in first.items():
        assert f'"instance_id":"{iid}"' in forked[pid] and " -m disagg.roles " in forked[pid]
    load = Load(deployment.endpoint, small(30, "fork server"))
    wait_busy(deployment, "encoder-1")
    server.kill()
    outcomes = load.join()
    assert [o.error for o in outcomes if not o.ok] == []
    assert {i.id: i.pid for i in status(deployment).instances} == roles  # nobody restarted
    os.kill(roles["decoder-1"], signal.SIGKILL)  # its status is lost with the server: still restarted
    wait_until(lambda: (i := instance(deployment, "decoder-1")).state == "ready" and i.pid != roles["decoder-1"],
               timeout=90)
    assert all(o.ok for o in Load(deployment.endpoint, small(8, "after")).join())


def test_sigstop_moves_work_elsewhere_and_sigcont_rejoins(deployment):
    iid = "denoiser-1"
    pid = instance(deployment, iid).pid
    load = Load(deployment.endpoint, small(30, "stop"))
    wait_busy(deployment, iid)
    os.kill(pid, signal.SIGSTOP)
    try:
        outcomes = load.join()
        assert [o.error for o in outcomes if not o.ok] == []
        assert instance(deployment, iid).state == "dead"
    finally:
        os.kill(pid, signal.SIGCONT)
    # the same process comes back: told it was declared dead, it registers again
    back = wait_until(lambda: (i := instance(deployment, iid)).state == "ready" and i, timeout=30)
    assert back.pid == pid
    outcomes = Load(deployment.endpoint, small(10, "after cont"), concurrency=10).join()
    assert all(o.ok for o in outcomes)


def test_timeout_answers_at_once_and_frees_slots(deployment):
    big = GenerationParams(prompt="slow", width=512, height=512, num_inference_steps=8, seed=1)
    with Client(deployment.endpoint) as client:
        t0 = time.monotonic()
        [outcome] = client.run_all([big], timeout_s=0.2)
        assert not outcome.ok and "timed out" in outcome.error
        assert time.monotonic() - t0 < 2.0
        # once the work drains, every slot and every pool is whole again
        def settled():
            r = client.status()
            return all(i.free_slots == i.capacity and i.pool_used_bytes == 0 and i.pool_free_bytes == i.pool_bytes
                       for i in r.instances if i.state == "ready") and r.requests.in_flight == 0
        def unsettled():
            r = client.status()
            return [(i.id, i.state, f"slots {i.free_slots}/{i.capacity}", f"staged {i.pool_used_bytes}",
                     f"pool free {i.pool_free_bytes}/{i.pool_bytes}") for i in r.instances
                    if i.free_slots != i.capacity or i.pool_used_bytes or i.pool_free_bytes != i.pool_bytes] + \
                [f"in flight {r.requests.in_flight}"]
        wait_until(settled, timeout=60, step=0.3, why=unsettled)


def test_fuzzed_frames_leave_orchestrator_serving_with_bounded_memory(deployment):
    orch = psutil.Process(int(status(deployment).orchestrator["pid"]))
    rss_before = orch.memory_info().rss
    rng = random.Random(42)
    valid = [
        encode(Submit(request_id="fz", params=GenerationParams(prompt="x"))),
        encode(StatusQuery()),
        encode(Heartbeat(instance_id="encoder-0")),
    ]
    reg = msgspec.msgpack.decode(encode(Register(role="encoder", instance_id="fz", pid=1, host_id="h", device="cpu", capacity=1,
                                                 pool={"host_id": "h", "engines": ["shm"], "pool_name": "p", "pool_bytes": 1})))

    def mutated() -> list[bytes]:
        kind = rng.randrange(7)
        if kind == 0:
            return [rng.randbytes(rng.randrange(0, 300))]
        if kind == 1:  # truncated valid message
            v = rng.choice(valid)
            return [v[: rng.randrange(len(v))]]
        if kind == 2:  # flipped bytes
            v = bytearray(rng.choice(valid))
            for _ in range(3):
                v[rng.randrange(len(v))] = rng.randrange(256)
            return [bytes(v)]
        if kind == 3:  # valid envelope, wrong field types
            doc = dict(reg)
            doc[rng.choice(list(doc))] = rng.choice([None, -1, "x" * 300, [1, 2], {"a": 1}, 2**64 - 1])
            return [msgspec.msgpack.encode(doc)]
        if kind == 4:  # huge claimed sizes
            return [b"\xdb\xff\xff\xff\xff" + rng.randbytes(20)]
        if kind == 5:  # many frames
            return [rng.randbytes(10) for _ in range(rng.randrange(2, 20))]
        return [msgspec.msgpack.encode({"type": rng.choice(["submit", "register", "staged", "done"]), "junk": rng.random()})]

    ctx = zmq.Context.instance()
    socks = []
    for port in (deployment.port, deployment.port + 1):
        for k in range(3):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, f"fuzzer-{port}-{k}".encode())
            s.connect(f"tcp://127.0.0.1:{port}")
            socks.append(s)
    for i in range(6000):
        socks[i % len(socks)].send_multipart(mutated())
    for s in socks:
        s.close()
    # and it still serves
    outcomes = Load(deployment.endpoint, small(5, "after fuzz"), concurrency=5).join()
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    report = status(deployment)
    assert sum(i.state == "ready" for i in report.instances) == N_INSTANCES
    assert not [i for i in report.instances if i.id == "fz"]
    growth = orch.memory_info().rss - rss_before
    assert growth < 64 * 2**20, f"orchestrator grew by {growth / 2**20:.1f} MiB"


def test_a_flood_of_status_bundles_stalls_nothing(deployment):
    """Issue 43 F1: bundles of 65,536 StatusQuery (refused: a client bundle carries at most 1,024 messages) and
    64 bundles of 1,024 from 8 peers at once (served within a budget per turn, one status per peer per turn),
    while requests run: the next status comes within 1 s, no instance is declared dead, the requests succeed,
    and the orchestrator grows by under 100 MB."""
    orch = psutil.Process(int(status(deployment).orchestrator["pid"]))
    log = deployment.run_dir / "logs" / "orchestrator.log"
    deaths = log.read_text().count(" is dead: ")
    rss_before = orch.memory_info().rss
    load = Load(deployment.endpoint, small(10, "flood"), concurrency=10)
    query = encode(StatusQuery())

    def bundle(n: int) -> bytes:
        return encode(Bundle(messages=[msgspec.Raw(query)] * n, frames=[0] * n))

    ctx = zmq.Context.instance()
    socks = []
    for k in range(8):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, f"flood-{k}".encode())
        s.connect(deployment.endpoint)
        socks.append(s)
    huge, big = bundle(65_536), bundle(1024)
    for k in range(8):
        socks[k].send(huge)
    for i in range(64):
        socks[i % 8].send(big)
    t0 = time.monotonic()
    report = status(deployment)
    answered_s = time.monotonic() - t0
    outcomes = load.join()
    for s in socks:
        s.close()
    assert answered_s < 1.0, f"status took {answered_s:.2f} s under the flood"
    assert [o.error for o in outcomes if not o.ok] == []
    assert sum(i.state == "ready" for i in status(deployment).instances) == N_INSTANCES
    assert log.read_text().count(" is dead: ") == deaths, "an instance was declared dead during the flood"
    growth = orch.memory_info().rss - rss_before
    assert growth < 100 * 2**20, f"orchestrator grew by {growth / 2**20:.1f} MiB"
    assert report.orchestrator["pid"] == orch.pid


# --- kill -9 of the orchestrator: nothing lost, nothing redone ------------------------------------------


def computed(dep) -> dict[str, int]:
    """Stages each role kind finished, by the role processes' own counts (they survive the orchestrator)."""
    report = status(dep)
    return {role: sum(i.computed for i in report.instances if i.role == role) for role in ROLES}


def settled(dep) -> dict[str, int]:
    """The counts once nothing runs and every role has heartbeated since (a role counts a stage before it sends
    its Done, so the first heartbeat after the last Done carries its final count)."""
    wait_until(lambda: all(i.in_flight == 0 and i.state == "ready" for i in status(dep).instances), timeout=60)
    heard_from_all(dep.endpoint)
    return computed(dep)


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


def test_kill_9_orchestrator_under_disagg_submit_loses_nothing_and_redoes_nothing(deployment, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"restart {i}", "width": 64, "height": 64,
                                           "num_inference_steps": 4, "seed": i}) + "\n" for i in range(N)))
    before = settled(deployment)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "disagg", "submit", str(prompts), "--endpoint", deployment.endpoint,
                             "--concurrency", str(N), "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        old = kill_orchestrator_midway(deployment)
        output, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert "error" not in output.lower() and "fail" not in output.lower(), output
    assert len(list(out.glob("*.png"))) == N
    check_recovered(deployment, old, before)


def test_kill_9_orchestrator_under_http_load_loses_nothing_and_redoes_nothing(deployment):
    before = settled(deployment)
    results: list = []

    async def load():
        async with httpx.AsyncClient(base_url=deployment.http, timeout=180) as http:
            async def one(i):
                r = await http.post("/v1/images/generations", json={"prompt": f"http restart {i}", "size": "64x64",
                                                                     "seed": i, "num_inference_steps": 4})
                return r.status_code, r.json()
            results.extend(await asyncio.gather(*(one(i) for i in range(N))))

    thread = threading.Thread(target=lambda: asyncio.run(load()), daemon=True)
    thread.start()
    old = kill_orchestrator_midway(deployment)
    thread.join(180)
    assert not thread.is_alive()
    assert [code for code, _ in results] == [200] * N, [body for code, body in results if code != 200]
    assert all(base64.b64decode(body["data"][0]["b64_json"])[:4] == b"\x89PNG" for _, body in results)
    check_recovered(deployment, old, before)


@pytest.mark.ends_deployment
def test_kill_9_orchestrator(deployment):
    """Last: the orchestrator restarts, roles re-register without restarting, and every request in flight
    still finishes (the restart tests above check that no stage ran twice)."""
    report = status(deployment)
    role_pids = {i.id: i.pid for i in report.instances}
    restarts = report.orchestrator["restarts"]  # the restart tests killed it before
    old = psutil.Process(int(report.orchestrator["pid"]))
    load = Load(deployment.endpoint, [GenerationParams(prompt=f"kept {i}", width=256, height=256, num_inference_steps=6, seed=i)
                                      for i in range(20)], concurrency=20)
    time.sleep(0.5)
    old.kill()
    t_kill = time.monotonic()
    outcomes = load.join(timeout=120)
    assert len(outcomes) == 20 and [o.error for o in outcomes if not o.ok] == []
    RECOVERY["orchestrator_requests_kept"] = f"{sum(o.ok for o in outcomes)}/{len(outcomes)}"
    # a new orchestrator, the same role processes, all registered and ready again
    report = wait_until(lambda: (r := status(deployment)).orchestrator["pid"] != old.pid
                        and sum(i.state == "ready" for i in r.instances) == N_INSTANCES and r, timeout=60)
    RECOVERY["orchestrator"] = round(time.monotonic() - t_kill, 1)
    assert report.orchestrator["restarts"] == restarts + 1
    assert {i.id: i.pid for i in report.instances} == role_pids
    outcomes = Load(deployment.endpoint, small(10, "after restart"), concurrency=10).join()
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
