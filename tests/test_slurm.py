"""deploy/slurm/disagg.sbatch under a real Slurm (tests/slurm.py): Debian's slurmctld and a slurmd on each of 3
network-namespace nodes with 4 placeholder GPUs each, declared as GRES, so Slurm itself allocates the GPUs and sets
CUDA_VISIBLE_DEVICES per step. A job holding GPUs 0 and 1 of every node runs first: the recipe's job gets 2 and 3,
and its instances must see those. Its requests go through the gateway with the official `openai` client; a
joining node dies under load; `scancel` must leave nothing behind. One cluster and one recipe job serve the
module's tests, in order."""

from __future__ import annotations

import base64
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from disagg.client import Client, Unreachable
from disagg.launcher.ports import free_port_pair
from disagg.roles.pipelines.sim import expected_pixels, image_checksum
from disagg.transport.wire.messages import GenerationParams
from tests import netns, slurm
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
WHY_NOT = netns.available() or slurm.available()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")]

NODES, GPUS, JOB_GPUS = 3, 4, 2
#: FLUX.1's stage times on an H200 (sim:flux-h200): at 64x64 and 4 steps a denoise takes 0.23 s, so requests are
#: in flight on every node when one dies
MODEL = "sim:flux-h200"
SIZE = dict(width=64, height=64, num_inference_steps=4)


class Job:
    """The recipe's job on the cluster, and how to reach its head."""

    def __init__(self, cluster: slurm.SlurmCluster, folder: Path):
        self.cluster, self.folder = cluster, folder
        self.port, self.http_port = free_port_pair(), free_port_pair()
        self.head_addr = cluster.hosts.addr(0)
        self.endpoint = f"tcp://{self.head_addr}:{self.port}"
        self.id = ""

    def env(self, **extra) -> dict[str, str]:
        """What the job is submitted with: the recipe's variables, the tree under test, no spare interpreters."""
        return {"DISAGG_MODEL": MODEL, "DISAGG_PORT": str(self.port), "DISAGG_HTTP_PORT": str(self.http_port),
                "DISAGG_BIN": f"{sys.executable} -m disagg", "DISAGG_SPARES": "0", "DISAGG_HEAD_WAIT": "120",
                "PYTHONPATH": str(ROOT), **extra}

    def status(self):
        try:
            with Client(self.endpoint) as client:
                return client.status(timeout_s=3)
        except (Unreachable, RuntimeError):
            return None

    def output(self) -> str:
        out = self.folder / f"job-{self.id}.out"
        return out.read_text()[-3000:] if out.exists() else "(no output yet)"


@pytest.fixture(scope="module")
def cluster(module_tmp):
    c = slurm.SlurmCluster(module_tmp / "slurm", NODES, GPUS)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def job(cluster, module_tmp):
    # another job holds GPUs 0 and 1 of every node: Slurm gives the recipe's job 2 and 3
    holder = cluster.sbatch(f"--nodes={NODES}", f"--gpus-per-node={JOB_GPUS}", "--ntasks-per-node=1",
                            "-o", "/dev/null", "--wrap", "sleep 900")
    wait_until(lambda: cluster.job_state(holder) == "RUNNING", timeout=60, step=0.2)
    j = Job(cluster, module_tmp)
    j.id = cluster.sbatch(f"--nodes={NODES}", f"--gpus-per-node={JOB_GPUS}", "--exclusive=user",
                          "-o", str(module_tmp / "job-%j.out"), str(ROOT / "deploy/slurm/disagg.sbatch"),
                          env=j.env(), cwd=module_tmp)
    want = 2 + (NODES - 1) * JOB_GPUS  # the head's encoder and decoder, a denoiser per GPU on the others

    def ready():
        if cluster.job_state(j.id) not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {j.id} ended: {cluster.job_state(j.id)}\n{j.output()}")
        r = j.status()
        return r is not None and sum(i.state == "ready" for i in r.instances) >= want and r

    wait_until(ready, timeout=240, step=0.5, why=j.output)
    yield j
    cluster.run("scancel", holder)


def test_the_recipe_serves_40_requests_through_the_gateway_on_the_gpus_slurm_allocated(job):
    from openai import OpenAI

    report = job.status()
    by_host: dict[str, list] = {}
    for inst in report.instances:
        by_host.setdefault(inst.host, []).append(inst)
    assert len(by_host) == NODES, [(i.id, i.host) for i in report.instances]
    roles = sorted(i.role for i in report.instances)
    assert roles == sorted(["encoder", "decoder"] + ["denoiser"] * (NODES - 1) * JOB_GPUS), roles
    # every instance sees the GPUs Slurm gave the job's step on its node (2 and 3: 0 and 1 are the other job's),
    # its own first; on each node they cover exactly that allocation
    for host, insts in by_host.items():
        seen = [i.visible_gpus for i in insts]
        assert all(sorted(s.split(",")) == ["2", "3"] for s in seen), (host, seen)
        assert {s.split(",")[0] for s in seen} == {"2", "3"}, (host, seen)

    api = OpenAI(base_url=f"http://{job.head_addr}:{job.http_port}/v1", api_key="none", max_retries=0, timeout=120)

    def one(i: int) -> str:
        r = api.images.generate(prompt=f"slurm {i}", size="64x64", response_format="b64_json",
                                extra_body={"seed": i, "num_inference_steps": SIZE["num_inference_steps"]})
        return image_checksum(base64.b64decode(r.data[0].b64_json))

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(40)))
    want = [expected_pixels({"prompt": f"slurm {i}", "seed": i, **SIZE}).hex() for i in range(40)]
    assert got == want


