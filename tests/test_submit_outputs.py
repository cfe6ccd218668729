"""The defects a new user found (issue 11), each against real processes where it needs them:
capacity > 1 on a real pipeline, writes that fail, the manifest, limits at Submit, bench's exit code,
Ctrl-C on submit, and a plain stop with work in flight."""

from __future__ import annotations

import hashlib
import io
import json
import signal
import subprocess
import time

import numpy as np
import pytest
from PIL import Image

from disagg.client import Client
from disagg.transport.wire.messages import GenerationParams
from tests.conftest import ROOT, Launched, Load, disagg, free_port_pair, popen_cli, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny4(module_tmp):
    """The tiny Flux, 1:1:1, every role with capacity 4."""
    (module_tmp / "tiny4").mkdir(exist_ok=True)
    dep = Launched(["-e", "1", "-d", "1", "-k", "1", "--capacity", "4,4,4", "--no-dashboard"], module_tmp / "tiny4")
    try:
        dep.wait_ready(3)
        yield dep
    finally:
        dep.stop()


@pytest.fixture(scope="module")
def sim(module_tmp):
    (module_tmp / "sim").mkdir(exist_ok=True)
    dep = Launched(["--model", "sim:flux-h200", "-d", "1", "--no-dashboard"], module_tmp / "sim")
    try:
        dep.wait_ready(3)
        yield dep
    finally:
        dep.stop()


# --- capacity > 1 on a real pipeline --------------------------------------------------------


def test_capacity_4_with_8_in_flight_gives_each_request_its_own_image(tiny4):
    """Before: one scheduler shared by 4 threads, `IndexError: index 9 is out of bounds` for 12 of 16 (8 requests
    in flight on 4 slots: each slot's thread takes a second one while the others step)."""
    import torch

    from disagg.roles.pipelines.tiny import build_tiny_flux_pipeline

    params = [GenerationParams(prompt=f"a photo of a {w} {k}", width=64, height=64, num_inference_steps=8, seed=k)
              for k, w in enumerate(["cat", "dog", "tree", "house", "car", "bird", "flower", "city"])]
    with Client(tiny4.endpoint) as client:
        outcomes = client.run_all(params, concurrency=8, timeout_s=300)
    assert [o.error for o in outcomes if not o.ok] == []
    pipe = build_tiny_flux_pipeline()
    worst = 0
    for p, outcome in zip(params, outcomes):
        want = pipe(p.prompt, width=64, height=64, num_inference_steps=8, guidance_scale=3.5,
                    generator=torch.Generator("cpu").manual_seed(p.seed)).images[0]
        got = np.asarray(Image.open(io.BytesIO(outcome.images[0])).convert("RGB"), dtype=np.int16)
        worst = max(worst, int(np.abs(got - np.asarray(want, dtype=np.int16)).max()))
    print(f"capacity 4, 8 in flight: 8 images, max pixel difference {worst}/255")
    assert worst <= 1
    with Client(tiny4.endpoint) as client:  # they really ran side by side: 4 slots taken at once
        assert all(i.capacity == 4 for i in client.status().instances)


# --- outputs: manifest, PNG text, failed writes ---------------------------------------------


