"""Roles on several hosts joined to one orchestrator, with network-namespace hosts (tests/netns.py): each
has its own address on a bridge, its own hostname and a private /dev/shm, so tensors between hosts must
cross the network (Mooncake over TCP) while those within a host take shared memory.

Host 0 is the head (the orchestrator and the decoder), host 1 runs the encoder and two denoisers, host
2 two denoisers. Later tests kill host 2, take its link down, bring it back, and add a fourth host."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from disagg.client import Client, Unreachable
from disagg.launcher.ports import free_port_pair
from disagg.transport.wire.messages import GenerationParams
from tests import netns
from tests.conftest import wait_until

WHY_NOT = netns.available()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")]

TIMEOUT_S = 2.0


class Cluster:
    def __init__(self, tmp):
        self.tmp = tmp
        self.hosts = netns.Hosts(3)
        self.port = free_port_pair()
        self.head = f"tcp://{self.hosts.addr(0)}:{self.port}"
        self.launchers = {}

    def start_head(self):
        self.launchers[0] = self.hosts.launch(0, ["--host", "0.0.0.0", "--advertise-host", self.hosts.addr(0),
                                                  "--port", str(self.port), "-e", "0", "-d", "0", "-k", "1",
                                                  "--heartbeat-timeout", str(TIMEOUT_S), "--run-dir",
                                                  str(self.tmp / "h0")], self.tmp / "h0.log")

    def join(self, i, e, d, k):
        self.launchers[i] = self.hosts.launch(i, ["--join", self.head, "-e", str(e), "-d", str(d), "-k", str(k),
                                                  "--run-dir", str(self.tmp / f"h{i}")], self.tmp / f"h{i}.log")

    def status(self):
        with Client(self.head) as client:
            return client.status(timeout_s=3)

    def ready(self, n):
        def enough():
            try:
                r = self.status()
            except (Unreachable, RuntimeError):
                return None
            return sum(i.state == "ready" for i in r.instances) >= n and r
        return wait_until(enough, timeout=180, step=0.5)

    def log(self, i) -> str:
        return (self.tmp / f"h{i}.log").read_text()


@pytest.fixture(scope="module")
def cluster(module_tmp):
    c = Cluster(module_tmp)
    try:
        c.start_head()
        c.ready(1)
        c.join(1, 1, 2, 0)
        c.join(2, 0, 2, 0)
        c.ready(6)  # every instance of the three hosts (the first test counts them all)
        yield c
    finally:
        c.hosts.close()


def hosts_of(report):
    return {i.id: i.host for i in report.instances if i.state != "dead"}


def small(n, tag):
    return [GenerationParams(prompt=f"{tag} {i}", width=64, height=64, num_inference_steps=3, seed=i) for i in range(n)]


def slow(n, tag):
    """Requests long enough (~0.1 s of denoising each) that a fault lands on some in flight."""
    return [GenerationParams(prompt=f"{tag} {i}", width=128, height=128, num_inference_steps=8, seed=i) for i in range(n)]


def test_every_host_has_its_own_id_and_instances_carry_it(cluster):
    report = cluster.status()
    by_host = {}
    for i in report.instances:
        by_host.setdefault(i.host, []).append(i.id)
    assert len(by_host) == 3, by_host
    assert sorted(len(v) for v in by_host.values()) == [1, 2, 3]
    joined = [iid for iid in hosts_of(report) if "@" in iid]
    assert len(joined) == 5 and all(iid.split("@", 1)[1] == hosts_of(report)[iid] for iid in joined)


def test_pixel_parity_across_hosts_and_engines_per_pair(cluster):
    import torch

    from disagg.roles.pipelines.tiny import build_tiny_flux_pipeline

    cases = [dict(prompt="a red fox", width=128, height=128, num_inference_steps=4, seed=3),
             dict(prompt="a blue car", width=64, height=64, num_inference_steps=3, seed=5)]
    with Client(cluster.head) as client:
        outcomes = client.run_all([GenerationParams(**c) for c in cases], concurrency=2)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    pipe = build_tiny_flux_pipeline()
    for case, outcome in zip(cases, outcomes):
        p = dict(case)
        ref = pipe(p.pop("prompt"), generator=torch.Generator("cpu").manual_seed(p.pop("seed")), guidance_scale=3.5,
                   **p).images[0]
        got = np.asarray(Image.open(io.BytesIO(outcome.images[0])).convert("RGB"), dtype=np.int16)
        assert np.abs(got - np.asarray(ref, dtype=np.int16)).max() <= 1
    edges = {(t.source, t.target, t.engine) for t in cluster.status().transfers}
    # the decoder is on the head, every denoiser elsewhere: mooncake; the encoder's denoisers on its host: shm
    assert ("denoiser", "decoder", "mooncake") in edges and ("encoder", "denoiser", "shm") in edges, edges
    assert not any(e == "inline" for _, _, e in edges)
    # per pair of instances: shared memory within a host, never across; mooncake across
    pairs = cluster.status().pairs
    assert pairs and all(p.engine == ("shm" if p.source_host == p.target_host else "mooncake") for p in pairs), pairs


def test_the_encoders_output_stays_on_its_host_while_its_denoisers_have_room(cluster):
    before = {(t.source, t.target, t.engine): t.count for t in cluster.status().transfers}
    with Client(cluster.head) as client:
        outcomes = client.run_all(small(12, "local"), concurrency=2)  # 2 in flight: host 1's denoisers have room
    assert all(o.ok for o in outcomes)
    after = {(t.source, t.target, t.engine): t.count for t in cluster.status().transfers}
    moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # a host-blind pick (round-robin over the four denoisers) would send about half of them to host 2
    assert moved.get(("encoder", "denoiser", "shm")) == 12 and not moved.get(("encoder", "denoiser", "mooncake")), moved


def _load(cluster, n, tag, concurrency):
    result = {}

    def run():
        with Client(cluster.head) as client:
            result["outcomes"] = client.run_all(slow(n, tag), concurrency=concurrency)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_a_host_that_dies_under_load_loses_nothing_and_comes_back(cluster):
    report = cluster.status()
    host2 = next(i.host for i in report.instances if i.id.startswith("denoiser") and i.host != next(
        j.host for j in report.instances if j.role == "encoder"))
    on_2 = [i.id for i in report.instances if i.host == host2]
    thread, result = _load(cluster, 40, "host dies", concurrency=40)
    wait_until(lambda: any(i.in_flight for i in cluster.status().instances if i.host == host2), timeout=60, step=0.02)
    cluster.hosts.kill_host(2)
    t_kill = time.monotonic()
    wait_until(lambda: all(i.state == "dead" for i in cluster.status().instances if i.id in on_2), timeout=30, step=0.05)
    dead_after = time.monotonic() - t_kill
    thread.join(180)
    outcomes = result["outcomes"]
    assert len(outcomes) == 40 and [o.error for o in outcomes if not o.ok] == []
    assert dead_after <= TIMEOUT_S + 1.0, dead_after
    # host 2 comes back (a fresh /dev/shm, so a new host id): its instances register again and get work
    others = {i.host for i in report.instances} - {host2}
    cluster.join(2, 0, 2, 0)
    cluster.ready(5)
    with Client(cluster.head) as client:
        # long denoising: the encoder's own host cannot take it all, so every denoiser is needed
        assert all(o.ok for o in client.run_all(slow(24, "back"), concurrency=12))
    back = [i for i in cluster.status().instances if i.host not in others and i.state == "ready"]
    assert len(back) == 2 and any(i.completed for i in back)


def test_a_host_whose_link_goes_down_is_declared_dead_and_loses_nothing(cluster):
    report = cluster.status()
    encoder_host = next(i.host for i in report.instances if i.role == "encoder")
    host2 = next(i.host for i in report.instances if i.role == "denoiser" and i.host != encoder_host and i.state == "ready")
    on_2 = [i.id for i in report.instances if i.host == host2 and i.state == "ready"]
    thread, result = _load(cluster, 40, "link down", concurrency=40)
    wait_until(lambda: any(i.in_flight for i in cluster.status().instances if i.host == host2), timeout=60, step=0.02)
    cluster.hosts.link(2, up=False)
    t_down = time.monotonic()
    try:
        wait_until(lambda: all(i.state == "dead" for i in cluster.status().instances if i.id in on_2), timeout=30,
                   step=0.05)
        dead_after = time.monotonic() - t_down
        thread.join(180)
        outcomes = result["outcomes"]
        assert len(outcomes) == 40 and [o.error for o in outcomes if not o.ok] == []
        assert dead_after <= TIMEOUT_S + 1.0, dead_after
    finally:
        cluster.hosts.link(2, up=True)
    # the link is back: the same processes register again
    wait_until(lambda: all(i.state == "ready" for i in cluster.status().instances if i.id in on_2), timeout=60)


def test_a_host_that_joins_late_gets_work_within_a_heartbeat(cluster):
    i = cluster.hosts.add()
    cluster.join(i, 0, 1, 0)
    late = wait_until(lambda: next((x for x in cluster.status().instances if x.host.startswith(cluster.hosts.names[i])
                                    and x.state == "ready"), None), timeout=120, step=0.2)
    t_ready = time.monotonic()
    with Client(cluster.head) as client:
        outcomes = client.run_all(slow(24, "late"), concurrency=12)  # long denoising: every denoiser is needed
    assert all(o.ok for o in outcomes)
    assert next(x for x in cluster.status().instances if x.id == late.id).completed > 0
    assert time.monotonic() - t_ready < 60


def test_stop_host_drains_only_that_host(cluster, tmp_path):
    report = cluster.status()
    late_host = next(i.host for i in report.instances if i.host.startswith(cluster.hosts.names[3]))
    late = [i.id for i in report.instances if i.host == late_host]
    proc = cluster.launchers[3]
    res = subprocess.run([sys.executable, "-m", "disagg", "stop", "--endpoint", cluster.head, "--host", late_host,
                          "--drain"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert proc.wait(60) == 0, cluster.log(3)  # its launcher ends once its roles exited
    report = cluster.status()
    assert all(i.state == "dead" for i in report.instances if i.id in late)
    assert sum(i.state == "ready" for i in report.instances) == 6  # the rest keeps serving (1 + 3 + 2)
    with Client(cluster.head) as client:
        assert all(o.ok for o in client.run_all(small(4, "after stop"), concurrency=2))
