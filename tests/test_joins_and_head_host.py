"""Issue 22's defects that need a head and join launchers on this machine, against one head on real processes:
a head with no denoiser (the multi-host and Kubernetes head), a join launcher beside it on the same machine,
one serving another model, a reused X-Request-Id, and `stop --host` of the head's own host.

The tests run in file order: each leaves the head as the next one expects it."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from disagg.client import Client
from disagg.transport.wire.messages import GenerationParams
from tests.conftest import Launched, disagg, launch_with_http, wait_until

pytestmark = pytest.mark.e2e

JOIN_WAIT_S = 2.0


@pytest.fixture(scope="module")
def head(module_tmp):
    """The README's multi-host head: an encoder and a decoder, no denoiser (they join)."""
    (module_tmp / "head").mkdir()
    dep = launch_with_http(["--model", "payload", "-e", "1", "-d", "0", "-k", "1", "--join-wait", str(JOIN_WAIT_S),
                            "--no-dashboard"], module_tmp / "head")
    yield from dep.serve(2)


def join(head, tmp, name: str, *args: str, env: dict | None = None) -> Launched:
    (tmp / name).mkdir()
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        return Launched(["--join", head.endpoint, "-e", "0", "-d", "1", "-k", "0", "--no-dashboard", *args], tmp / name,
                        port=head.port)
    finally:
        os.environ.clear()
        os.environ.update(old)


def post(head, body: dict, request_id: str | None = None) -> httpx.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    return httpx.post(f"{head.http}/v1/images/generations", json=body, headers=headers, timeout=30)


def test_a_role_without_any_instance_answers_503_at_once_not_after_the_timeout(head, tmp_path):
    """M1: before, requests waited the whole request timeout (600 s) in the denoiser queue."""
    wait_until(lambda: head.status().orchestrator.get("unserved_denoiser_s", 0) >= JOIN_WAIT_S, timeout=30)
    t0 = time.monotonic()
    r = post(head, {"prompt": "x", "size": "64x64"})
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    error = r.json()["error"]
    assert error["code"] == "not_ready" and "no instance of denoiser" in error["message"], error
    assert time.monotonic() - t0 < 2
    health = httpx.get(f"{head.http}/health", timeout=10)
    assert health.status_code == 503 and health.json()["error"]["code"] == "no_instance", health.text
    prompts = tmp_path / "p.json"
    prompts.write_text('{"prompt": "x", "width": 64, "height": 64}')
    res = disagg("submit", str(prompts), "--endpoint", head.endpoint, "--out", str(tmp_path / "o"), timeout=30)
    assert res.returncode == 1 and "not ready: no instance of denoiser" in res.stdout, res.stdout + res.stderr
    # M3: the refused request has its line in the manifest
    [line] = (tmp_path / "o" / "manifest.jsonl").read_text().splitlines()
    assert json.loads(line)["ok"] is False and "not ready" in json.loads(line)["error"]


def test_a_join_serving_another_model_is_refused_naming_both(head, module_tmp):
    """H3: before, a join host of another model was accepted, and its images were reported as the head's."""
    other = join(head, module_tmp, "other", "--model", "sim:zero", env={"DISAGG_HOST_ID": "side"})
    try:
        code = other.proc.wait(timeout=120)
        out = other.output()
        assert code == 1, out
        assert "another model" in out and "'payload'" in out and "'sim:zero'" in out, out
    finally:
        other.stop()
    assert [i.id for i in head.status().instances if i.role == "denoiser" and i.state != "dead"] == []


def test_a_join_launcher_on_the_heads_machine_stops_only_what_it_started(head, module_tmp):
    """H1: the join launcher got the head's host id, so its Ctrl-C drained the head's own encoder and decoder too,
    and they never came back."""
    before = {i.id: i.pid for i in head.status().instances if i.state == "ready"}
    joined = join(head, module_tmp, "same-machine", "--model", "payload")
    try:
        wait_until(lambda: any(i.role == "denoiser" and i.state == "ready" for i in head.status().instances),
                   timeout=120, why=joined.output)
        r = post(head, {"prompt": "x", "size": "64x64"}, request_id="reused-1")
        assert r.status_code == 200, r.text
        # M5: the same X-Request-Id with other parameters is refused, not answered with the earlier image
        again = post(head, {"prompt": "a totally different prompt", "size": "128x128"}, request_id="reused-1")
        assert again.status_code == 409 and again.json()["error"]["param"] == "X-Request-Id", again.text
        same = post(head, {"prompt": "x", "size": "64x64"}, request_id="reused-1")
        assert same.status_code == 200 and same.json()["data"] == r.json()["data"]
        # L14: a request the model cannot make is the client's error: 400, not counted against the instance,
        # and one line in the role's log, not a traceback
        bad = post(head, {"prompt": "x", "size": "64x64", "output_format": "webp", "extra_body": {"seed": 1}},
                   request_id="fine")
        assert bad.status_code == 200, bad.text  # webp is fine for an image model
        with Client(head.endpoint) as client:
            [o] = client.run_all([GenerationParams(prompt="x", width=64, height=64, response_format="mp4")])
        assert not o.ok and "FormatError" in o.error
        report = head.status()
        assert report.requests.invalid == 1 and all(i.failed == 0 for i in report.instances), report
        log = next((head.run_dir / "logs").glob("encoder-0*.log")).read_text()
        assert "FormatError" in log and "Traceback" not in log
        assert joined.stop(signal.SIGINT) == 0, joined.output()
    finally:
        joined.stop()
    report = head.status()
    assert {i.id: i.pid for i in report.instances if i.state == "ready"} == before, report.instances
    assert all(i.state == "dead" for i in report.instances if i.role == "denoiser")


