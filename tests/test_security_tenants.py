"""The security review's tenant attacks (notes of 2026-12-04: F2-F5, F8) against one real deployment
(tests/security_deployment.py): two keys cannot read, join-cancel, list, download or delete each other's work, and
/recent shows each key its own."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.conftest import wait_until
from tests.security_deployment import (  # noqa: F401 - its fixtures, used by name
    ALICE,
    BOB,
    BODY_TIMEOUT_S,
    MAIN,
    MB,
    OPS,
    READ_TIMEOUT_S,
    auth,
    counts,
    dep,
    gateway_process,
    generate,
    http,
    video_app,
)

pytestmark = pytest.mark.e2e


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
    from disagg.client import Outcome
    from disagg.gateway.errors import from_outcome
    from disagg.transport.wire.codes import ErrorCode
    from disagg.transport.wire.messages import GenerationParams

    err = from_outcome(Outcome("r", GenerationParams(prompt="p"), False, "cancelled", code=ErrorCode.CANCELLED))
    assert err.status == 409 and err.code == "cancelled" and err.headers["x-should-retry"] == "false"


# --- F4, F8: video jobs belong to a key ----------------------------------------------------------------------


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
    import disagg.gateway.routes.videos as routes

    monkeypatch.setattr(routes, "jobs_quota", lambda tenants: 3)
    c = video_app
    body = {"prompt": "p", "size": "64x64", "num_inference_steps": 1}
    alice = c.post("/v1/videos", json=body, headers=auth(ALICE)).json()["id"]
    bobs = [c.post("/v1/videos", json=body, headers=auth(BOB)).json()["id"] for _ in range(5)]
    assert c.get(f"/v1/videos/{alice}", headers=auth(ALICE)).status_code == 200
    assert [j["id"] for j in c.get("/v1/videos", headers=auth(BOB)).json()["data"]] == bobs[:-4:-1]
    assert c.get(f"/v1/videos/{bobs[0]}", headers=auth(BOB)).status_code == 404
