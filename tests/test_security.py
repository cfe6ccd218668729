"""The HTTP attacks of the security review (notes of 2026-12-04: F2-F5, F8) against one real deployment:
`disagg launch` of sim:flux-h200 (no compute: its stages sleep the times of FLUX.1 on an H200, so a long request
is cheap) behind the gateway, with the main key and three more keys (two tenants with a priority, one admin).
Each attack is bounded in count and time and its outcome asserted: two keys cannot read, join-cancel, list,
download or delete each other's work and /recent shows each key its own.

Video jobs: a sim model makes no videos (its instances report max_frames 0, so the gateway refuses /v1/videos) and
no video model runs in this module's time, so their test runs the gateway's real app in this process (its routes,
middleware and orchestrator client) against the same deployment, with the model check off and the jobs made as
images (the job table's scoping is what is tested, not the MP4)."""

from __future__ import annotations

import threading
import time

import httpx
import msgspec
import pytest

from tests.conftest import launch_with_http, wait_http, wait_until

pytestmark = pytest.mark.e2e

MAIN = "main-sekrit"
ALICE, BOB, OPS = "alice-key", "bob-key", "ops-key"


def auth(key: str, **more) -> dict:
    return {"Authorization": f"Bearer {key}", **more}


@pytest.fixture(scope="module")
def dep(module_tmp):
    config = module_tmp / "gateway.yaml"
    config.write_text(f"http:\n  api_keys: {{{ALICE}: 5, {BOB}: 5, {OPS}: {{admin: true}}}}\n")
    launched = launch_with_http(["--model", "sim:flux-h200", "-d", "1", "--api-key", MAIN, "--config", str(config),
                                 "--no-dashboard"], module_tmp)
    for d in launched.serve(3):
        wait_http(d.http + "/health")
        yield d


@pytest.fixture(scope="module")
def http(dep):
    with httpx.Client(base_url=dep.http, timeout=30) as client:
        yield client


def generate(http, key: str, prompt: str, rid: str | None = None, **body):
    headers = auth(key, **({"X-Request-Id": rid} if rid else {}))
    return http.post("/v1/images/generations", json={"prompt": prompt, "size": "64x64", "num_inference_steps": 1,
                                                      **body}, headers=headers)


def counts(dep) -> dict:
    return msgspec.to_builtins(dep.status().requests)


# --- F2, F5: answers kept for X-Request-Id and /recent belong to a key --------------------------------------


def test_another_key_cannot_replay_an_answer_by_its_request_id(dep, http):
    """F2: Bob learns Alice's ids and prompts (as /recent showed them) and sends them with his key: he gets a run of
    his own (another seed), not Alice's image, and other parameters are no 409 that would tell him an id was used;
    Alice's resubmission still gets her answer, not run again."""
    alice = [generate(http, ALICE, "alice private", rid=f"alice-000{k}") for k in (1, 2)]
    assert all(r.status_code == 200 for r in alice), alice[0].text
    seeds = {r.json()["disagg"]["seed"] for r in alice}
    before = counts(dep)
    bob = generate(http, BOB, "alice private", rid="alice-0001")
    assert bob.status_code == 200 and bob.headers["X-Request-Id"] == bob.json()["id"] == "alice-0001"
    assert bob.json()["disagg"]["seed"] not in seeds and counts(dep)["completed"] == before["completed"] + 1  # it ran
    other = generate(http, BOB, "other words", rid="alice-0002")
    assert other.status_code == 200, other.text
    again = generate(http, ALICE, "alice private", rid="alice-0001")
    assert again.json()["disagg"]["seed"] == alice[0].json()["disagg"]["seed"]  # hers, kept
    assert counts(dep)["completed"] == before["completed"] + 2  # Bob's two, not Alice's again
    # the main key is a tenant too: its equal id is its own request
    main = generate(http, MAIN, "alice private", rid="alice-0001")
    assert main.status_code == 200 and main.json()["disagg"]["seed"] not in seeds | {bob.json()["disagg"]["seed"]}


def test_recent_shows_each_key_its_own(dep, http):
    """F5: /recent lists the last images of the caller's key; the main key and an admin key see every key's."""
    for key, prompt in ((ALICE, "ALICE SECRET PROMPT"), (BOB, "BOB SECRET PROMPT")):
        assert generate(http, key, prompt, rid=f"recent-{key}").status_code == 200

    def prompts(key):
        r = http.get("/recent", headers=auth(key))
        assert r.status_code == 200 and len(r.json()["series"]) == 30
        return {i["prompt"] for i in r.json()["images"]}

    alice, bob = prompts(ALICE), prompts(BOB)
    assert "ALICE SECRET PROMPT" in alice and not alice & {"BOB SECRET PROMPT", "other words"}
    assert "BOB SECRET PROMPT" in bob and "ALICE SECRET PROMPT" not in bob
    for admin in (MAIN, OPS):
        assert {"ALICE SECRET PROMPT", "BOB SECRET PROMPT"} <= prompts(admin)
    assert http.get("/recent").status_code == 401


# --- F3: joining a running request ---------------------------------------------------------------------------


