"""The small defects of issue 11: messages, limits checked up front, prompt-file positions, the table at
80 columns, markup in user text, launch --submit --json, a stop during startup, leftovers."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from disagg.launcher.cli.batch import OutDirError, check_out_dir
from disagg.launcher.cli.dashboard import bench_view, status_view
from disagg.launcher.cli.prompts import PromptError, parse_prompts
from disagg.launcher.run import EventLog
from disagg.transport.data.shm import list_segments
from disagg.transport.wire.messages import InstanceStatus, RequestCounts, StatusReport
from tests.conftest import ROOT, Launched, disagg, free_port_pair, pid_alive, segments_of, wait_until


def test_jsonl_errors_give_the_files_line_and_lists_count_from_1():
    with pytest.raises(PromptError, match=r"f: line 4: .*width"):
        parse_prompts('{"prompt": "a"}\n\n\n{"prompt": "b", "width": -3}\n', "f")
    with pytest.raises(PromptError, match=r"f: entry 2: .*prompt"):
        parse_prompts('[{"prompt": "a"}, {"seed": 1}]', "f")


@pytest.mark.parametrize("entry, says", [
    ('{"prompt": "a", "seed": -5}', "Expected `int` >= 0, or -1 for a random seed - at `$.seed`"),
    ('{"prompt": "a", "steps": 4}', "unknown field `steps` (did you mean num_inference_steps?)"),
    ('{"prompt": "a", "cfg": 4}', "unknown field `cfg` (did you mean guidance_scale?)"),
    ('{"prompt": "a", "negative_promt": "x"}', "unknown field `negative_promt` (did you mean negative_prompt?)"),
])
def test_a_prompts_files_bad_field_says_what_it_takes(entry, says):
    """Issue 44 (newcomer D3): -1 is a seed too (a random one), and an unknown field names the one it meant."""
    with pytest.raises(PromptError) as err:
        parse_prompts(entry, "f")
    assert says in str(err.value), err.value


@pytest.mark.parametrize("args, needle", [
    (["launch", "--heartbeat-timeout", "0.5"], "under twice the 1 s heartbeat interval"),
    (["launch", "--capacity", "1,2000,1"], "<= 1024"),
    # issue 42 D3: a compiled denoiser has no host tier; the pair is refused, naming both settings
    (["launch", "--colocated", "1", "--rebalance", "auto"], "rebalance.mode auto (--rebalance auto) with colocated"),
    (["launch", "--compile", "--lora-host-slots", "2"], "loras.host_slots 2 (--lora-host-slots) with compile (--compile)"),
    (["status", "--endpoint", "127.0.0.1:27200"], "not a tcp://HOST:PORT address"),
    (["stop", "--endpoint", "tcp://nohost"], "not a tcp://HOST:PORT address"),
])
def test_bad_settings_are_usage_errors_before_anything_starts(args, needle):
    res = disagg(*args, timeout=30)
    assert res.returncode == 2 and needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_stop_and_status_against_a_dead_port_say_connection_refused():
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    for cmd in (["stop"], ["status"], ["status", "--watch"]):
        res = disagg(*cmd, "--endpoint", endpoint, timeout=30)
        assert res.returncode == 3 and "Connection refused" in res.stderr and "--keys" not in res.stderr, res.stderr


@pytest.mark.parametrize("cmd", [["status"], ["submit", "p.json"], ["stop"], ["bench"], ["serve-http"]])
def test_client_commands_refuse_a_mistyped_variable_as_launch_does(cmd):
    """Issue 44 (newcomer D9): DISAGG_ENDPIONT was ignored in silence (the command went to the default port);
    every client command now refuses it, naming the variable it meant, before it contacts anything."""
    env = {**os.environ, "DISAGG_ENDPIONT": f"tcp://127.0.0.1:{free_port_pair()}"}
    res = disagg(*cmd, env=env, timeout=30)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "unknown variable DISAGG_ENDPIONT (did you mean DISAGG_ENDPOINT?)" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_out_dir_check_probes_the_nearest_existing_folder(tmp_path):
    check_out_dir(tmp_path / "a" / "b")  # does not exist yet: its parent is writable
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutDirError, match="not a folder"):
        check_out_dir(tmp_path / "file" / "sub")


def _report(n: int) -> StatusReport:
    instances = [InstanceStatus(id=f"denoiser-{k}", role="denoiser", pid=40000 + k, host="h", device="cuda:0",
                                state="ready", capacity=4, free_slots=3, in_flight=1, completed=123, failed=0,
                                engine="shm", pool_bytes=64 << 20, restarts=0) for k in range(n)]
    return StatusReport(orchestrator={"pid": 1, "state": "ready"}, instances=instances, queues={},
                        requests=RequestCounts())


@pytest.mark.parametrize("width", [80, 120])
def test_the_live_table_fits_narrow_terminals_with_whole_columns(width):
    console = Console(record=True, file=io.StringIO(), width=width)
    console.print(status_view(_report(3), width=width))
    text = console.export_text()
    assert "…" not in text, text
    assert "denoiser-2" in text and "ready" in text and "3/4" in text
    assert max(len(line) for line in text.splitlines()) <= width
    if width == 80:  # the least important went first
        assert "pool MiB" not in text


def test_user_text_with_brackets_is_printed_as_is():
    console = Console(record=True, file=io.StringIO(), width=200)
    EventLog(console).say("[encoder-0] pip install 'disagg[mooncake-cpu]'")
    doc = {"completed": 0, "failed": 2, "duration_s": 1.0, "throughput_rps": 0.0, "slo_factor": 2.0,
           "latency_s": {"mean": 0, "p50": 0, "p95": 0, "p99": 0}, "unloaded_latency_s": 0, "slo_attainment": 0,
           "stages": {}, "instances": [], "failures": [{"reason": "needs disagg[mooncake] here", "count": 2}],
           "path": "http", "mode": {"request_rate": 5.0}}
    console.print(bench_view(doc))
    text = console.export_text()
    assert "[encoder-0] pip install 'disagg[mooncake-cpu]'" in text and "disagg[mooncake] here" in text
    assert "path http" in text and "load open loop, 5 req/s" in text  # issue 22 L11: which path, which load


def test_launch_submit_json_and_the_warning_for_a_public_address(tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text('[{"prompt": "one"}, {"prompt": "two", "width": 32, "height": 32}]')
    out = tmp_path / "out"
    res = disagg("launch", "--model", "sim:zero", "-d", "1", "--host", "0.0.0.0", "--port", str(free_port_pair()),
                 "--submit", str(prompts), "--out", str(out), "--json", "--run-dir", str(tmp_path / "run"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "binding 0.0.0.0 without --keys" in res.stderr and "stop the deployment" in res.stderr  # issue 43 F9
    doc = json.loads(res.stdout[res.stdout.index("{"):res.stdout.rindex("}") + 1])
    assert doc["completed"] == 2 and doc["failed"] == 0
    assert sorted(r["index"] for r in doc["results"]) == [0, 1]
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 2


def test_a_stop_during_startup_is_one_line_not_a_traceback(tmp_path):
    dep = Launched(["--model", "sim:zero", "-d", "1", "--no-dashboard"], tmp_path)
    try:
        from disagg.client import Client, Unreachable

        with Client(dep.endpoint) as client:
            def answers() -> bool:
                try:
                    client.status(timeout_s=0.5)
                    return True
                except Unreachable:
                    return False

            wait_until(answers, timeout=30, step=0.05)  # the orchestrator answers; the roles are still importing torch
        res = disagg("stop", "--endpoint", dep.endpoint, timeout=30)
        assert res.returncode == 0, res.stderr
        assert dep.proc.wait(timeout=30) == 0
        out = dep.output()
        assert "Traceback" not in out and "stopped before it was ready" in out, out
    finally:
        dep.stop()


def test_a_killed_role_then_a_killed_launcher_leave_no_segment(tmp_path):
    dep = Launched(["--model", "payload", "-d", "1", "--no-dashboard"], tmp_path)
    try:
        report = dep.wait_ready(3)
        pids = [i.pid for i in report.instances] + [int(report.orchestrator["pid"])]
        denoiser = next(i.pid for i in report.instances if i.role == "denoiser")
        os.kill(denoiser, signal.SIGKILL)
        time.sleep(0.1)
        os.kill(dep.proc.pid, signal.SIGKILL)
        wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=15,
                   why=lambda: [p for p in pids if pid_alive(p)])
        # a denoiser restarted in the moment between the two kills exits too (it sees its launcher gone)
        ours = report.orchestrator["deployment_id"]

        def owners_alive():
            return [n for n in segments_of(ours) if pid_alive(int(n.rsplit("-", 1)[1]))]
        wait_until(lambda: not owners_alive(), timeout=30, why=owners_alive)
        time.sleep(0.3)
        assert not segments_of(ours)
    finally:
        dep.stop()


def test_a_role_whose_launcher_died_before_it_looked_exits_and_removes_its_pool(tmp_path):
    """The race behind a leaked `disagg-RUN-denoiser-0-PID` segment: a launcher restarts a killed role and is
    killed itself before that role checks its parent. Here the "launcher" (sh) starts the role and exits at
    once; the role must still see it gone (DISAGG_LAUNCHER_PID), exit and remove its pool. Before, it took
    the parent it found at start (init) as its launcher and lingered for the 600 s orphan grace."""
    import msgspec

    from disagg.roles.spec import WorkerSpec

    name = f"disagg-test{os.getpid()}-encoder-0"
    spec = WorkerSpec(role="encoder", instance_id="encoder-0", endpoint=f"tcp://127.0.0.1:{free_port_pair() + 1}",
                      model="payload", pool_name=name, pool_bytes=1 << 20, transfer="shm")
    pidfile = tmp_path / "role.pid"
    # as the supervisor does: the launcher's pid in the environment, then the role; then sh exits
    script = f'DISAGG_LAUNCHER_PID=$$ {sys.executable} -m disagg.roles "$0" > {tmp_path}/role.log 2>&1 & echo $! > {pidfile}'
    launcher = subprocess.Popen(["sh", "-c", script, msgspec.json.encode(spec).decode()], cwd=ROOT,
                                start_new_session=True)
    launcher.wait()  # sh is gone before the role has even imported torch
    role = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip()))
    try:
        wait_until(lambda: not pid_alive(role), timeout=60, why=lambda: (tmp_path / "role.log").read_text()[-2000:])
    finally:
        if pid_alive(role):
            os.kill(role, signal.SIGKILL)
    assert "launcher is gone" in (tmp_path / "role.log").read_text()
    assert not [s for s in list_segments("disagg-") if s.startswith(f"{name}-")]
