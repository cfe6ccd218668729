"""A rebalance move outlives the orchestrator that made it (issue 42 D1, D5): over real processes, a sim deployment
under `--rebalance auto` whose orchestrator is killed -9 while a device is between two roles. The successor hears of
the device from its launcher, gives it a role under an id the deployment never used, and every device serves again;
the split `status` reports is the one serving."""

from __future__ import annotations

import collections
import json
import os
import signal
import stat

import psutil
import pytest

from disagg.transport.wire.messages import GenerationParams
from tests.conftest import Launched, Load, disagg, wait_until

pytestmark = pytest.mark.e2e

DEVICES = 5


def serving_split(report) -> str:
    ready = collections.Counter(i.role for i in report.instances if i.state == "ready")
    return ":".join(str(ready[r]) for r in ("encoder", "denoiser", "decoder"))


@pytest.fixture(scope="module")
def dep(module_tmp):
    # --admission slo: the trace test's unmeetable deadlines are refused
    yield from Launched(["--model", "sim:mixed-h200", "--gpus", "0,1,2,3,4", "-e", "2", "-d", "2", "-k", "1",
                         "--rebalance", "auto", "--admission", "slo", "--no-dashboard"], module_tmp).serve(DEVICES)


def test_a_move_cut_by_an_orchestrator_restart_is_finished_and_reported_truthfully(dep):
    first = dep.status()
    started = {i.id for i in first.instances}
    # denoiser-bound (1024^2, 8 steps): the plan wants 1:3:1, so an encoder moves to the denoisers
    load = Load(dep.endpoint, [GenerationParams(prompt=f"move {i}", width=1024, height=1024, num_inference_steps=8,
                                                seed=i) for i in range(40)], concurrency=8)
    moving = wait_until(lambda: dep.status().rebalance.moving, timeout=90, step=0.05, why=lambda: dep.status().rebalance)
    launcher = psutil.Process(dep.proc.pid)
    launcher.suspend()  # it takes no order: the moving instance exits and its device waits between roles
    try:
        wait_until(lambda: (r := dep.status().rebalance.moving) and all(m.state == "restarting" for m in r),
                   timeout=60, step=0.05, why=lambda: dep.status().rebalance)
        old = int(dep.status().orchestrator["pid"])
        os.kill(old, signal.SIGKILL)
    finally:
        launcher.resume()
    outcomes = load.join(timeout=240)
    assert len(outcomes) == 40 and [o.error for o in outcomes if not o.ok] == []

    def settled():
        r = dep.status()
        ready = sum(i.state == "ready" for i in r.instances)
        return r.orchestrator["pid"] != old and not r.rebalance.moving and ready == DEVICES and r
    report = wait_until(settled, timeout=120, step=0.2, why=lambda: (dep.status().rebalance, dep.status().instances))
    # every device of the launch serves, none under an id it had before or another device had
    ready = [i.id for i in report.instances if i.state == "ready"]
    retired = {m.instance_id for m in moving}
    assert not retired & set(ready), (moving, ready)
    assert len(set(ready)) == DEVICES and set(ready) - started  # the moved device serves under a new id
    assert report.rebalance.current == serving_split(report) and report.rebalance.budget == DEVICES
    assert any("between roles" in w for w in report.warnings), report.warnings


def test_bench_trace_exits_1_and_counts_refusals_by_reason(dep, tmp_path):
    """Issue 42 L2: three lines whose deadlines cannot be met are refused (admission slo); `bench --trace` says so
    once, with the count (each refusal's figures differ), and exits 1."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"t": i * 0.1, "width": 1024, "height": 1024, "num_inference_steps": 8,
                                         "slo_ms": 1 + i}) + "\n" for i in range(3))
                     + json.dumps({"t": 0.3, "width": 512, "height": 512, "num_inference_steps": 4}) + "\n")
    res = disagg("bench", "--trace", str(trace), "--endpoint", dep.endpoint, "--json", timeout=120)
    assert res.returncode == 1 and res.stdout, (res.stdout, res.stderr)
    doc = json.loads(res.stdout)
    [failure] = doc["failures"]
    assert failure["count"] == 3 and failure["code"] == "deadline_unmeetable" and "slo_ms N" in failure["reason"]
    assert "error: 3 of 4 requests failed or were refused" in res.stderr and "3 x " in res.stderr


def test_logs_and_run_folders_are_the_owners_only(dep):
    """Issue 43 F13: logs hold request ids and errors (and may hold prompts): 0700 folders, 0600 files, the
    forked roles' and the restarted orchestrator's logs too."""
    logs = dep.run_dir / "logs"
    assert stat.S_IMODE(dep.run_dir.stat().st_mode) == 0o700 and stat.S_IMODE(logs.stat().st_mode) == 0o700
    files = list(logs.glob("*.log"))
    assert {"orchestrator.log", "encoder-0.log", "decoder-0.log"} <= {f.name for f in files}
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {f.name: oct(0o600) for f in files}