def test_submit_writes_a_manifest_and_pngs_carry_their_parameters(tiny4, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a red fox", "seed": 5, "width": 64, "height": 48}\n\n'
                       '{"prompt": "a blue sky [wide]", "num_inference_steps": 3, "num_images_per_prompt": 2}\n')
    out = tmp_path / "out"
    res = disagg("submit", str(prompts), "--endpoint", tiny4.endpoint, "--out", str(out), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [r["index"] for r in sorted(lines, key=lambda r: r["index"])] == [0, 1]
    first = next(r for r in lines if r["index"] == 0)
    second = next(r for r in lines if r["index"] == 1)
    assert (first["prompt"], first["seed"], first["size"], first["steps"], first["model"]) == ("a red fox", 5, "64x48", 4, "tiny")
    assert second["size"] == "128x128" and second["steps"] == 3 and len(second["files"]) == 2
    assert first["timings"]["total"] > 0 and first["request_id"] in first["files"][0]
    im = Image.open(first["files"][0])
    assert im.text["prompt"] == "a red fox" and im.text["seed"] == "5" and im.text["model"] == "tiny"
    assert im.text["num_inference_steps"] == "4" and im.text["guidance_scale"] == "3.5"
    assert "Steps: 4" in im.text["parameters"] and "Seed: 5" in im.text["parameters"]
    assert "a blue sky [wide]" in Image.open(second["files"][0]).text["prompt"]


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.fail("cannot mount a 300 KiB tmpfs (the test runs as root, as CI does)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_a_full_disk_fails_only_the_requests_it_hits(tiny4, tmp_path, small_disk):
    """Before: a traceback at the 8th PNG, a truncated file, and 32 prompts never run."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"noise {k}", "seed": k, "width": 192, "height": 192,
                                             "num_inference_steps": 1}) for k in range(12)))
    res = disagg("submit", str(prompts), "--endpoint", tiny4.endpoint, "--out", str(small_disk), "--concurrency", "4",
                 "--json", timeout=240)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    doc = json.loads(res.stdout)
    assert doc["completed"] + doc["failed"] == 12 and doc["completed"] >= 1 and doc["failed"] >= 1
    failed = [r for r in doc["results"] if not r["ok"]]
    assert all("No space left on device" in r["error"] for r in failed), failed
    written = sorted(p.name for p in small_disk.glob("*.png"))
    assert len(written) == doc["completed"]
    for p in small_disk.glob("*.png"):  # every file there is whole
        Image.open(p).load()
    assert not list(small_disk.glob(".*part"))


def test_an_unwritable_out_is_refused_before_anything_starts(tmp_path):
    t0 = time.monotonic()
    res = disagg("launch", "--submit", str(ROOT / "examples" / "prompts.json"), "--out", "/proc/nope",
                 "--run-dir", str(tmp_path / "run"), timeout=30)
    assert res.returncode == 2 and "--out" in res.stderr and "/proc" in res.stderr, res.stderr
    assert time.monotonic() - t0 < 10 and not (tmp_path / "run").exists()
    res = disagg("submit", str(ROOT / "examples" / "prompts.json"), "--out", "/proc/nope",
                 "--endpoint", f"tcp://127.0.0.1:{free_port_pair()}", timeout=30)
    assert res.returncode == 2 and "--out" in res.stderr


def test_submit_to_nothing_creates_no_output_folder(tmp_path):
    res = disagg("submit", str(ROOT / "examples" / "prompts.json"), "--out", str(tmp_path / "outputs"),
                 "--endpoint", f"tcp://127.0.0.1:{free_port_pair()}", timeout=30)
    assert res.returncode == 3 and "Connection refused" in res.stderr
    assert not (tmp_path / "outputs").exists()


# --- limits at Submit, bench's exit code ------------------------------------------------------


def test_a_size_over_the_models_maximum_is_refused_at_submit(sim):
    with Client(sim.endpoint) as client:
        [o] = client.run_all([GenerationParams(prompt="huge", width=8192, height=8192)])
    assert not o.ok and "width 8192 is over this deployment's maximum of 2048" in o.error
    assert o.latency_s < 1.0  # refused at once, not after computing


def test_images_that_cannot_fit_the_pools_fail_before_any_compute(sim):
    with Client(sim.endpoint) as client:
        [o] = client.run_all([GenerationParams(prompt="many", width=2048, height=2048, num_images_per_prompt=16)])
    assert not o.ok and "pool" in o.error and "MiB" in o.error and "pool_mib" in o.error, o.error
    # the denoiser would take 16 x 4 steps x ~0.5 s: it failed at the encoder, before that
    assert o.latency_s < 2.0 and "compute_denoiser" not in o.timings


def test_bench_exits_1_and_names_each_failure_with_its_count(sim):
    res = disagg("bench", "--endpoint", sim.endpoint, "--width", "4096", "--height", "64", "--num-requests", "4",
                 "--warmup", "0", timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "failures" in res.stdout and "width 4096 is over" in res.stdout and " 4 " in res.stdout, res.stdout
    res = disagg("bench", "--endpoint", sim.endpoint, "--width", "4096", "--height", "64", "--num-requests", "3",
                 "--warmup", "0", "--json", timeout=60)
    assert res.returncode == 1
    [failure] = json.loads(res.stdout)["failures"]
    assert failure["count"] == 3 and "width 4096" in failure["reason"]
    res = disagg("bench", "--endpoint", sim.endpoint, "--width", "64", "--height", "64", "--steps", "1",
                 "--num-requests", "3", "--warmup", "0", timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_ctrl_c_on_submit_exits_130_with_a_summary(sim, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"slow {k}", "width": 1024, "height": 1024,
                                             "num_inference_steps": 8}) for k in range(8)))
    proc = popen_cli("submit", str(prompts), "--endpoint", sim.endpoint, "--out", str(tmp_path / "out"),
                     "--concurrency", "2", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # interrupted once the first image is written: the rest are running or not yet sent
    wait_until(lambda: any((tmp_path / "out").glob("*.png")), timeout=60, step=0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, out + err
    assert "Aborted" not in err and "Traceback" not in err
    assert "/8 requests succeeded" in out and "not run: interrupted" in out, out


@pytest.mark.ends_deployment
def test_a_plain_stop_ends_every_pending_request_at_once(sim):
    """Before: clients waited ~15 s for "stopped answering; request lost", even for unsent requests."""
    params = [GenerationParams(prompt=f"long {k}", width=1024, height=1024, num_inference_steps=20) for k in range(8)]
    load = Load(sim.endpoint, params, concurrency=4, timeout_s=120)
    time.sleep(1.5)
    res = disagg("stop", "--endpoint", sim.endpoint, timeout=30)
    t_stop = time.monotonic()
    assert res.returncode == 0 and "stopped" in res.stdout, res.stdout + res.stderr
    outcomes = load.join(timeout=30)
    assert time.monotonic() - t_stop < 2.0
    assert len(outcomes) == 8 and not any(o.ok for o in outcomes)
    assert sum("the deployment is stopping" in o.error for o in outcomes) >= 4, [o.error for o in outcomes]
    assert all("stopping" in o.error for o in outcomes), [o.error for o in outcomes]
    assert not any("request lost" in o.error for o in outcomes)


# --- keys --------------------------------------------------------------------------------------


def test_keys_generate_never_overwrites_without_force(tmp_path):
    keys = tmp_path / "keys"
    assert disagg("keys", "generate", str(keys)).returncode == 0

    def digest():
        return {str(p.relative_to(keys)): hashlib.md5(p.read_bytes()).hexdigest() for p in keys.rglob("*") if p.is_file()}

    before = digest()
    res = disagg("keys", "generate", str(keys))
    assert res.returncode == 2 and "--force" in res.stderr and digest() == before
    assert disagg("keys", "generate", str(keys), "--force").returncode == 0
    assert digest().keys() == before.keys() and digest() != before