def test_a_joining_caller_that_hangs_up_cancels_nothing_of_the_owner(dep, http):
    """F3: while Alice's request runs (~3 s), Bob sends her id and parameters and hangs up (his own run, cancelled),
    and a second caller of Alice's key joins her run and hangs up (only detached): Alice gets her image. Once the
    last caller of a run hangs up, it is cancelled."""
    body = {"prompt": "alice long", "size": "512x512", "num_inference_steps": 40}  # 40 steps of ~85 ms
    got = {}

    def post(name, key, timeout, rid="alice-long-1"):
        try:
            got[name] = httpx.post(dep.http + "/v1/images/generations", json=body, timeout=timeout,
                                   headers=auth(key, **{"X-Request-Id": rid}))
        except httpx.TimeoutException:
            got[name] = "hung up"

    before = counts(dep)
    owner = threading.Thread(target=post, args=("alice", ALICE, 60))
    owner.start()
    time.sleep(0.5)
    joiners = [threading.Thread(target=post, args=(name, key, 1.0)) for name, key in (("bob", BOB), ("alice2", ALICE))]
    for t in joiners:
        t.start()
    for t in [owner, *joiners]:
        t.join(60)
    assert got["bob"] == got["alice2"] == "hung up"
    assert got["alice"].status_code == 200, got["alice"].text
    wait_until(lambda: counts(dep)["in_flight"] == 0, timeout=10)
    after = counts(dep)
    # Alice's run completed once (her second caller joined it); Bob's own run was cancelled when he hung up
    assert after["completed"] == before["completed"] + 1 and after["cancelled"] == before["cancelled"] + 1
    # alone on a run, a hang-up cancels it
    post("alone", ALICE, 1.0, rid="alice-long-2")
    assert got["alone"] == "hung up"
    wait_until(lambda: counts(dep)["cancelled"] == after["cancelled"] + 1, timeout=10)


def test_a_cancelled_request_is_not_reported_as_a_failed_generation():
    """F3: a request cancelled by someone else was a 500 generation_failed."""
    from client import Outcome
    from gateway.errors import from_outcome
    from transport.codes import ErrorCode
    from transport.messages import GenerationParams

    err = from_outcome(Outcome("r", GenerationParams(prompt="p"), False, "cancelled", code=ErrorCode.CANCELLED))
    assert err.status == 409 and err.code == "cancelled" and err.headers["x-should-retry"] == "false"


# --- F4, F8: video jobs belong to a key ----------------------------------------------------------------------


@pytest.fixture
def video_app(dep, monkeypatch):
    """The gateway's app in this process, for the same deployment, with the same keys; jobs made as images."""
    from fastapi.testclient import TestClient

    import gateway.routes.videos as routes
    from gateway.app import make_app
    from settings.process import GatewaySettings

    real_to_params = routes.to_params
    monkeypatch.setattr(routes, "refuse_what_cannot_be_made", lambda *a: None)
    monkeypatch.setattr(routes, "to_params", lambda req: msgspec.structs.replace(
        real_to_params(req), response_format="png", num_frames=None))
    settings = msgspec.convert({"endpoint": dep.endpoint, "http": {
        "api_key": MAIN, "api_keys": {ALICE: 5, BOB: 5, OPS: {"admin": True}}}}, GatewaySettings)
    with TestClient(make_app(settings)) as client:
        yield client


def test_two_keys_cannot_list_read_download_or_delete_each_others_video_jobs(video_app, monkeypatch):
    """F4: Bob does not see Alice's job in the list, and retrieving, following, downloading or deleting it is a 404
    for him, as for an id that does not exist; Alice and the admin keys see it."""
    c = video_app
    job = c.post("/v1/videos", json={"prompt": "ALICE PRIVATE VIDEO", "size": "64x64", "num_inference_steps": 1},
                 headers=auth(ALICE))
    assert job.status_code == 200, job.text
    vid = job.json()["id"]
    wait_until(lambda: c.get(f"/v1/videos/{vid}", headers=auth(ALICE)).json()["status"] == "completed", timeout=20)
    assert c.get(f"/v1/videos/{vid}/content", headers=auth(ALICE)).status_code == 200
    assert c.get("/v1/videos", headers=auth(BOB)).json()["data"] == []
    for method, path in (("GET", f"/v1/videos/{vid}"), ("GET", f"/v1/videos/{vid}/content"),
                         ("GET", f"/v1/videos/{vid}/events"), ("DELETE", f"/v1/videos/{vid}"),
                         ("GET", f"/v1/videos?after={vid}")):
        r = c.request(method, path, headers=auth(BOB))
        assert r.status_code == 404 and "ALICE" not in r.text, (method, path, r.text)
    for key in (ALICE, MAIN, OPS):
        assert [j["id"] for j in c.get("/v1/videos", headers=auth(key)).json()["data"]] == [vid]
    assert c.get(f"/v1/videos/{vid}", headers=auth(ALICE)).json()["prompt"] == "ALICE PRIVATE VIDEO"
    assert c.delete(f"/v1/videos/{vid}", headers=auth(ALICE)).json()["deleted"] is True


def test_one_keys_jobs_never_evict_anothers(video_app, monkeypatch):
    """F8: past its quota (its share of the job table; 3 here) a key loses its own oldest jobs, never another's."""
    import gateway.routes.videos as routes

    monkeypatch.setattr(routes, "jobs_quota", lambda tenants: 3)
    c = video_app
    body = {"prompt": "p", "size": "64x64", "num_inference_steps": 1}
    alice = c.post("/v1/videos", json=body, headers=auth(ALICE)).json()["id"]
    bobs = [c.post("/v1/videos", json=body, headers=auth(BOB)).json()["id"] for _ in range(5)]
    assert c.get(f"/v1/videos/{alice}", headers=auth(ALICE)).status_code == 200
    assert [j["id"] for j in c.get("/v1/videos", headers=auth(BOB)).json()["data"]] == bobs[:-4:-1]
    assert c.get(f"/v1/videos/{bobs[0]}", headers=auth(BOB)).status_code == 404
