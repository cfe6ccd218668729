"""The deployment the security tests attack (tests/test_security_tenants.py, tests/test_security_limits.py; each
module launches its own): `disagg launch` of sim:flux-h200 (no compute: its stages sleep the times of FLUX.1 on an
H200, so a long request is cheap) behind the gateway, with the main key and three more keys (two tenants with a
priority, one admin), and short read timeouts. `video_app`: the gateway's real app in the test's process against
that deployment, with the model check off and video jobs made as images (a sim model makes no videos)."""

from __future__ import annotations

import httpx
import msgspec
import psutil
import pytest

from tests.conftest import launch_with_http, wait_http, wait_until

MAIN = "main-sekrit"
ALICE, BOB, OPS = "alice-key", "bob-key", "ops-key"
#: the gateway's read timeouts here (defaults 30 s and 300 s), short enough to wait for
READ_TIMEOUT_S, BODY_TIMEOUT_S = 1.5, 4.0
MB = 100 * 1024 * 1024


def auth(key: str, **more) -> dict:
    return {"Authorization": f"Bearer {key}", **more}


@pytest.fixture(scope="module")
def dep(module_tmp):
    config = module_tmp / "gateway.yaml"
    config.write_text(f"http:\n  api_keys: {{{ALICE}: 5, {BOB}: 5, {OPS}: {{admin: true}}}}\n"
                      f"  read_timeout: {READ_TIMEOUT_S}\n  body_timeout: {BODY_TIMEOUT_S}\n")
    launched = launch_with_http(["--model", "sim:flux-h200", "-d", "1", "--api-key", MAIN, "--config", str(config),
                                 "--no-dashboard"], module_tmp)
    for d in launched.serve(3):
        wait_http(d.http + "/health")
        yield d


@pytest.fixture(scope="module")
def http(dep):
    with httpx.Client(base_url=dep.http, timeout=30) as client:
        yield client


def gateway_process(dep) -> psutil.Process:
    found = wait_until(lambda: [g for g in dep.status().gateways if g.url == dep.http], timeout=30)
    return psutil.Process(found[0].pid)


def generate(http, key: str, prompt: str, rid: str | None = None, **body):
    headers = auth(key, **({"X-Request-Id": rid} if rid else {}))
    return http.post("/v1/images/generations", json={"prompt": prompt, "size": "64x64", "num_inference_steps": 1,
                                                      **body}, headers=headers)


def counts(dep) -> dict:
    return msgspec.to_builtins(dep.status().requests)


@pytest.fixture
def video_app(dep, monkeypatch):
    """The gateway's app in this process, for the same deployment, with the same keys; jobs made as images."""
    from fastapi.testclient import TestClient

    import disagg.gateway.routes.videos as routes
    from disagg.gateway.app import make_app
    from disagg.settings.process import GatewaySettings

    real_to_params = routes.to_params
    monkeypatch.setattr(routes, "refuse_what_cannot_be_made", lambda *a: None)
    monkeypatch.setattr(routes, "to_params", lambda req: msgspec.structs.replace(
        real_to_params(req), response_format="png", num_frames=None))
    settings = msgspec.convert({"endpoint": dep.endpoint, "http": {
        "api_key": MAIN, "api_keys": {ALICE: 5, BOB: 5, OPS: {"admin": True}}}}, GatewaySettings)
    with TestClient(make_app(settings)) as client:
        yield client