@pytest.mark.ends_deployment
def test_stop_host_of_the_heads_own_host_asks_for_yes_then_the_head_ends(head):
    """M7: `stop --host` of a single-host deployment stopped every role without a word, and the head's launcher
    then served nothing forever."""
    host = head.status().orchestrator["host_id"]
    res = disagg("stop", "--endpoint", head.endpoint, "--host", host, timeout=30)
    assert res.returncode == 2 and "runs the orchestrator" in res.stderr and "--yes" in res.stderr, res.stderr
    assert sum(i.state == "ready" for i in head.status().instances) == 2
    res = disagg("stop", "--endpoint", head.endpoint, "--host", host, "--yes", timeout=30)
    assert res.returncode == 0, res.stderr
    assert head.proc.wait(timeout=30) == 0, head.output()
    assert "none is left on any host" in head.output()
    with pytest.raises(Exception):
        with Client(head.endpoint) as client:
            client.run_all([GenerationParams(prompt="x")], timeout_s=2)


# --- the lows with a clear fix, one piece each ---------------------------------------------------


def test_seed_minus_one_means_a_random_seed():
    """L13: `seed: -1`, the usual "random", was a 400."""
    from disagg.transport.wire.messages import params_from_obj

    assert params_from_obj({"prompt": "x", "seed": -1}).seed is None
    with pytest.raises(Exception, match="seed"):
        params_from_obj({"prompt": "x", "seed": -2})


def test_an_unreadable_image_is_named_without_a_python_repr():
    """L4: "cannot identify image file <_io.BytesIO object at 0x7f...>"."""
    from disagg.roles.pipelines.conditioned import InputError, open_image

    with pytest.raises(InputError) as info:
        open_image(b"not an image", "image", "RGB")
    assert str(info.value) == "image: not an image Pillow can read (cannot identify image file)"


def test_version_and_verbose_after_the_command():
    """L5: no --version; `disagg launch -v` was "No such option"."""
    res = disagg("--version", timeout=30)
    assert res.returncode == 0 and res.stdout.startswith("disagg, version "), res.stdout + res.stderr
    res = disagg("status", "-v", "--endpoint", "tcp://127.0.0.1:1", timeout=30)
    assert res.returncode == 3 and "No such option" not in res.stderr, res.stderr


def test_image_urls_open_without_the_key_and_the_scheme_is_case_insensitive():
    """L2: an url answer could not go into an <img> without the API key; `bearer KEY` was refused."""
    from disagg.gateway.app import is_open

    assert is_open("/v1/images/" + "0123456789abcdef" * 2 + "/content") and is_open("/health") and is_open("/")
    assert not is_open("/v1/images/generations") and not is_open("/v1/images/../stats/content")


def test_old_run_folders_are_pruned_but_never_a_live_one(tmp_path):
    """L9: every launch left $TMPDIR/disagg/RUN_ID behind, for ever."""
    from disagg.launcher.runs import RUN_IDLE_S, prune_runs

    old = time.time() - RUN_IDLE_S - 60
    for k in range(25):
        run = tmp_path / f"{k:08x}"
        (run / "logs").mkdir(parents=True)
        (run / "logs" / "orchestrator.log").write_text("x")
        when = old + k if k != 3 else time.time()  # run 3 is still being written to
        os.utime(run / "logs" / "orchestrator.log", (when, when))
        os.utime(run, (when, when))
    (tmp_path / "not-a-run").mkdir()
    removed = prune_runs(tmp_path, keep=20)
    assert sorted(r.name for r in removed) == [f"{k:08x}" for k in (0, 1, 2, 4, 5)]
    assert (tmp_path / "00000003").exists() and (tmp_path / "not-a-run").exists()