def test_a_joining_node_killed_under_load_loses_and_duplicates_nothing(job):
    """kill -9 of every disagg process of the job on the last node, with requests in flight there."""
    cluster, victim = job.cluster, NODES - 1
    victim_host = cluster.names[victim]  # host ids are the hostname and a suffix

    def on_victim(inst) -> bool:
        return inst.host.startswith(f"{victim_host}-")

    params = [GenerationParams(prompt=f"node dies {i}", seed=i, **SIZE) for i in range(48)]
    done: list = []

    def kill_when_busy():
        r = job.status()
        if r is None or not any(on_victim(i) and i.in_flight for i in r.instances):
            return False
        for pid in cluster.node_pids(victim, job.id):
            try:
                if "disagg" in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        return True

    killed = []
    with Client(job.endpoint) as client:
        killer = threading.Thread(target=lambda: killed.append(wait_until(kill_when_busy, timeout=60, step=0.05)))
        killer.start()
        outcomes = client.run_all(params, concurrency=12, on_outcome=done.append)
        killer.join()
    assert killed, "the victim node never had a request in flight"
    assert [o.ok for o in outcomes] == [True] * len(params), [o.error for o in outcomes if not o.ok]
    ids = [o.request_id for o in done]
    assert len(ids) == len(set(ids)) == len(params)  # each answered once
    for p, o in zip(params, outcomes):  # the same pixels as without the kill
        assert image_checksum(o.images[0]) == expected_pixels({"prompt": p.prompt, "seed": p.seed, **SIZE}).hex()
    # the head's status shows that node's instances gone
    def gone():
        mine = [i for i in job.status().instances if on_victim(i)]
        return mine and all(i.state == "dead" for i in mine)

    wait_until(gone, timeout=60, step=0.5, why=lambda: [(i.id, i.host, i.state) for i in job.status().instances])
    assert sum(i.state == "ready" for i in job.status().instances) == 2 + (NODES - 2) * JOB_GPUS


def test_scancel_leaves_no_process_segment_or_step_behind(job):
    cluster = job.cluster
    res = cluster.run("scancel", job.id)
    assert res.returncode == 0, res.stderr
    wait_until(lambda: cluster.job_state(job.id) in ("CANCELLED", "COMPLETED", "FAILED"), timeout=60, step=0.2)

    def left():
        def what(pid):
            try:
                return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:200]
            except OSError:
                return f"{pid} (gone)"

        return {name: ([what(p) for p in cluster.node_pids(i, job.id)], cluster.node_shm(i))
                for i, name in enumerate(cluster.names) if cluster.node_pids(i, job.id) or cluster.node_shm(i)}

    wait_until(lambda: not left(), timeout=60, step=0.5, why=left)
    assert job.status() is None  # nothing answers at the head


def test_a_job_with_fewer_gpus_than_its_layout_needs_fails_at_once_naming_both(cluster, module_tmp):
    job = Job(cluster, module_tmp)
    t0 = time.monotonic()
    job.id = cluster.sbatch("--nodes=2", "--gpus-per-node=1", "--exclusive=user", "-o", str(module_tmp / "job-%j.out"),
                            str(ROOT / "deploy/slurm/disagg.sbatch"), env=job.env(DISAGG_GPUS_PER_DENOISER="2"),
                            cwd=module_tmp)
    wait_until(lambda: cluster.job_state(job.id) in ("FAILED", "COMPLETED", "CANCELLED"), timeout=60, step=0.2)
    out = job.output()
    assert cluster.job_state(job.id) == "FAILED", out
    assert "got 1 GPU(s)" in out and "need 2 each" in out and "nothing was started" in out, out
    assert time.monotonic() - t0 < 30
    assert job.status() is None


@pytest.mark.parametrize("env, says", [
    # a head that exits is seen at once: DISAGG_HEAD_WAIT (300 s) is not waited out
    ({"DISAGG_MODEL": "no-such-model"}, "exited (status"),
    # a head that runs but does not answer at the address the others would use
    ({"DISAGG_HEAD_ADDR": "10.9.9.9", "DISAGG_HEAD_WAIT": "3"}, "did not answer at tcp://10.9.9.9:"),
], ids=["exits", "never-answers"])
def test_a_head_that_exits_or_never_answers_fails_the_job_before_any_node_joins(cluster, module_tmp, env, says):
    job = Job(cluster, module_tmp)
    job.id = cluster.sbatch("--nodes=2", "--gpus-per-node=1", "--exclusive=user", "-o", str(module_tmp / "job-%j.out"),
                            str(ROOT / "deploy/slurm/disagg.sbatch"), env=job.env(**env), cwd=module_tmp)
    wait_until(lambda: cluster.job_state(job.id) in ("FAILED", "COMPLETED", "CANCELLED"), timeout=90, step=0.2,
               why=job.output)
    out = job.output()
    assert cluster.job_state(job.id) == "FAILED" and says in out, out
    # no join step ran: the second node's run folder was never made
    assert not (module_tmp / f"disagg-{job.id}" / cluster.names[1]).exists(), out
    wait_until(lambda: not any(cluster.node_pids(i, job.id) for i in range(NODES)), timeout=60, step=0.5)
