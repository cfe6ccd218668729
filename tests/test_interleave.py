"""`schedule: slo` on real pipelines: a denoiser holding a long request and a short one steps the short one
ahead at a step boundary, and each image equals its solo run exactly (0/255). Tiny Flux and tiny Wan on the
shared checkpoint deployments (capacity 4, the default schedule), and tiny Flux with continuous batching."""

from __future__ import annotations

import pytest

from disagg.client import Client
from disagg.transport.wire.messages import GenerationParams
from tests.conftest import Launched

pytestmark = pytest.mark.e2e

#: steps of the long request: long enough that the short one arrives while it denoises
LONG_STEPS = {"flux": 200, "wan21": 150, "tiny": 200}


def pair(kind: str) -> tuple[GenerationParams, GenerationParams]:
    video = {"num_frames": 5} if kind.startswith("wan") else {}
    long = GenerationParams(prompt="a long request", width=32, height=32, num_inference_steps=LONG_STEPS[kind],
                            seed=11, **video)
    # another size: under batching the two never share a forward, so the short one must preempt the long one
    short = GenerationParams(prompt="a short one", width=48, height=32, num_inference_steps=2, seed=12, priority=1,
                             **video)
    return long, short


def interleaved(endpoint: str, kind: str) -> None:
    long, short = pair(kind)
    with Client(endpoint) as client:
        solo = client.run_all([long, short], concurrency=1, timeout_s=300)
        assert all(o.ok for o in solo), [o.error for o in solo]
        alone_s = solo[0].latency_s
        # the short request arrives while the long one denoises (after about a third of its time alone)
        delay = alone_s / 3
        both = client.run_all([long, short], concurrency=2, timeout_s=300, arrivals=[0.0, delay])
    assert all(o.ok for o in both), [o.error for o in both]
    long_end, short_end = both[0].latency_s, delay + both[1].latency_s
    assert short_end < long_end, (f"{kind}: the short request ended at {short_end:.2f} s, after the long one "
                                  f"({long_end:.2f} s): it did not step ahead of it")
    assert both[0].images == solo[0].images, f"{kind}: the long request's output differs from its solo run"
    assert both[1].images == solo[1].images, f"{kind}: the short request's output differs from its solo run"
    print(f"{kind}: long alone {alone_s:.2f} s, together {long_end:.2f} s; short ended at {short_end:.2f} s "
          f"(alone {solo[1].latency_s:.2f} s); both equal their solo runs")


@pytest.mark.parametrize("checkpoint", ["flux", "wan21"], indirect=True)
def test_a_short_request_steps_ahead_of_a_long_one_and_both_equal_their_solo_runs(checkpoint):
    assert checkpoint.status().schedule == "slo"
    interleaved(checkpoint.endpoint, checkpoint.kind)


def test_with_batching_the_batch_is_formed_again_each_step_and_outputs_stay_exact(tmp_path):
    dep = Launched(["--model", "tiny", "-e", "1", "-d", "1", "-k", "1", "--capacity", "4,4,4", "--max-batch", "2",
                    "--schedule", "slo", "--no-dashboard", "--spares", "0"], tmp_path)
    try:
        dep.wait_ready(3)
        interleaved(dep.endpoint, "tiny")
    finally:
        dep.stop()
