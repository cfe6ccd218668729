"""The HTTP gateway over real processes: `disagg launch --http-port` on the tiny model, driven by the
official `openai` client and by httpx as SGLang's benchmark client would; `disagg serve-http` and the
API key on a compute-free deployment."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import psutil
import pytest
from PIL import Image

from disagg.gateway.errors import from_outcome
from tests.conftest import ROOT, Launched, disagg, free_port_pair, launch_with_http, pid_alive, wait_http, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny(module_tmp):
    for dep in launch_with_http(["-e", "1", "-d", "1", "-k", "1", "--no-dashboard"], module_tmp).serve(3):
        wait_http(dep.http + "/health")
        yield dep


@pytest.fixture(scope="module")
def api(tiny):
    return openai.OpenAI(base_url=tiny.http + "/v1", api_key="unused", max_retries=0)


def png_pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


def test_openai_images_generate_equals_disagg_submit(tiny, api, tmp_path):
    r = api.images.generate(prompt="a red fox in the snow", size="64x48", response_format="b64_json",
                            extra_body={"seed": 7, "num_inference_steps": 4})
    assert r.size == "64x48" and r.output_format == "png" and len(r.data) == 1
    assert r.data[0].revised_prompt == "a red fox in the snow"
    got = png_pixels(base64.b64decode(r.data[0].b64_json))
    assert got.shape == (48, 64, 3) and got.std() > 5
    prompts = tmp_path / "p.json"
    prompts.write_text('{"prompt": "a red fox in the snow", "width": 64, "height": 48, "seed": 7, '
                       '"num_inference_steps": 4}')
    res = disagg("submit", str(prompts), "--endpoint", tiny.endpoint, "--out", str(tmp_path / "out"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    [png] = (tmp_path / "out").glob("*.png")
    assert np.array_equal(got, png_pixels(png.read_bytes()))
    extra = r.model_extra["disagg"]
    assert extra["seed"] == 7 and extra["timings"]["total"] > 0 and extra["model"] == "tiny"


def test_url_format_serves_the_image_and_n_gives_n_images(tiny, api):
    r = api.images.generate(prompt="a blue car", size="64x64", n=2, response_format="url", extra_body={"seed": 3})
    assert len(r.data) == 2
    images = [httpx.get(d.url, timeout=10) for d in r.data]
    assert all(i.status_code == 200 and i.headers["content-type"] == "image/png" for i in images)
    assert images[0].content != images[1].content  # two images of one prompt differ
    missing = httpx.get(tiny.http + "/v1/images/nope/content", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "image_id"


@pytest.mark.parametrize("kwargs, param", [
    (dict(size="64x6"), "size"),
    (dict(size="big"), "size"),
    (dict(n=11), "n"),
    (dict(extra_body={"num_inference_steps": 0}), "num_inference_steps"),
    (dict(extra_body={"warp": 9}), "warp"),
    (dict(extra_body={"extra_body": {"warp": 9}}), "extra_body.warp"),
    (dict(prompt="x" * 20_001), "prompt"),
    (dict(output_format="gif"), "output_format"),
])
def test_bad_input_raises_bad_request_naming_the_field(api, kwargs, param):
    kwargs = {"prompt": "a cat", "size": "64x64", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        api.images.generate(**kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body


def latency_counts(base: str) -> dict[str, float]:
    """disagg_request_latency_seconds_count per outcome, from the gateway's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=10).text
    return {s.labels["outcome"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "disagg_request_latency_seconds" for s in f.samples if s.name.endswith("_count")}


def test_a_size_over_the_models_maximum_names_size_and_counts_as_invalid_not_failed(tiny, api):
    """Issue 44 (newcomer D3, D5): a size over the model's maximum (tiny: 1024) is refused naming the field the
    client sent (`size`, or `width` when it sent width), and the gateway counts those 400s as the orchestrator
    does, `invalid`, in its latency histogram and the page's chart, not as `failed`."""
    before = latency_counts(tiny.http)
    with pytest.raises(openai.BadRequestError) as info:
        api.images.generate(prompt="a cat", size="2048x2048")
    assert info.value.body["param"] == "size", info.value.body
    assert info.value.body["message"].startswith("size 2048x2048: width 2048 is over this deployment's maximum")
    r = httpx.post(tiny.http + "/v1/images/generations", json={"prompt": "a cat", "width": 2048, "height": 64},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "width", r.text
    after = latency_counts(tiny.http)
    assert after.get("invalid", 0) == before.get("invalid", 0) + 2, after
    assert after.get("failed", 0) == before.get("failed", 0), after
    series = httpx.get(tiny.http + "/recent", timeout=10).json()["series"]  # the page's chart: the last 5 min
    assert sum(b["invalid"] for b in series) >= 2, series


def test_the_pages_chart_counts_invalid_requests_apart_from_failed_ones():
    from disagg.gateway.activity import Activity

    activity = Activity()
    for outcome, latency in (("completed", 1.0), ("completed", 3.0), ("invalid", 0.01), ("failed", 9.0)):
        activity.record(outcome, latency)
    [bucket] = [b for b in activity.doc(caller=None, now=time.time() + 1)["series"] if b["rps"]]
    assert (bucket["failed"], bucket["invalid"], bucket["p95"]) == (1, 1, 3.0), bucket


def test_unknown_model_route_and_garbage_get_openai_shaped_errors(tiny, api):
    with pytest.raises(openai.NotFoundError) as info:
        api.images.generate(prompt="a cat", model="dall-e-3", size="64x64")
    assert info.value.body["code"] == "model_not_found"
    for method, path, body in (("GET", "/nope", None), ("POST", "/v1/images/generations", b"\x00garbage"),
                               ("POST", "/v1/images/generations", b'{"prompt": 5}'),
                               ("POST", "/v1/images/generations", b"[1, 2]"),
                               ("POST", "/v1/images/generations", b"x" * (2 * 1024 * 1024))):
        r = httpx.request(method, tiny.http + path, content=body, timeout=10)
        assert 400 <= r.status_code < 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert httpx.get(tiny.http + "/health", timeout=10).status_code == 200


def test_a_client_of_sglangs_benchmark_protocol_works_unchanged(tiny):
    with httpx.Client(base_url=tiny.http, timeout=60) as http:
        wait_http(tiny.http + "/health")
        info = http.get("/v1/model_info").json()
        assert info["model_path"] == "tiny"
        r = http.post("/v1/images/generations", json={"model": "tiny", "prompt": "a house", "n": 1,
                                                      "response_format": "b64_json", "size": "64x64"})
        assert r.status_code == 200, r.text
        assert Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).size == (64, 64)
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert http.get("/v1/models/tiny").status_code == 200 and http.get("/v1/models/other").status_code == 404


def test_x_request_id_is_honoured_echoed_and_not_run_twice(tiny):
    def completed():
        return httpx.get(tiny.http + "/stats", timeout=10).json()["requests"]["completed"]

    body = {"prompt": "a tree", "size": "64x64", "seed": 4, "num_inference_steps": 2}
    before = completed()
    a = httpx.post(tiny.http + "/v1/images/generations", json=body, headers={"X-Request-Id": "my-id-1"}, timeout=60)
    b = httpx.post(tiny.http + "/v1/images/generations", json=body, headers={"X-Request-Id": "my-id-1"}, timeout=60)
    assert a.status_code == b.status_code == 200
    assert a.headers["x-request-id"] == "my-id-1" and a.json()["id"] == "my-id-1" and a.json() == b.json()
    assert completed() == before + 1
    bad = httpx.post(tiny.http + "/v1/images/generations", json=body, headers={"X-Request-Id": "no spaces"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


def test_stats_and_metrics(tiny):
    r = httpx.post(tiny.http + "/v1/images/generations", json={"prompt": "a dog", "size": "32x32"}, timeout=60)
    assert r.status_code == 200
    stats = httpx.get(tiny.http + "/stats", timeout=10).json()
    assert {i["role"] for i in stats["instances"]} == {"encoder", "denoiser", "decoder"}
    assert [g["url"] for g in stats["gateways"]] == [tiny.http]  # it tells the orchestrator it serves it
    res = disagg("status", "--endpoint", tiny.endpoint, timeout=30)
    assert f"http {tiny.http}" in res.stdout, res.stdout
    assert {(t["source"], t["target"]) for t in stats["transfers"]} == {("encoder", "denoiser"), ("denoiser", "decoder")}
    text = httpx.get(tiny.http + "/metrics", timeout=10).text
    for name in ("disagg_requests_total{outcome=\"completed\"}", "disagg_queue_depth{role=\"denoiser\"}",
                 "disagg_instance_free_slots{", "disagg_instance_state{", "disagg_instance_restarts{",
                 "disagg_requests_in_flight", "disagg_request_latency_seconds_bucket", "disagg_http_stage_seconds_bucket",
                 'disagg_stage_seconds_count{phase="compute",role="denoiser"}',
                 "disagg_gateway_http_requests_total{", 'disagg_transfer_bytes_total{engine="shm",source="encoder"'):
        assert name in text, name
    line = next(x for x in text.splitlines() if x.startswith("disagg_gateway_http_requests_total")
                and 'route="/v1/images/generations"' in x and 'code="200"' in x)
    assert float(line.rsplit(" ", 1)[1]) >= 1


def test_every_query_of_the_grafana_dashboard_names_a_metric_metrics_exposes(tiny, api):
    """Issue 22: deploy/grafana/disagg.json's queries read what /metrics of a running deployment has: every
    metric name, and every label they group by."""
    import json
    import re

    from prometheus_client.parser import text_string_to_metric_families

    api.images.generate(prompt="dashboard", size="64x64", extra_body={"num_inference_steps": 1})
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("_sum", "_count", "_created"), "gauge": ("",)}
    names, labels = {}, {}
    for fam in text_string_to_metric_families(httpx.get(tiny.http + "/metrics", timeout=10).text):
        for suffix in suffixes.get(fam.type, ("",)):
            names[fam.name + suffix] = fam.name
        if fam.samples:  # a family with no samples yet (batch steps without batching) has no labels to check
            labels[fam.name] = {k for sample in fam.samples for k in sample.labels} | {"le"}
    dashboard = json.loads((ROOT / "deploy/grafana/disagg.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 14
    for expr in exprs:
        used = re.findall(r"\bdisagg_[a-z_]+", expr)
        assert used, expr
        for metric in used:
            assert metric in names, (metric, expr)
            for group in re.findall(r"by \(([^)]*)\)", expr) if names[metric] in labels else ():
                for label in (x.strip() for x in group.split(",")):
                    assert label in labels[names[metric]], (label, metric, expr)
    panels = " ".join(p["title"].lower() for p in dashboard["panels"])
    for what in ("outcome", "latency", "stage", "queue", "free slots", "engine", "restarts", "http"):
        assert what in panels, what


def test_error_statuses_come_from_the_codes_not_the_text():
    from disagg.client import Outcome
    from disagg.transport.wire.codes import ErrorCode as C
    from disagg.transport.wire.messages import GenerationParams

    def status(code, param=None, text="same words for all"):
        return from_outcome(Outcome("r", GenerationParams(prompt="p"), False, text, code=code, param=param))

    assert status(C.OVERLOADED).status == 429 and status(C.OVERLOADED).headers["Retry-After"]
    assert status(C.UNAVAILABLE).status == 503 and status(C.NOT_READY).code == "not_ready"
    err = status(C.OVER_LIMIT, "width")
    assert err.status == 400 and err.param == "width"
    assert status(C.DUPLICATE_REQUEST_ID, "request_id").param == "X-Request-Id"
    err = status(C.GENERATION_FAILED)
    assert err.status == 500 and err.headers["x-should-retry"] == "false"
    assert status(C.INVALID_INPUT).status == 400 and status(C.UNREACHABLE).status == 503
    assert status(None).status == 500  # an answer without a code (an older orchestrator)


def test_five_thousand_malformed_requests_get_4xx_and_the_gateway_keeps_serving(tiny):
    import random

    import psutil

    rng = random.Random(11)
    pid = gateway_pid(tiny)
    gw = psutil.Process(pid)
    rss0 = gw.memory_info().rss
    bodies = [b"", b"{", b"[]", b"null", b'{"prompt": 5}', b'{"prompt": "x", "n": "many"}', b'{"prompt": "x", "n": 0}',
              b'{"prompt": "x", "size": 7}', b'{"prompt": "x", "seed": -2}', b'{"prompt": "x", "extra_body": 3}',
              b'{"prompt": "x", "zzz": 1}', b'{"prompt": "x", "size": "99999x99999"}', b'{"prompt": ""}']
    codes = {}
    with httpx.Client(base_url=tiny.http, timeout=30) as http:
        for k in range(5000):
            kind = k % 6
            if kind == 0:
                r = http.post("/v1/images/generations", content=rng.randbytes(rng.randrange(1, 3000)))
            elif kind == 1:
                r = http.post("/v1/images/generations", content=rng.choice(bodies))
            elif kind == 2:
                r = http.post("/v1/videos", content=rng.choice(bodies + [rng.randbytes(500)]),
                              headers={"content-type": rng.choice(["application/json", "text/plain"])})
            elif kind == 3:
                path = "/fuzz/" + "".join(rng.choice("abc/%.-_~") for _ in range(rng.randrange(1, 40)))
                r = http.request(rng.choice(["GET", "POST", "PUT", "PATCH", "DELETE"]), path)
            elif kind == 4:
                r = http.request(rng.choice(["PUT", "PATCH"]), rng.choice(["/v1/images/generations", "/health", "/stats"]))
            else:
                big = k % 60 == 5
                r = http.post("/v1/images/generations", content=b"x" * (2 * 1024 * 1024) if big else
                              b'{"prompt": "' + b"y" * 30_000 + b'"}')
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            assert 400 <= r.status_code < 500, (k, r.status_code, r.text[:300])
    growth = (gw.memory_info().rss - rss0) / 2**20
    print(f"fuzz: 5000 requests, codes {codes}, gateway RSS growth {growth:.1f} MiB")
    assert growth < 64
    assert httpx.get(tiny.http + "/health", timeout=10).status_code == 200


def gateway_pid(dep) -> int:
    """The deployment's gateway process, as the orchestrator lists it (it beats every second)."""
    return wait_until(lambda: dep.status().gateways, timeout=30)[0].pid


@pytest.mark.ends_deployment
def test_a_killed_gateway_is_restarted(tiny):
    pid = gateway_pid(tiny)
    os.kill(pid, signal.SIGKILL)
    wait_http(tiny.http + "/liveness", timeout=30)
    assert not pid_alive(pid)
    # the launcher prints its events every half second
    wait_until(lambda: "gateway restarted" in tiny.output(), timeout=10, step=0.2, why=tiny.output)


# --- serve-http and the API key, on a compute-free deployment ------------------------------------


def test_serve_http_fronts_a_running_deployment_with_an_api_key(tmp_path):
    http_port = free_port_pair()
    config = tmp_path / "keys.yaml"  # keys with a priority (http.api_keys) beside the one key of any priority
    config.write_text("http:\n  api_keys: {bronze-key: -5, gold-key: 7}\n")
    dep = Launched(["--model", "sim:zero", "-d", "1", "--no-dashboard", "--http-port", str(http_port),
                    "--api-key", "sekrit", "--config", str(config)], tmp_path)
    second = None
    try:
        dep.wait_ready(3)
        url = f"http://127.0.0.1:{http_port}"
        wait_http(url + "/health")
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        assert good.images.generate(prompt="a cat", size="64x64").data[0].b64_json
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).images.generate(prompt="a cat")
        # a key's priority: its requests run at it (counted per priority with their deadline), a lower one may be
        # asked, a higher one is refused naming the field; neither key appears on a command line
        deadline = {"slo_ms": 600_000}
        bronze = openai.OpenAI(base_url=url + "/v1", api_key="bronze-key", max_retries=0)
        gold = openai.OpenAI(base_url=url + "/v1", api_key="gold-key", max_retries=0)
        assert bronze.images.generate(prompt="a", size="32x32", extra_body=deadline).data[0].b64_json
        assert gold.images.generate(prompt="b", size="32x32", extra_body={**deadline, "priority": 3}).data
        with pytest.raises(openai.PermissionDeniedError) as denied:
            gold.images.generate(prompt="c", size="32x32", extra_body={**deadline, "priority": 9})
        assert denied.value.body["param"] == "priority" and "above" in denied.value.body["message"]
        assert {c.priority: c.met for c in dep.status().slo} == {-5: 1, 3: 1}
        assert not any("gold-key" in " ".join(p.info["cmdline"] or ()) for p in psutil.process_iter(["cmdline"]))
        # a second gateway, on its own, for the same orchestrator
        port2 = free_port_pair()
        second = subprocess.Popen([sys.executable, "-m", "disagg", "serve-http", "--endpoint", dep.endpoint,
                                   "--port", str(port2)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_http(f"http://127.0.0.1:{port2}/health")
        r = httpx.post(f"http://127.0.0.1:{port2}/v1/images/generations", json={"prompt": "b", "size": "32x32"},
                       timeout=30)
        assert r.status_code == 200, r.text
        res = disagg("serve-http", "--endpoint", dep.endpoint, "--port", str(port2), timeout=30)
        assert res.returncode == 2 and f"HTTP port {port2}" in res.stderr
    finally:
        if second is not None:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=10)
        dep.stop()


# --- videos, on the tiny Wan checkpoint --------------------------------------------------------


def test_a_video_asked_of_an_image_model_is_refused_at_create(api):
    with pytest.raises(openai.BadRequestError) as info:  # the tiny Flux makes images
        api.videos.create(prompt="a cat", size="32x32", seconds="4")
    assert info.value.body["param"] == "model" and "makes images" in info.value.body["message"], info.value.body


def test_what_the_gateway_keeps_is_bounded_by_count_bytes_and_age():
    from disagg.gateway.store import BoundedCache

    cache = BoundedCache(max_items=3, max_bytes=100, ttl_s=None)
    for k in range(3):
        cache.put(f"k{k}", k, 30)
    assert len(cache) == 3 and cache.nbytes == 90
    cache.put("big", "b", 50)  # over 100 bytes: the oldest go until it fits
    assert "k0" not in cache and "k1" not in cache and cache.get("big") == "b" and cache.nbytes == 80
    cache.put("k3", 3, 10)
    cache.put("k4", 4, 10)  # a 4th entry: the oldest goes
    assert len(cache) == 3 and "k2" not in cache
    now = [100.0]  # an injected clock
    aging = BoundedCache(max_items=10, max_bytes=10, ttl_s=0.05, clock=lambda: now[0])
    aging.put("a", 1, 1)
    now[0] += 0.04
    assert aging.get("a") == 1
    now[0] += 0.02
    assert aging.get("a") is None and aging.nbytes == 0


def test_a_step_cache_through_http_and_submit_equals_the_pipeline_and_reports_skipped_steps(tiny, api, tmp_path):
    """The cache field in extra_body and in a prompt file: the image equals diffusers' FluxPipeline run with the
    same cache config, and the response, its headers and the manifest say how many steps it skipped."""
    import json

    import torch

    from disagg.roles.extensions.step_cache import config_of
    from disagg.roles.pipelines.tiny import build_tiny_flux_pipeline

    cache = {"type": "first_block", "threshold": 0.3}
    raw = api.images.with_raw_response.generate(prompt="a red cat", size="64x64",
                                                extra_body={"seed": 3, "num_inference_steps": 8, "cache": cache})
    r = raw.parse()
    report = r.model_extra["disagg"]["cache"]
    assert report["cache"] == "first_block threshold=0.3" and report["steps_skipped"] > 0
    assert report["steps_computed"] + report["steps_skipped"] == 8
    assert raw.headers["X-Disagg-Steps-Skipped"] == str(report["steps_skipped"])
    pipe = build_tiny_flux_pipeline()
    pipe.transformer.enable_cache(config_of(cache, "flux", 8, lambda: pipe.current_timestep))
    want = np.asarray(pipe(prompt="a red cat", width=64, height=64, num_inference_steps=8, guidance_scale=3.5,
                           generator=torch.Generator("cpu").manual_seed(3)).images[0], dtype=np.int16)
    got = png_pixels(base64.b64decode(r.data[0].b64_json))
    assert np.abs(got - want).max() <= 1
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps({"prompt": "a red cat", "width": 64, "height": 64, "seed": 3,
                                   "num_inference_steps": 8, "cache": cache}))
    res = disagg("submit", str(prompts), "--endpoint", tiny.endpoint, "--out", str(tmp_path / "out"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    [png] = (tmp_path / "out").glob("*.png")
    assert np.array_equal(got, png_pixels(png.read_bytes()))
    [line] = (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert (record["cache"], record["steps_skipped"]) == (report["cache"], report["steps_skipped"])
    # a bad cache is a 400 naming the field, and the deployment keeps serving
    with pytest.raises(openai.BadRequestError) as info:
        api.images.generate(prompt="a cat", size="64x64", extra_body={"cache": {"type": "teacache"}})
    assert info.value.body["param"] == "cache" and "type must be one of" in info.value.body["message"]


def test_a_repeated_prompt_is_taken_from_the_encoders_conditioning_cache(tiny, api):
    """The same prompt twice: the second time the encoder computes nothing (its computed count, in status, stays)
    and the pixels are the same; the hit shows in status and /metrics."""

    def encoder():
        [enc] = [i for i in tiny.status().instances if i.role == "encoder"]
        return enc

    def generate(seed):
        r = api.images.generate(prompt="a green tree by the river at night", size="64x64",
                                extra_body={"seed": seed, "num_inference_steps": 2})
        return png_pixels(base64.b64decode(r.data[0].b64_json))

    def settled(e):  # every text request it looked up was a hit or a compute: its heartbeat is up to date
        return e.conditioning.lookups == e.conditioning.hits + e.computed

    start = encoder()
    first = generate(11)
    before = wait_until(lambda: (e := encoder()).conditioning.lookups > start.conditioning.lookups and settled(e) and e, 10)
    again = generate(11)
    other_seed = generate(12)  # another seed, same prompt: the same encoding, other pixels
    after = wait_until(lambda: (e := encoder()).conditioning.hits >= before.conditioning.hits + 2 and settled(e) and e, 10)
    assert after.computed == before.computed
    assert np.array_equal(first, again) and not np.array_equal(first, other_seed)
    metrics = httpx.get(tiny.http + "/metrics", timeout=10).text
    assert 'disagg_conditioning_hits_total{instance="encoder-0"}' in metrics
    assert "disagg_conditioning_hit_ratio" in metrics


def test_streamed_partial_images_with_the_openai_client_and_the_same_final_image(tiny, api):
    """stream=True, partial_images=2: two partial events (decoded by the decoder from the denoiser's staged
    latents), then the completed image, which equals the one the same request gets unstreamed."""
    kw = dict(prompt="a blue house on the beach", size="64x64", extra_body={"seed": 9, "num_inference_steps": 6})
    events = list(api.images.generate(stream=True, partial_images=2, **kw))
    partial = [e for e in events if e.type == "image_generation.partial_image"]
    [completed] = [e for e in events if e.type == "image_generation.completed"]
    assert [e.partial_image_index for e in partial] == [0, 1], [e.type for e in events]
    previews = [png_pixels(base64.b64decode(e.b64_json)) for e in partial]
    final = png_pixels(base64.b64decode(completed.b64_json))
    assert all(p.shape == final.shape for p in previews) and not np.array_equal(previews[0], final)
    plain = api.images.generate(**kw)
    assert np.array_equal(final, png_pixels(base64.b64decode(plain.data[0].b64_json)))
    assert tiny.status().orchestrator["previews_sent"] >= 2


def test_submit_saves_previews_as_they_arrive(tiny, tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text('{"prompt": "a red bird in the forest", "width": 64, "height": 64, "seed": 4, '
                       '"num_inference_steps": 6}')
    res = disagg("submit", str(prompts), "--endpoint", tiny.endpoint, "--out", str(tmp_path / "out"),
                 "--previews", str(tmp_path / "previews"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    [png] = (tmp_path / "out").glob("*.png")
    saved = sorted((tmp_path / "previews").glob("*-preview-*.png"))
    assert [p.name for p in saved] == [f"{png.stem}-preview-{i}.png" for i in (0, 1)], res.stdout
    assert all(png_pixels(p.read_bytes()).shape == (64, 64, 3) for p in saved)
    assert "step 2/6" in res.stdout and "step 4/6" in res.stdout


def test_a_client_that_hangs_up_mid_stream_cancels_the_request(tiny):
    before = tiny.status().requests.cancelled
    body = {"prompt": "a long night", "size": "64x64", "stream": True, "partial_images": 3,
            "num_inference_steps": 1000}
    with httpx.Client(base_url=tiny.http, timeout=60) as http, http.stream("POST", "/v1/images/generations",
                                                                           json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: image_generation.partial_image"):
                break  # the first preview (step 250 of 1000): hang up now
    wait_until(lambda: tiny.status().requests.cancelled > before, 30)
    wait_until(lambda: all(i.in_flight == 0 for i in tiny.status().instances), 30)


def test_two_requests_with_other_caches_in_flight_on_one_denoiser_each_equal_their_pipeline(tiny, api):
    """Over HTTP, at once, on the deployment's one denoiser (capacity 2): first_block and mag, each equal to
    diffusers' FluxPipeline with its own cache config."""
    import threading

    import torch

    from disagg.roles.extensions.step_cache import config_of
    from disagg.roles.pipelines.tiny import build_tiny_flux_pipeline

    caches = [{"type": "first_block", "threshold": 0.3}, {"type": "mag"}]
    got: list = [None, None]

    def send(i):
        r = api.images.generate(prompt=f"a cat number {i}", size="64x64",
                                extra_body={"seed": 20 + i, "num_inference_steps": 8, "cache": caches[i]})
        got[i] = (png_pixels(base64.b64decode(r.data[0].b64_json)), r.model_extra["disagg"]["cache"])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    pipe = build_tiny_flux_pipeline()
    for i, (image, report) in enumerate(got):
        assert report["cache"].startswith(caches[i]["type"]) and report["steps_skipped"] > 0, report
        pipe.transformer.enable_cache(config_of(caches[i], "flux", 8, lambda: pipe.current_timestep))
        try:
            want = pipe(prompt=f"a cat number {i}", width=64, height=64, num_inference_steps=8, guidance_scale=3.5,
                        generator=torch.Generator("cpu").manual_seed(20 + i)).images[0]
        finally:
            pipe.transformer.disable_cache()
        assert np.abs(image - np.asarray(want, dtype=np.int16)).max() <= 1
