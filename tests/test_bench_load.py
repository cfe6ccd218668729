"""`disagg bench` against a real deployment of the simulated model, and the sim model itself."""

from __future__ import annotations

import json
import time

import pytest

from disagg.roles.pipelines import ModelError, model_spec
from disagg.roles.pipelines.sim import SimAdapter
from disagg.roles.pipelines.sim_profile import load_profile
from disagg.transport.data.shm import remove_segments
from tests.conftest import Launched, disagg

pytestmark = pytest.mark.e2e


def test_profiles_follow_the_measurements():
    p = load_profile("flux-h200")
    assert abs(p.stage_ms("denoiser", 1024 * 1024, 1) - 170) < 0.5
    assert abs(p.stage_ms("denoiser", 256 * 256, 1) - 65) < 0.5
    assert abs(p.stage_ms("decoder", 1024 * 1024, 4) - 85) < 0.5 and p.stage_ms("encoder", 1, 1) == 24
    assert p.payload("encoder", 1024 * 1024) == 4 * 2**20 and p.payload("denoiser", 1024 * 1024) == 512 * 2**10
    assert p.payload("denoiser", 512 * 512) == 128 * 2**10
    zero = load_profile("zero")
    assert zero.stage_ms("denoiser", 1024 * 1024, 50) == 0 and zero.payload("encoder", 10) == 16384
    with pytest.raises(ModelError, match="no simulation profile 'nope'"):
        model_spec("sim:nope")


@pytest.fixture
def sim_run(monkeypatch):
    run = f"test{time.monotonic_ns()}"
    monkeypatch.setenv("DISAGG_RUN_ID", run)
    yield run
    remove_segments(f"disagg-{run}-")


def test_sim_stage_takes_its_time_and_shares_a_device(sim_run):
    a = SimAdapter("flux-h200", "denoiser", "sim:0")
    b = SimAdapter("flux-h200", "encoder", "sim:0")
    params = dict(width=256, height=256, num_inference_steps=2, num_images_per_prompt=1, seed=0)
    t0 = time.perf_counter()
    out = a.denoise({}, params)
    took = time.perf_counter() - t0
    assert 0.125 <= took < 0.4 and out["x"].numel() * 4 == 32 * 1024
    import threading

    t = threading.Thread(target=a.denoise, args=({}, params))
    t0 = time.perf_counter()
    t.start()
    time.sleep(0.01)
    b.encode(params)  # must wait for its turn on the shared device
    t.join()
    assert time.perf_counter() - t0 >= 0.125 + 0.024


@pytest.fixture(scope="module")
def deployment(module_tmp):
    dep = Launched(["--model", "sim:zero", "--no-dashboard", "-d", "1"], module_tmp)
    try:
        dep.wait_ready(3)
        yield dep
    finally:
        dep.stop()


@pytest.mark.parametrize("mode", [["--concurrency", "8"], ["--request-rate", "200"]])
def test_bench_json_report(deployment, mode):
    res = disagg("bench", "--endpoint", deployment.endpoint, *mode, "--num-requests", "60", "--json", timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["completed"] == 60 and doc["failed"] == 0 and doc["throughput_rps"] > 0 and doc["duration_s"] > 0
    lat = doc["latency_s"]
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"]
    assert set(doc["stages"]) == {"encoder", "denoiser", "decoder"}
    assert doc["stages"]["denoiser"]["transfer_s_mean"] > 0
    assert {i["role"] for i in doc["instances"]} == {"encoder", "denoiser", "decoder"}
    assert all(0 <= i["utilization"] <= 1.5 for i in doc["instances"])
    assert 0 <= doc["slo_attainment"] <= 1


def test_bench_table_and_usage_errors(deployment):
    res = disagg("bench", "--endpoint", deployment.endpoint, "--concurrency", "2", "--num-requests", "10", timeout=60)
    assert res.returncode == 0 and "throughput" in res.stdout and "denoiser-0" in res.stdout
    res = disagg("bench", "--endpoint", deployment.endpoint, "--concurrency", "2", "--request-rate", "5", timeout=30)
    assert res.returncode == 2 and "not both" in res.stderr


def test_without_the_lane_everything_takes_zeromq(tmp_path):
    """`--no-lane`: no lane is offered, roles and clients talk ZeroMQ only, and requests still complete."""
    dep = Launched(["--model", "sim:zero", "--no-dashboard", "-d", "1", "--no-lane", "--capacity", "4,4,4"], tmp_path)
    try:
        status = dep.wait_ready(3)
        assert status.orchestrator["lane"] == "" and not any(i.lane for i in status.instances)
        res = disagg("bench", "--endpoint", dep.endpoint, "--concurrency", "16", "--num-requests", "200", "--json",
                     timeout=120)
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        assert doc["completed"] == 200 and doc["failed"] == 0
    finally:
        dep.stop()


def test_batching_denoiser_end_to_end(tmp_path):
    """A batching denoiser between real processes: requests share forwards, utilization stays a share."""
    dep = Launched(["--model", "sim:flux-h200", "--no-dashboard", "-d", "1", "--max-batch", "4"], tmp_path)
    try:
        status = dep.wait_ready(3)
        [den] = [i for i in status.instances if i.role == "denoiser"]
        assert den.max_batch == 4 and den.capacity == 4
        res = disagg("bench", "--endpoint", dep.endpoint, "--concurrency", "8", "--num-requests", "24", "--width", "256",
                     "--height", "256", "--steps", "2", "--json", timeout=120)
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        assert doc["completed"] == 24 and doc["failed"] == 0
        [util] = [i["utilization"] for i in doc["instances"] if i["role"] == "denoiser"]
        # busy time counts each request's share of a batched step, so a busy denoiser stays at most 100 %
        assert 0.3 < util <= 1.0
        # 2 steps of 65 ms one by one would allow at most 7.7 req/s; batches of 4 take 107 ms a step
        assert doc["throughput_rps"] > 1 / 0.130
        # the denoiser reports its batch sizes (heartbeats, once a second): 27 requests (3 of warm-up) x 2 steps
        from disagg.client import Client

        deadline = time.monotonic() + 5
        while True:
            with Client(dep.endpoint) as client:
                [den] = [i for i in client.status().instances if i.role == "denoiser"]
            if sum(size * n for size, n in den.batch_steps.items()) >= 54 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert max(den.batch_steps) > 1 and sum(size * n for size, n in den.batch_steps.items()) == 54, den.batch_steps
    finally:
        dep.stop()


def test_threads_of_one_instance_take_turns_on_its_simulated_device(sim_run):
    a = SimAdapter("flux-h200", "encoder", "sim:0")
    import threading

    threads = [threading.Thread(target=a.encode, args=(dict(width=64, height=64, num_images_per_prompt=1),)) for _ in range(4)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - t0 >= 4 * 0.024
