"""Deadlines and priorities end to end, on real processes: `admission: slo` refuses an impossible deadline
(ZeroMQ client, `disagg submit`, HTTP 429 with Retry-After, the official openai client), the fields reach the
manifest, and status, RequestStates and /metrics show deadlines. A sim model: the stage times are its profile's."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from disagg.client import Client
from disagg.transport.wire.messages import ErrorCode, GenerationParams
from tests.conftest import disagg, launch_with_http, wait_http

pytestmark = pytest.mark.e2e

#: 256^2 x 2 steps on sim:flux-h200: 24 + 2 x 65 + 5 ms alone
SHAPE = {"width": 256, "height": 256, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def dep(module_tmp):
    for d in launch_with_http(["--model", "sim:flux-h200", "-e", "1", "-d", "1", "-k", "1", "--admission", "slo",
                               "--no-dashboard", "--spares", "0"], module_tmp).serve(3):
        wait_http(d.http + "/health")
        yield d


def test_before_any_measurement_nothing_is_refused_then_an_impossible_deadline_is(dep):
    with Client(dep.endpoint) as client:
        [first] = client.run_all([GenerationParams(prompt="first", slo_ms=1, **SHAPE)])
        assert first.ok, first.error  # nothing measured yet: taken (and late)
        client.run_all([GenerationParams(prompt="more", seed=k, **SHAPE) for k in range(3)], concurrency=1)
        [refused] = client.run_all([GenerationParams(prompt="too soon", slo_ms=20, **SHAPE)])
        assert not refused.ok and refused.code == ErrorCode.DEADLINE and refused.param == "slo_ms"
        assert "slo_ms 20" in refused.error and "denoiser" in refused.error, refused.error
        [fine] = client.run_all([GenerationParams(prompt="in time", slo_ms=10_000, priority=2, **SHAPE)])
        assert fine.ok, fine.error
        report = client.status()
    assert report.schedule == "slo"
    by = {c.priority: c for c in report.slo}
    assert by[2].met >= 1 and by[0].missed >= 1  # the first one, late


def test_submit_says_refused_naming_the_deadline_and_exits_1_and_the_manifest_records_the_fields(dep, tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"prompt": "impossible", "slo_ms": 5, **SHAPE},
                                   {"prompt": "fine", "slo_ms": 30_000, "priority": 1, **SHAPE}]))
    res = disagg("submit", str(prompts), "--endpoint", dep.endpoint, "--out", str(tmp_path / "out"), "--concurrency", "1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "refused" in res.stdout and "deadline unmeetable: slo_ms 5" in res.stdout, res.stdout
    lines = [json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    by = {r["prompt"]: r for r in lines}
    assert not by["impossible"]["ok"] and by["fine"]["ok"]
    assert (by["fine"]["priority"], by["fine"]["slo_ms"]) == (1, 30_000)


def test_http_answers_429_with_retry_after_and_the_openai_client_raises_rate_limit(dep):
    r = httpx.post(dep.http + "/v1/images/generations", json={"prompt": "x", "size": "256x256",
                                                               "num_inference_steps": 2, "slo_ms": 5}, timeout=30)
    assert r.status_code == 429, r.text
    assert r.headers.get("retry-after") and r.json()["error"]["code"] == "deadline_unmeetable"
    api = openai.OpenAI(base_url=dep.http + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        api.images.generate(prompt="x", size="256x256", extra_body={"num_inference_steps": 2, "slo_ms": 5})
    ok = api.images.generate(prompt="y", size="256x256", extra_body={"num_inference_steps": 2, "slo_ms": 30_000,
                                                                       "priority": 3})
    assert ok.data[0].b64_json
    metrics = httpx.get(dep.http + "/metrics", timeout=10).text
    assert 'disagg_slo_met_total{priority="3"} 1.0' in metrics, metrics
    assert "disagg_slo_slack_seconds_bucket" in metrics


def test_a_bad_priority_or_deadline_is_a_400_naming_the_field(dep):
    for body, field in (({"priority": 5000}, "priority"), ({"slo_ms": -1}, "slo_ms")):
        r = httpx.post(dep.http + "/v1/images/generations", json={"prompt": "x", **body}, timeout=30)
        assert r.status_code == 400 and field in r.text, r.text
