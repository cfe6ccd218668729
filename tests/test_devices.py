"""Devices with memory and speed (issue 46, its first part): the device classes and `--devices` for simulated
devices; each instance's device memory in its heartbeat, `status`, the live table and /metrics; a sim profile's
weights and activations, a compute that would not fit failing as out of memory, the batcher holding a batch back
from what would not fit, and a launch whose placement cannot fit refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from disagg.roles.batcher import StepBatcher
from disagg.roles.pipelines.sim import SimAdapter
from disagg.roles.pipelines.sim_profile import load_profile
from disagg.settings.devices import CLASSES, DeviceError, parse_devices
from tests.conftest import ROOT, disagg, launch_with_http, wait_http, wait_until

GB = 10**9


def test_device_classes_are_the_issues_and_a_devices_list_reads_in_order():
    assert {n: (c.memory_bytes // GB, c.speed) for n, c in CLASSES.items()} == {
        "H200": (141, 1.0), "H100": (80, 0.9), "L40S": (48, 0.37), "L4": (24, 0.12)}
    got = parse_devices("2xH200,1xl40s")
    assert [d.name for d in got] == ["H200", "H200", "L40S"]
    with pytest.raises(DeviceError, match="no device class 'A100'; known: H200, H100, L40S, L4"):
        parse_devices("8xA100")
    with pytest.raises(DeviceError, match="expected COUNTxCLASS"):
        parse_devices("H200x8")


def test_profiles_give_each_components_weights_from_its_parameters():
    flux, qwen = load_profile("flux-h200"), load_profile("qwen-image-h200")
    # FLUX.1: T5-XXL + CLIP-L, the 11.9B transformer, the VAE; Qwen-Image: Qwen2.5-VL 7B, the 20.4B MMDiT
    assert [round(flux.weights(r) / GB, 1) for r in ("encoder", "denoiser", "decoder")] == [9.8, 23.8, 0.2]
    assert [round(qwen.weights(r) / GB, 1) for r in ("encoder", "denoiser", "decoder")] == [16.6, 40.9, 0.2]
    assert qwen.weights("monolith") > CLASSES["L40S"].memory_bytes > qwen.weights("denoiser")
    # activations grow with the batch and the latent tokens
    px = flux.reference_pixels
    assert flux.activations("denoiser", px, 4) == 4 * flux.activations("denoiser", px, 1)
    assert flux.activations("denoiser", 4 * px) > flux.activations("denoiser", px)


def test_a_compute_that_does_not_fit_its_device_fails_as_out_of_memory():
    p = dict(width=1024, height=1024, num_inference_steps=1, num_images_per_prompt=1, seed=0)
    # FLUX.1's transformer fits an L4 (23.8 of 24 GB), but not with a 1024^2 request's activations
    denoiser = SimAdapter("flux-h200", "denoiser", device_memory=CLASSES["L4"].memory_bytes, device_class="L4")
    with pytest.raises(torch.OutOfMemoryError, match=r"denoiser of 1 x 1024x1024 needs 24\.1 GB .* 24 GB of its "
                                                      r"device \(L4\)"):
        denoiser.denoise({"x": torch.zeros(4)}, p)
    small = dict(p, width=256, height=256)
    denoiser.denoise({"x": torch.zeros(4)}, small)  # a small one fits
    # Qwen-Image's MMDiT does not fit an L4 at all: the instance cannot boot, and says why
    with pytest.raises(torch.OutOfMemoryError, match=r"denoiser weights of sim:qwen-image-h200 take 40\.9 GB"):
        SimAdapter("qwen-image-h200", "denoiser", device_memory=CLASSES["L4"].memory_bytes, device_class="L4")


def test_the_batcher_never_forms_a_batch_that_would_not_fit():
    profile = load_profile("flux-h200")
    p = dict(width=1024, height=1024, num_inference_steps=2, num_images_per_prompt=1)
    per = profile.activations("denoiser", profile.reference_pixels)
    # room for two requests' activations beside the weights, not three
    adapter = SimAdapter("flux-h200", "denoiser", device_memory=profile.weights("denoiser") + int(2.5 * per))
    assert adapter.batch_limit(p) == 2
    hold, entered = threading.Event(), threading.Event()
    real = adapter.denoise_steps
    adapter.denoise_steps = lambda states: (entered.set(), hold.wait(60), real(states))[2]
    batcher = StepBatcher(adapter, max_batch=8, memory_limit=adapter.batch_limit)  # as Stage gives it

    class HandedOver(list):  # the batcher's hand-over list, counting what was handed over
        count = 0

        def append(self, item):
            HandedOver.count += 1
            super().append(item)

    batcher._waiting = HandedOver()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(batcher.denoise, {"x": torch.zeros(4)}, dict(p, seed=s)) for s in range(6)]
        # the first batch formed (blocked in its first step) and every request handed over: the next batches form
        # from all six
        wait_until(lambda: entered.is_set() and HandedOver.count == 6, timeout=30, step=0.005,
                   why=lambda: (HandedOver.count, entered.is_set(), dict(batcher.batch_sizes),
                                [repr(f.exception()) for f in futures if f.done()]))
        hold.set()
        for f in futures:
            f.result(timeout=30)  # none ran out of memory
    assert max(batcher.batch_sizes) == 2, batcher.batch_sizes


@pytest.mark.parametrize("args, why", [
    (["--model", "sim:qwen-image-h200", "--devices", "2xL40S", "-e", "1", "-d", "1", "-k", "1", "--gpus", "0"],
     "device 0 (L40S, 48 GB) cannot hold encoder-0, denoiser-0, decoder-0: their weights (57.8 GB)"),
    (["--model", "sim:qwen-image-h200", "--devices", "1xH200,1xL4", "-e", "1", "-d", "1", "-k", "1", "--gpus", "0,1"],
     "device 1 (L4, 24 GB) cannot hold denoiser-0"),
    (["--model", "sim:flux-h200", "--devices", "2xH200", "--gpus", "0,1,2"], "GPU 2 is not among the 2 devices"),
    (["--model", "demo", "--devices", "2xH200"], "sim: models only"),
])
def test_a_launch_whose_placement_cannot_fit_is_refused_before_anything_starts(args, why):
    res = disagg("launch", *args, "--no-dashboard", timeout=60)
    assert res.returncode == 2 and why in res.stderr, res.stderr
    assert "ready" not in res.stdout


def test_status_the_live_table_and_metrics_show_each_instances_device_memory(tmp_path):
    launched = launch_with_http(["--model", "sim:flux-h200", "--devices", "1xH200,1xL40S", "--gpus", "0,1",
                                 "-e", "1", "-d", "1", "-k", "1", "--no-dashboard", "--spares", "0"], tmp_path)
    for dep in launched.serve(3):
        wait_http(dep.http + "/health")
        mem = wait_until(lambda: {i.id: i.memory for i in dep.status().instances
                                  if i.memory.total_bytes} if len(dep.status().instances) == 3 else None, timeout=30)
        # --gpus 0,1 round-robin: encoder-0 on device 0, denoiser-0 on device 1, decoder-0 on device 0
        assert (mem["denoiser-0"].device, mem["denoiser-0"].total_bytes) == ("L40S", 48 * GB)
        assert (mem["encoder-0"].device, mem["decoder-0"].device) == ("H200", "H200")
        assert mem["denoiser-0"].weights_bytes == load_profile("flux-h200").weights("denoiser")
        assert mem["denoiser-0"].free_bytes == 48 * GB - mem["denoiser-0"].weights_bytes
        shown = disagg("status", "--endpoint", dep.endpoint, timeout=30).stdout
        assert "23.8/48 (free 24.2)" in shown, shown
        metrics = httpx.get(dep.http + "/metrics", timeout=10).text
        assert ('disagg_device_memory_bytes{device="L40S",instance="denoiser-0",kind="total",role="denoiser"} 4.8e+10'
                in metrics), [line for line in metrics.splitlines() if "device_memory" in line][:8]


def test_memory_is_checked_across_every_process_on_a_simulated_device(monkeypatch):
    """Two processes on one simulated L40S: an encoder's weights (9.8 GB) do not fit beside another process's
    Qwen-Image denoiser (40.9 GB of 48), and once that process is gone they do."""
    run = f"devtest{os.getpid()}"
    monkeypatch.setenv("DISAGG_RUN_ID", run)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from disagg.roles.pipelines.sim import SimAdapter; "
         "SimAdapter('qwen-image-h200', 'denoiser', device='sim:3', device_memory=48 * 10**9, device_class='L40S'); "
         "print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(torch.OutOfMemoryError, match=r"encoder weights of sim:flux-h200 take 9\.8 GB beside the "
                                                          r"40\.9 GB of the others on it, more than the 48 GB of its "
                                                          r"device \(L40S\)"):
            SimAdapter("flux-h200", "encoder", device="sim:3", device_memory=48 * GB, device_class="L40S")
        holder.communicate("", timeout=30)
        encoder = SimAdapter("flux-h200", "encoder", device="sim:3", device_memory=48 * GB, device_class="L40S")
        assert encoder.others_bytes == 0  # the holder's entry went with its process
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(timeout=30)
        Path(f"/dev/shm/disagg-{run}-simdev3").unlink(missing_ok=True)


def test_a_replica_that_cannot_hold_every_component_streams_the_rest_for_every_request(monkeypatch):
    """Qwen-Image colocated on an L40S: the 40.9 GB MMDiT and the VAE stay, the 16.6 GB text encoder is copied in
    for every request at the class's host-to-device bandwidth (its copy, not its compute: no speed scaling)."""
    import disagg.roles.pipelines.sim as sim

    l40s = CLASSES["L40S"]
    replica = SimAdapter("qwen-image-h200", "monolith", device_memory=l40s.memory_bytes, device_class="L40S",
                         slowdown=1 / l40s.speed)
    qwen = load_profile("qwen-image-h200")
    assert replica.streamed == {"encoder": qwen.weights("encoder")}
    assert replica.weights_bytes() == qwen.weights("denoiser") + qwen.weights("decoder")
    slept = []
    monkeypatch.setattr(sim.time, "sleep", slept.append)
    replica.encode(dict(width=1328, height=1328, num_inference_steps=1, num_images_per_prompt=1, seed=0,
                        prompt="p"))
    copy_s = qwen.weights("encoder") / l40s.host_to_device
    assert slept[0] == pytest.approx(copy_s)  # the copy first, then the encode at the class's speed
    assert slept[1] == pytest.approx(qwen.encoder.fixed_ms(1328 * 1328) / 1000 / l40s.speed)
    # on an H200 everything fits: nothing is streamed
    assert SimAdapter("qwen-image-h200", "monolith", device_memory=CLASSES["H200"].memory_bytes).streamed == {}
