"""The production-day chaos benchmark's short version (benchmarks/chaos_day.py --short --part sim), and the sim
model's request-specific payloads it checks images with.

The benchmark runs as a user runs it (a subprocess, its own deployments on ports 29600-29699): a sim deployment
with everything on (7 simulated devices, --rebalance auto, adapters with a host tier, batching, schedule slo,
previews over ZeroMQ and HTTP streams, repeated prompts), the request list first without kills, then again while
the orchestrator (during a rebalance move), an encoder, a denoiser, a decoder and the gateway are SIGKILLed in
turn. Every request must be answered once with the image of the run without kills, and after the orchestrator's
restart the split must converge: no move left hanging, every device serving, the reported split true."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from disagg.transport.wire.messages import GenerationParams
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def run_stages(params: dict, batched: bool = False):
    """One request through a sim encoder, denoiser and decoder in this process: (image, previews' latents)."""
    from disagg.roles.pipelines.sim import SimAdapter, first_value
    from disagg.roles.stage import Stage

    gp = msgspec.convert(params, GenerationParams)
    stages = {r: Stage(r, SimAdapter("zero", r), model="sim:zero", max_batch=4 if batched and r == "denoiser" else 1)
              for r in ("encoder", "denoiser", "decoder")}
    seen = []
    encoded = stages["encoder"].run(gp, {}).tensors
    latents = stages["denoiser"].run(gp, encoded, progress=lambda *a: seen.append(first_value(a[0]) if a else None))
    return stages["decoder"].run(gp, latents.tensors).images[0], seen, first_value(encoded)


def test_sim_payloads_tell_requests_apart_and_match_the_model_function():
    from disagg.roles.pipelines.sim import expected_pixels, image_checksum

    base = {"prompt": "a fox", "width": 512, "height": 512, "num_inference_steps": 4, "seed": 7, "previews": 2}
    image, steps, encoded = run_stages(base)
    assert image_checksum(image) == expected_pixels(base).hex()
    # the same request batched or not: the same image; a preview's latents are not the final ones
    batched, steps_b, _ = run_stages(base, batched=True)
    assert batched == image and len(set(steps)) == 4 and steps == steps_b
    # what the conditioning cache keys on decides the encoder's value: a repeat holds what a compute would
    assert run_stages({**base, "seed": 8})[2] == encoded
    assert run_stages({**base, "width": 256})[2] != encoded
    others = [{**base, "seed": 8}, {**base, "prompt": "a cat"}, {**base, "loras": [{"name": "ink", "scale": 0.5}]},
              {**base, "num_inference_steps": 5}, {**base, "height": 256}]
    checksums = {image_checksum(run_stages(p)[0]) for p in others} | {image_checksum(image)}
    assert len(checksums) == len(others) + 1
    for step in (1, 2, 3):  # a preview decoded after step k: the model function at k steps, not the final image
        assert expected_pixels(base, steps_done=step) != expected_pixels(base)


def test_a_short_production_day_on_sim_loses_nothing_and_converges(tmp_path):
    out = tmp_path / "day.json"
    proc = subprocess.run([sys.executable, "benchmarks/chaos_day.py", "--short", "--part", "sim", "--work",
                           str(tmp_path / "work"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    [report] = json.loads(out.read_text())["runs"]
    summary = f"{proc.stdout[-4000:]}\nlogs: {tmp_path / 'work'}"
    # the kills the plan asks: the orchestrator (during a move), then an encoder, a denoiser, a decoder, the gateway
    assert report["plan_done"], summary
    assert report["kills_per_role"] == {"orchestrator": 1, "encoder": 1, "denoiser": 1, "decoder": 1, "gateway": 1}
    assert report["requests"] >= 30 and "reference" not in report, summary  # the model's function stands for it
    assert (report["lost"], report["duplicated"], report["wrong_images"], report["wrong_vs_model"]) == (0, 0, 0, 0), \
        summary
    assert report["answered_once"] == report["requests"]
    previews = report["previews"]
    assert previews["asked"] > 0 and previews["delivered"] > 0 and previews["wrong"] == 0, summary
    assert report["converged_all"], summary
    assert report["chaos"]["stopped_clean"]
    assert proc.returncode == 0, summary
