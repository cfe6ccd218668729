"""Continuous batching in the denoiser (disagg/roles/batcher.py), driven with the simulated model."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from disagg.roles.batcher import StepBatcher
from disagg.roles.pipelines.sim import SimAdapter
from disagg.roles.pipelines.sim_profile import load_profile
from disagg.roles.stage import Stage
from disagg.settings.choices import Schedule
from disagg.transport.wire.messages import GenerationParams
from tests.conftest import wait_until


class Recorder(SimAdapter):
    """The sim adapter, recording which requests shared each step."""

    def __init__(self, fail_seed: int | None = None):
        super().__init__("flux-h200", "denoiser")
        self.steps: list[list[int]] = []
        self.fail_seed = fail_seed
        self.hold = None

    def denoise_steps(self, states):
        if self.steps and self.hold is not None:  # before the second step: until the test's requests wait
            self.hold()
            self.hold = None
        self.steps.append(sorted(s.params["seed"] for s in states))
        if any(s.params["seed"] == self.fail_seed for s in states):
            raise RuntimeError("forward failed")
        super().denoise_steps(states)


def params(seed, size=256, steps=4):
    return dict(width=size, height=size, num_inference_steps=steps, num_images_per_prompt=1, seed=seed)


def test_requests_join_the_running_batch_at_step_boundaries():
    adapter = Recorder()
    batcher = StepBatcher(adapter, max_batch=3)
    # request 0 is mid-loop (its first step done) when 1, 2 and 3 arrive: its second step waits for them
    arrived = threading.Event()
    adapter.hold = lambda: arrived.wait(10)
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(batcher.denoise, {}, params(0, steps=6))
        wait_until(lambda: adapter.steps, timeout=10, step=0.005)  # its first step began
        later = [pool.submit(batcher.denoise, {}, params(s, steps=2)) for s in (1, 2)]
        queued = pool.submit(batcher.denoise, {}, params(3, steps=1))  # batch full: waits for room
        wait_until(lambda: len(batcher._waiting) == 3, timeout=10, step=0.005)
        arrived.set()
        results = [f.result(timeout=10) for f in (first, *later, queued)]
    assert adapter.steps[0] == [0]
    joined = adapter.steps.index([0, 1, 2])
    assert joined == 1 and adapter.steps[joined + 1] == [0, 1, 2]
    assert [0, 3] in adapter.steps[joined + 2:]  # 3 joined once 1 and 2 were done
    assert sum(len(s) for s in adapter.steps) == 6 + 2 + 2 + 1
    assert all(out["x"].numel() > 0 and share > 0 and counted == {} for out, share, counted in results)
    # a request's device share: each step's time split among the batch, so shares sum to the busy time
    assert results[0][1] < 6 * 0.065 * 1.1


def test_other_shapes_wait_for_the_batch_to_drain_and_are_not_starved():
    adapter = Recorder()
    batcher = StepBatcher(adapter, max_batch=4, schedule=Schedule.FIFO)  # fifo's order (the schema's default is slo)
    with ThreadPoolExecutor(8) as pool:
        a = pool.submit(batcher.denoise, {}, params(0, 256, steps=3))
        time.sleep(0.02)
        b = pool.submit(batcher.denoise, {}, params(1, 512, steps=1))  # other shape
        time.sleep(0.02)
        c = pool.submit(batcher.denoise, {}, params(2, 256, steps=1))  # same shape as 0, but after 1
        for f in (a, b, c):
            f.result(timeout=10)
    assert all(1 not in s or s == [1] for s in adapter.steps)  # never mixed with another shape
    assert adapter.steps.index([1]) < adapter.steps.index([2])  # first come, first served


def test_a_failed_forward_fails_its_batch_and_the_batcher_keeps_serving():
    adapter = Recorder(fail_seed=7)
    batcher = StepBatcher(adapter, max_batch=4)
    with ThreadPoolExecutor(4) as pool:
        bad = pool.submit(batcher.denoise, {}, params(7, steps=2))
        with pytest.raises(RuntimeError, match="forward failed"):
            bad.result(timeout=10)
        good = pool.submit(batcher.denoise, {}, params(8, steps=2))
        assert good.result(timeout=10)[0]["x"].numel() > 0


def test_batched_throughput_follows_the_profile_curve():
    """8 same-shape requests at 256^2 through one simulated denoiser: 2.5x the unbatched rate."""
    curve = load_profile("flux-h200").denoiser
    assert curve.batch_factor(256 * 256, 8) == pytest.approx(3.154)
    assert curve.batch_factor(256 * 256, 2) == pytest.approx(1 + 0.646 / 3)  # linear between measured sizes
    stage = Stage("denoiser", SimAdapter("flux-h200", "denoiser"), max_batch=8)
    gp = GenerationParams(prompt="x", width=256, height=256, num_inference_steps=2)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=stage.run, args=(gp, {})) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    unbatched = 8 * 2 * 0.065
    assert took < unbatched / 2, f"8 requests took {took:.3f} s batched vs {unbatched:.3f} s one by one"
    assert max(stage.batcher.batch_sizes) == 8  # the largest batch size that ran


def test_a_model_without_step_batching_refuses_max_batch():
    from disagg.roles.pipelines.payload import PayloadAdapter

    with pytest.raises(ValueError, match="cannot batch denoising steps"):
        Stage("denoiser", PayloadAdapter("denoiser"), max_batch=4)


def test_busy_meter_splits_overlapping_work_so_shares_sum_to_busy_time():
    from disagg.roles.meter import BusyMeter

    now = [0.0]  # an injected clock: the shares do not depend on how the machine schedules this test
    meter = BusyMeter(clock=lambda: now[0])
    a = meter.enter()
    now[0] += 0.05
    b = meter.enter()  # 0.05 s alone, then 0.05 s together
    now[0] += 0.05
    share_a = meter.leave(a)
    now[0] += 0.05  # b alone again
    share_b = meter.leave(b)
    assert share_a == pytest.approx(0.075) and share_b == pytest.approx(0.075)
    assert share_a + share_b == pytest.approx(0.15)


def test_flux_requests_sharing_forwards_match_the_pipeline_one_by_one():
    """Tiny Flux: three requests (other prompts, seeds, step counts, 2 images for one) in one batch,
    joining and leaving at different steps, against each run alone through FluxPipeline."""
    import numpy as np

    from disagg.roles.pipelines.tiny import TinyFluxAdapter

    enc, den, dec = (TinyFluxAdapter(r) for r in ("encoder", "denoiser", "decoder"))
    reqs = [
        {**TinyFluxAdapter.defaults(), "prompt": "a red cat", "seed": 1, "num_inference_steps": 4, "width": 64, "height": 48},
        {**TinyFluxAdapter.defaults(), "prompt": "a dog in the sky", "seed": 2, "num_inference_steps": 3, "width": 64,
         "height": 48, "num_images_per_prompt": 2},
        {**TinyFluxAdapter.defaults(), "prompt": "a blue house", "seed": 3, "num_inference_steps": 5, "width": 64, "height": 48},
    ]
    alone = [[np.asarray(im, dtype=int) for im in dec.decode(den.denoise(enc.encode(p), p), p)] for p in reqs]
    states = [den.denoise_start(enc.encode(p), p) for p in reqs]
    active, sizes = [states[0]], []
    for step in range(8):
        if step == 1:
            active += states[1:]  # the other two join at a step boundary
        active = [s for s in active if not s.done]
        if not active:
            break
        sizes.append(len(active))
        den.denoise_steps(active)
    assert 3 in sizes and all(s.done for s in states)
    for p, state, want in zip(reqs, states, alone):
        got = [np.asarray(im, dtype=int) for im in dec.decode(den.denoise_result(state), p)]
        assert len(got) == len(want)
        assert max(int(np.abs(g - w).max()) for g, w in zip(got, want)) <= 1
