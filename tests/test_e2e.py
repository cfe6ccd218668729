"""End to end over real processes: one `disagg launch -e 2 -d 4` shared by this module."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import socket
import time

import numpy as np
import pytest
import zmq
from PIL import Image

from disagg.client import Client
from disagg.settings import Settings
from disagg.transport.wire.messages import GenerationParams, Heartbeat, Register, encode
from tests.conftest import Launched, disagg, pid_alive, segments_of, wait_until

pytestmark = pytest.mark.e2e

N_INSTANCES = 7  # 2 encoders, 4 denoisers, the default single decoder


@pytest.fixture(scope="module")
def deployment(module_tmp):
    dep = Launched(["-e", "2", "-d", "4", "--no-dashboard"], module_tmp)
    try:
        dep.report = dep.wait_ready(N_INSTANCES)
        yield dep
    finally:
        dep.stop()


def test_status_json_lists_every_instance_ready(deployment):
    res = disagg("status", "--json", "--endpoint", deployment.endpoint, timeout=30)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    insts = doc["instances"]
    assert sorted(i["role"] for i in insts) == ["decoder"] + ["denoiser"] * 4 + ["encoder"] * 2
    fields = {"id", "role", "pid", "host", "device", "state", "capacity", "free_slots", "in_flight", "completed", "failed"}
    for inst in insts:
        assert fields <= set(inst), inst
        assert inst["state"] == "ready" and inst["device"] == "cpu" and pid_alive(inst["pid"])
        assert inst["free_slots"] == inst["capacity"] == Settings().role(inst["role"]).capacity  # the defaults
    assert set(doc["queues"]) == {"encoder", "denoiser", "decoder"}
    assert {"in_flight", "completed", "failed"} <= set(doc["requests"])
    assert pid_alive(doc["orchestrator"]["pid"])
    # every role is on this host, so its control messages take the fast lane
    assert os.path.exists(doc["orchestrator"]["lane"])
    assert all(inst["lane"] for inst in insts), [(i["id"], i["lane"]) for i in insts]


def test_status_table_shows_instances(deployment):
    res = disagg("status", "--endpoint", deployment.endpoint, timeout=30)
    assert res.returncode == 0
    for i in range(4):
        assert f"denoiser-{i}" in res.stdout
    assert "encoder-1" in res.stdout and "decoder-0" in res.stdout


CASES = [
    dict(prompt="a red cat on the beach", seed=0),
    dict(prompt="A photo of a dog at night!", width=96, height=64, num_inference_steps=3, seed=7, num_images_per_prompt=2),
    dict(prompt="green forest and a blue river", width=64, height=128, num_inference_steps=2, guidance_scale=1.5, seed=42),
]


def test_parity_with_diffusers_pipeline(deployment):
    """The disaggregated image equals the diffusers pipeline called directly with the same seed."""
    import torch

    from disagg.roles.pipelines.tiny import build_tiny_flux_pipeline

    with Client(deployment.endpoint) as client:
        outcomes = client.run_all([GenerationParams(**c) for c in CASES], concurrency=3)
    assert [o.ok for o in outcomes] == [True] * len(CASES), [o.error for o in outcomes]
    pipe = build_tiny_flux_pipeline()
    defaults = dict(width=128, height=128, num_inference_steps=4, guidance_scale=3.5, num_images_per_prompt=1)
    for case, outcome in zip(CASES, outcomes):
        p = {**defaults, **case}
        seed = p.pop("seed")
        ref = pipe(p.pop("prompt"), generator=torch.Generator("cpu").manual_seed(seed), **p).images
        assert len(outcome.images) == len(ref) == p["num_images_per_prompt"]
        for data, want in zip(outcome.images, ref):
            got = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)
            want = np.asarray(want, dtype=np.int16)
            assert got.shape == (p["height"], p["width"], 3)
            assert np.abs(got - want).max() <= 1
            assert got.std() > 5  # a real picture, not a constant
    # different prompts, same seed and size: different pictures
    assert outcomes[0].images[0] != outcomes[2].images[0]


def test_submit_cli_writes_pngs_with_timings(deployment, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a tree", "width": 64, "height": 32}\n{"prompt": "a house", "seed": 3}\n')
    out = tmp_path / "out"
    res = disagg("submit", str(prompts), "--endpoint", deployment.endpoint, "--out", str(out), "--json", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["completed"] == 2 and doc["failed"] == 0
    sizes = []
    for rec in doc["results"]:
        [path] = rec["files"]
        assert os.path.basename(path) == f"{rec['request_id']}.png"
        sizes.append(Image.open(path).size)
        for key in ("queue_encoder", "compute_encoder", "fetch_denoiser", "compute_denoiser", "compute_decoder", "total"):
            assert key in rec["timings"], rec["timings"]
    assert sorted(sizes) == [(64, 32), (128, 128)]


BAD_FILES = [
    ('{"width": 64}', "prompt"),
    ('[{"prompt": "ok"}, {"prompt": "x", "width": -64}]', "width"),
    ('{"prompt": "x", "sharpness": 3}', "sharpness"),
    ('{"prompt": "x",', "invalid JSON"),
]


@pytest.mark.parametrize("content,needle", BAD_FILES, ids=["missing-prompt", "negative-width", "unknown-field", "invalid-json"])
def test_bad_prompt_files_refused_clearly(deployment, tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content)
    res = disagg("submit", str(path), "--endpoint", deployment.endpoint, "--out", str(tmp_path), timeout=30)
    assert res.returncode == 2
    assert needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_ten_megabytes_of_garbage_refused(deployment, tmp_path):
    path = tmp_path / "garbage.json"
    path.write_bytes(random.Random(1).randbytes(10 * 1024 * 1024))
    res = disagg("submit", str(path), "--endpoint", deployment.endpoint, timeout=60)
    assert res.returncode == 2 and "invalid JSON" in res.stderr and "Traceback" not in res.stderr


def test_garbage_on_both_sockets_is_dropped(deployment):
    ctx = zmq.Context.instance()
    rng = random.Random(3)
    for port in (deployment.port, deployment.port + 1):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        payloads = [
            [b""], [b"\xc1"], [rng.randbytes(100)], [rng.randbytes(3000), b"x", b"y"],
            [encode(Heartbeat(instance_id="ghost"))],  # valid message, not registered
            [b"\x81\xa4type\xa6submit"],  # a tagged envelope with its fields missing
        ]
        for frames in payloads:
            sock.send_multipart(frames)
        sock.close()
        # and bytes that are not even ZMTP
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(rng.randbytes(5000))
    # a fake role with someone else's identity cannot register
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"impostor")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{deployment.port + 1}")
    from disagg.transport.wire.messages import PoolInfo

    pool = PoolInfo(host_id="x", engines=["shm"], pool_name="nope", pool_bytes=1)
    sock.send_multipart([encode(Register(role="encoder", instance_id="encoder-0", pid=1, host_id="x", device="cpu", capacity=1, pool=pool))])
    sock.close()
    time.sleep(0.3)
    with Client(deployment.endpoint) as client:
        report = client.status()
        assert sum(i.state == "ready" for i in report.instances) == N_INSTANCES
        [outcome] = client.run_all([GenerationParams(prompt="still serving", width=32, height=32, num_inference_steps=1)])
    assert outcome.ok, outcome.error
    log = (deployment.run_dir / "logs" / "orchestrator.log").read_text()
    assert "dropped a bad message" in log


def test_garbage_on_the_lane_is_dropped(deployment):
    """The fast lane refuses strangers, drops bad packets and messages, and keeps serving."""
    import msgspec

    from disagg.transport.wire.bundle import decode_frames
    from disagg.transport.wire.lane import LANE_MAX_PACKET, WELCOME, LaneClosed
    from disagg.transport.wire.lane import connect as connect_lane
    from disagg.transport.wire.messages import Bundle, Rejected, ServerReply, StatusQuery, StatusReport

    with Client(deployment.endpoint) as client:
        report = client.status()
    path, oid = report.orchestrator["lane"], report.orchestrator["id"].encode()

    def recv(lane, timeout=5.0):
        return wait_until(lane.recv, timeout=timeout, step=0.01, why=lambda: "no answer on the lane")

    # strangers are closed without a word: another orchestrator's id, an unknown role, nonsense
    for hello in ([b"client", b"me", b"not-this-one"], [b"client", b"", oid], [b"role", b"denoiser-99", oid],
                  [b"\xff" * 10]):
        lane = connect_lane(path, hello)
        lane.send([encode(StatusQuery())])  # at once, before it could be refused: never read
        with pytest.raises(LaneClosed):
            recv(lane)
    lane = connect_lane(path, [b"client", b"lane-test", oid])
    assert recv(lane) == [[WELCOME]]
    lane.sock.send(b"\x01")  # not a packet
    for frames in ([b"\xc1"], [b""], [encode(Bundle(messages=[msgspec.Raw(b"\xc1")], frames=[5]))],
                   [encode(Heartbeat(instance_id="ghost"))]):
        lane.send(frames)
    lane.send([encode(StatusQuery())])
    replies = []
    while not any(isinstance(r, StatusReport) for r, _ in replies):
        for frames in recv(lane):
            replies.extend(decode_frames(frames, ServerReply))
    assert sum(i.state == "ready" for i in replies[-1][0].instances) == N_INSTANCES
    # each bad message was answered on the lane with the cause (the unframed packet is only logged)
    bad = [r.reason for r, _ in replies if isinstance(r, Rejected)]
    assert len(bad) == 4 and all(reason.startswith("bad message") for reason in bad), bad
    lane.close()
    with Client(deployment.endpoint) as client:
        # a 256x256 PNG is too big for one lane packet: that Result comes over ZeroMQ, the rest by lane
        [outcome] = client.run_all([GenerationParams(prompt="lane still serving", width=256, height=256, num_inference_steps=1)])
        assert client.lane is not None  # it went over the lane
    assert outcome.ok, outcome.error
    assert len(outcome.images[0]) > LANE_MAX_PACKET


def test_all_slots_and_pools_free_after_the_runs(deployment):
    with Client(deployment.endpoint) as client:
        report = client.status()
    assert report.requests.in_flight == 0 and report.requests.failed == 0
    for inst in report.instances:
        assert inst.free_slots == inst.capacity and inst.pool_used_bytes == 0, inst
    # on one host `auto` fetches by shared memory (tests/test_engines_e2e.py runs the others)
    assert {i.engine for i in report.instances if i.role != "encoder"} == {"shm"}, report.instances


def test_an_image_for_a_text_only_model_is_refused_naming_the_model(deployment):
    image = io.BytesIO()
    Image.new("RGB", (64, 48), "red").save(image, format="PNG")
    with Client(deployment.endpoint) as client:
        bad, good = client.run_all([GenerationParams(prompt="a", image=image.getvalue(), width=32, height=32),
                                    GenerationParams(prompt="b", width=32, height=32)])
    assert not bad.ok and "model 'tiny' takes text-to-image (a prompt) only" in bad.error, bad.error
    assert bad.attempts == 1  # the request's fault: no retry
    assert good.ok, good.error


@pytest.mark.ends_deployment
def test_sigterm_stops_every_process_and_segment(deployment):
    """Last in the module: SIGTERM to `disagg launch` leaves no process and no shared memory."""
    with Client(deployment.endpoint) as client:
        report = client.status()
    pids = [i.pid for i in report.instances] + [int(report.orchestrator["pid"]), deployment.proc.pid]
    ours = report.orchestrator["deployment_id"]
    assert len(segments_of(ours)) >= N_INSTANCES
    deployment.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10,
               why=lambda: f"processes left: {[p for p in pids if pid_alive(p)]}")
    assert deployment.proc.wait(timeout=5) is not None
    assert not segments_of(ours)
    assert not os.path.exists(report.orchestrator["lane"])  # nor the lane's socket file
