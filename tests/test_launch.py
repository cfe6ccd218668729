"""`disagg launch` as a whole: batch mode, Ctrl-C, boot errors, and the CLI without a deployment."""

from __future__ import annotations

import io
import json
import signal
import time

import pytest
from PIL import Image
from rich.console import Console

from disagg.launcher.cli.dashboard import events_between, status_view
from tests.conftest import ROOT, Launched, deployment_id, disagg, free_port_pair, pid_alive, segments_of, wait_until

pytestmark = pytest.mark.e2e


def test_readme_batch_command_writes_images(tmp_path):
    """The README's first command (on a free port): 1:2:1, the example prompts, PNGs, exit 0."""
    out = tmp_path / "out"
    res = disagg(
        "launch", "--submit", str(ROOT / "examples" / "prompts.json"), "--out", str(out),
        "--port", str(free_port_pair()), "--run-dir", str(tmp_path / "run"), timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "8/8 requests succeeded" in res.stdout
    sizes = sorted(Image.open(p).size for p in out.glob("*.png"))
    assert sizes == [(64, 64)] * 8  # the demo model's size
    # 1 encoder, 2 denoisers, 1 decoder, each with its own log
    logs = sorted(p.stem for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert logs == ["decoder-0", "denoiser-0", "denoiser-1", "encoder-0", "fork-server", "orchestrator"]
    assert not segments_of(deployment_id(tmp_path / "run"))


def test_ctrl_c_stops_everything_within_10s(tmp_path):
    dep = Launched(["--model", "payload", "-d", "1", "--no-dashboard"], tmp_path)
    try:
        report = dep.wait_ready(3)
        pids = [i.pid for i in report.instances] + [int(report.orchestrator["pid"])]
        dep.proc.send_signal(signal.SIGINT)
        wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10,
                   why=lambda: [p for p in pids if pid_alive(p)])
        assert dep.proc.wait(timeout=5) is not None
        assert not segments_of(report.orchestrator["deployment_id"])
        assert "stopped" in dep.output()
    finally:
        dep.stop()


def test_boot_error_stops_the_launch_with_the_cause(tmp_path):
    """A role that cannot start (here: a checkpoint whose weights are missing) stops the launch."""
    import json

    folder = tmp_path / "broken"
    (folder / "vae").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline", "vae": ["diffusers", "AutoencoderKL"]}))
    (folder / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    t0 = time.monotonic()
    res = disagg("launch", "--model", str(folder), "-d", "1", "--port", str(free_port_pair()),
                 "--run-dir", str(tmp_path / "run"), "--no-dashboard", timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    # whichever role fails first (its weights are missing) stops the launch with its log
    assert "failed to start before the deployment was ready" in res.stdout and "last log lines" in res.stdout, res.stdout
    assert "Error" in res.stdout
    assert time.monotonic() - t0 < 90


def test_gpus_that_are_not_there_are_refused_before_any_process_starts(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the check needs one that does not")
    t0 = time.monotonic()
    res = disagg("launch", "--gpus", "0", "-d", "1", "--run-dir", str(tmp_path / "run"), timeout=60)
    assert res.returncode == 2 and "GPU 0 not found" in res.stderr, res.stderr
    assert time.monotonic() - t0 < 15 and not (tmp_path / "run").exists()


def test_unknown_model_refused_before_any_process_starts(tmp_path):
    t0 = time.monotonic()
    res = disagg("launch", "--model", "no-such-model", "--run-dir", str(tmp_path / "run"), timeout=30)
    assert res.returncode == 2 and "unknown model 'no-such-model'" in res.stderr
    assert time.monotonic() - t0 < 10 and not (tmp_path / "run").exists()


def test_status_without_orchestrator_exits_3_fast():
    port = free_port_pair()
    t0 = time.monotonic()
    res = disagg("status", "--endpoint", f"tcp://127.0.0.1:{port}", timeout=10)
    assert time.monotonic() - t0 < 2.0
    assert res.returncode == 3
    assert f"cannot reach the orchestrator at tcp://127.0.0.1:{port}" in res.stderr
    assert "Traceback" not in res.stderr
    for cmd in (["stop"], ["submit", str(ROOT / "examples" / "prompts.json")]):
        res = disagg(*cmd, "--endpoint", f"tcp://127.0.0.1:{port}", timeout=10)
        assert res.returncode == 3 and "cannot reach" in res.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--capacity", "1,2"], "--capacity"),
        (["--gpus", "a,b"], "--gpus"),
        (["--transfer", "carrier-pigeon"], "--transfer"),
        (["-d", "-1"], "--denoisers"),
        (["--transfer", "cuda-ipc"], "cuda-ipc needs GPUs"),
        (["--transfer-protocol", "rdma"], "ib_device"),
        # issue 22 L10: caught before anything starts, not by the gateway's bind error
        (["--port", "7000", "--http-port", "7001"], "role port"),
        (["-e", "0", "-d", "0", "-k", "0", "--submit", "examples/prompts.json"], "starts no role instance"),
    ],
)
def test_launch_usage_errors(args, needle):
    res = disagg("launch", *args, timeout=30)
    assert res.returncode == 2 and needle in res.stderr


def test_bad_config_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("denoisers:\n  count: 2\n  colour: red\n")
    res = disagg("launch", "--config", str(cfg), timeout=30)
    assert res.returncode == 2 and "colour" in res.stderr


def test_dashboard_renders_every_instance_and_events():
    from disagg.transport.wire.messages import InstanceStatus, RequestCounts, StatusReport

    def inst(i, role, state):
        return InstanceStatus(id=f"{role}-{i}", role=role, pid=100 + i, host="h", device="cpu", state=state,
                              capacity=2, free_slots=1, in_flight=1, completed=5, failed=0, engine="shm",
                              pool_bytes=64 << 20, pool_used_bytes=1 << 20)

    a = StatusReport(orchestrator={"pid": 1, "state": "ready", "uptime_s": 3.0},
                     instances=[inst(0, "encoder", "starting"), inst(0, "denoiser", "ready")],
                     queues={"encoder": 2, "denoiser": 0, "decoder": 1}, requests=RequestCounts(in_flight=3))
    b = StatusReport(orchestrator={"pid": 1, "state": "ready", "uptime_s": 4.0},
                     instances=[inst(0, "encoder", "ready"), inst(0, "denoiser", "dead")],
                     queues={"encoder": 0, "denoiser": 0, "decoder": 0},
                     requests=RequestCounts(completed=4, failed=1), throughput_rps=1.5)
    console = Console(record=True, file=io.StringIO(), width=160)
    console.print(status_view(b))
    text = console.export_text()
    for needle in ("encoder-0", "denoiser-0", "dead", "1/2", "1.0/64.0", "completed 4", "1.50 req/s"):
        assert needle in text, needle
    events = events_between(a, b)
    assert "encoder-0 (encoder, pid 100, cpu) is ready" in events
    assert "denoiser-0 (denoiser, pid 100, cpu) is dead" in events
    assert any("4 completed, 1 failed" in e for e in events)
    # issue 44 (newcomer D12): an instance that stops to move (rebalance auto) is not announced as dead
    from disagg.transport.wire.messages import RebalanceStatus, RoleMove

    move = RoleMove(instance_id="denoiser-0", new_id="decoder-1", from_role="denoiser", to_role="decoder",
                    state="draining")
    a.rebalance = RebalanceStatus(mode="auto", budget=2, current="1:1:0", moving=[move])
    events = events_between(a, b)
    assert "denoiser-0 (denoiser, pid 100, cpu) stopped to move: its device becomes decoder-1 (decoder)" in events
    assert not any("is dead" in e for e in events), events


def test_colocated_baseline_gives_the_same_pixels(tmp_path):
    """`--colocated 1`: one process runs all three stages; the image equals diffusers' own."""
    import numpy as np
    import torch

    from disagg.roles.pipelines.tiny import build_tiny_flux_pipeline

    prompts = tmp_path / "p.json"
    prompts.write_text('{"prompt": "a red fox", "width": 64, "height": 64, "num_inference_steps": 2, "seed": 5}')
    out = tmp_path / "out"
    res = disagg("launch", "--model", "tiny", "--colocated", "1", "--submit", str(prompts), "--out", str(out), "--json",
                 "--port", str(free_port_pair()), "--run-dir", str(tmp_path / "run"), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    # issue 22 M4: with --json, stdout is that JSON alone; the banner and events go to stderr
    assert json.loads(res.stdout)["completed"] == 1, res.stdout
    assert "ready:" in res.stderr and "stopped" in res.stderr
    logs = sorted(p.stem for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert logs == ["monolith-0", "orchestrator"]
    [png] = out.glob("*.png")
    got = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)
    want = build_tiny_flux_pipeline()("a red fox", width=64, height=64, num_inference_steps=2,
                                      generator=torch.Generator("cpu").manual_seed(5)).images[0]
    assert np.abs(got - np.asarray(want, dtype=np.int16)).max() <= 1
