"""Cancellation: a role's compute stops at the next denoising step (a unit test of its runner), and end to end (real
processes, sim:flux-h200: a 1024² step takes 170 ms) a Cancel from a ZeroMQ client, an HTTP client that hangs up,
and Ctrl-C of `disagg submit`. Each gives the slots back, leaves nothing queued and sends no result.

The end-to-end verdicts are in steps and the roles' own counters, not in the real clock: a test waits for the
request's steps to be reported (the denoiser's heartbeat) rather than sleeping until it is "a few steps in", and
shows that the denoiser stopped by its `computed` count (a stage it finished adds one; a cancelled one none) and by
the request still having steps to go when its slot came back."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import httpx
import pytest
import torch
import zmq

from disagg.client import Client
from disagg.roles.compute import StageRunner
from disagg.roles.pipelines.adapter import Capabilities
from disagg.roles.stage import Stage
from disagg.transport.data.pool import Pool
from disagg.transport.wire.bundle import decode_frames
from disagg.transport.wire.messages import (
    Cancel,
    ErrorCode,
    Failed,
    GenerationParams,
    RequestQuery,
    Result,
    Run,
    ServerReply,
    Staged,
    Submit,
    encode,
)
from tests.conftest import heard_from_all, launch_with_http, popen_cli, wait_until

#: steps enough that the request is still denoising however late (under load) the test sends its Cancel: 34 s
LONG = dict(width=1024, height=1024, num_inference_steps=200)
QUICK = dict(width=256, height=256, num_inference_steps=2)


class CountedSteps:
    """A denoiser whose steps a test counts; `during(k)` runs while step k computes (where a Cancel arrives)."""

    capabilities = Capabilities()

    def __init__(self, during):
        self.during = during
        self.ran: list[int] = []

    @staticmethod
    def defaults() -> dict:
        return dict(width=8, height=8, num_inference_steps=28, num_images_per_prompt=1, seed=0)

    def encode(self, p):
        raise AssertionError("a denoiser only denoises")

    def denoise(self, inputs, p, progress=None):
        for k in range(1, p["num_inference_steps"] + 1):
            self.ran.append(k)
            self.during(k)
            progress({"x": torch.zeros(1)})
        return {"x": torch.zeros(1)}

    def decode(self, inputs, p):
        raise AssertionError("a denoiser only denoises")

    def components_loaded(self):
        return {}


def counted_run(cancel_in_step: int | None):
    """One 28-step request on a denoiser's runner; the Cancel (if any) arrives while step `cancel_in_step` computes.
    (the adapter, the runner, what it reported)"""
    reports = []
    pool = Pool("test-pool", 4096)
    pool.buffer = torch.zeros(4096, dtype=torch.uint8)
    runner = StageRunner("denoiser-0", pool, {}, lambda msg, *frames: reports.append(msg))
    adapter = CountedSteps(lambda k: k == cancel_in_step and runner.cancel("r1", 2))
    runner.stage = Stage("denoiser", adapter, model="counted")
    runner.execute(Run(request_id="r1", attempt=2, params=GenerationParams(prompt="p", num_inference_steps=28)), [], 0.0)
    assert reports[-1] is None  # the compute's end: its slot is free
    assert runner.busy == {} and runner.steps == {} and runner.cancelled == {}
    return adapter, runner, [m for m in reports if m is not None]


@pytest.mark.parametrize("cancel_in_step", [1, 5, 27])
def test_a_cancel_stops_the_compute_at_the_next_step_and_frees_its_slot(cancel_in_step):
    """No clock: the Cancel arrives while step k computes; step k is the last that runs, the runner reports the
    request cancelled (not retryable), stages nothing and counts no stage computed."""
    adapter, runner, [failed] = counted_run(cancel_in_step)
    assert adapter.ran == list(range(1, cancel_in_step + 1))
    assert isinstance(failed, Failed) and (failed.code, failed.retryable) == (ErrorCode.CANCELLED, False)
    assert runner.computed == 0 and not runner.staged


def test_an_uncancelled_compute_runs_every_step():
    """The same run without a Cancel: all 28 steps, its output staged and counted (what the test above tells apart)."""
    adapter, runner, [staged] = counted_run(None)
    assert adapter.ran == list(range(1, 29))
    assert isinstance(staged, Staged) and runner.computed == 1


@pytest.fixture(scope="module")
def sim(module_tmp):
    dep = launch_with_http(["--model", "sim:flux-h200", "-d", "1", "--capacity", "1,2,1", "--no-dashboard"], module_tmp)
    try:
        dep.wait_ready(3)
        yield dep
    finally:
        dep.stop()


def status(dep):
    with Client(dep.endpoint) as client:
        return client.status(timeout_s=5)


def role(report, name):
    return next(i for i in report.instances if i.role == name)


def denoiser(report):
    return role(report, "denoiser")


def all_free(dep) -> bool:
    r = status(dep)
    return (all(i.free_slots == i.capacity for i in r.instances) and not any(r.queues.values())
            and r.requests.in_flight == 0)


def where(dep, request_id: str):
    """The orchestrator's RequestState of one request: queued or running, its stage, its denoiser's steps."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(dep.endpoint)
    try:
        sock.send_multipart([encode(RequestQuery(request_ids=[request_id]))])
        assert sock.poll(5000), "no answer to a RequestQuery"
        [(states, _)] = decode_frames(sock.recv_multipart(), ServerReply)
        return states.states[request_id]
    finally:
        sock.close()


def denoising(dep, request_id: str, at_least: int = 1):
    """Its RequestState once its denoiser reports it has done `at_least` steps (heartbeats: about once a second)."""
    def state():
        s = where(dep, request_id)
        return s if s.state == "running" and s.stage == "denoiser" and s.step >= at_least else None

    return wait_until(state, timeout=20, step=0.05, why=lambda: where(dep, request_id))


def counters(dep):
    """The status once every role has spoken since now: its counters include what each finished until now (a role
    sends them in its heartbeat, about once a second)."""
    heard_from_all(dep.endpoint)
    return status(dep)


def stopped_short(before, after) -> None:
    """Between the two: the denoiser and the decoder finished no stage (their own `computed` counts; a cancelled
    compute adds nothing) and no request completed: what was cancelled stopped before its steps ended."""
    def finished(report):
        return {i.role: i.computed for i in report.instances if i.role != "encoder"}

    assert finished(after) == finished(before), "a role finished a stage of a cancelled request"
    assert after.requests.completed == before.requests.completed


def replies_until_result(sock, request_id: str, timeout: float = 60) -> list:
    """What the orchestrator sent this socket, in order, up to and including `request_id`'s Result."""
    got = []

    def arrived():
        while sock.poll(0):
            got.extend(reply for reply, _ in decode_frames(sock.recv_multipart(), ServerReply))
        return any(isinstance(r, Result) and r.request_id == request_id for r in got)

    wait_until(arrived, timeout=timeout, step=0.05, why=lambda: got)
    return got


def dealer(dep):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(dep.endpoint)
    return sock


@pytest.mark.e2e
def test_a_cancel_while_denoising_frees_the_slot_before_its_steps_end_and_sends_no_result(sim):
    sock = dealer(sim)
    sock.send_multipart([encode(Submit(request_id="cancel-me", params=GenerationParams(prompt="slow", **LONG)))])
    running = denoising(sim, "cancel-me")  # some of its steps done: it is mid-denoise
    before = counters(sim)
    assert denoiser(before).free_slots == 1  # one of its 2 slots: this request's
    t0 = time.monotonic()
    sock.send_multipart([encode(Cancel(request_id="cancel-me"))])
    wait_until(lambda: denoiser(status(sim)).free_slots == 2, timeout=20, step=0.01)
    # for BENCHMARKS.md (Cancellation), not the verdict: a loaded machine's clock says nothing of the code
    print(f"cancel at step >= {running.step} of {running.steps} -> denoiser slot free: "
          f"{(time.monotonic() - t0) * 1000:.0f} ms (one step: 170 ms)")
    after = counters(sim)
    stopped_short(before, after)  # the denoiser stopped: it never finished its 200 steps
    assert running.steps == 200 and running.step < 200
    assert all_free(sim) and after.requests.cancelled == before.requests.cancelled + 1
    # the orchestrator answers this socket in order: whatever it sent for cancel-me comes before the next Result
    sock.send_multipart([encode(Submit(request_id="after-cancel", params=GenerationParams(prompt="q", **QUICK)))])
    replies = replies_until_result(sock, "after-cancel")
    assert not [r for r in replies if getattr(r, "request_id", None) == "cancel-me"], replies
    sock.close()


@pytest.mark.e2e
def test_an_http_client_that_hangs_up_cancels_its_request(sim):
    before = counters(sim)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up mid-request (1.5 s of its 28 steps' 4.8 s)
        httpx.post(sim.http + "/v1/images/generations", json={"prompt": "slow", "size": "1024x1024",
                                                              "num_inference_steps": 28}, timeout=1.5)
    wait_until(lambda: all_free(sim), timeout=20, step=0.01)
    after = counters(sim)
    stopped_short(before, after)  # stopped, not run to its end
    assert after.requests.cancelled == before.requests.cancelled + 1


@pytest.mark.e2e
def test_ctrl_c_of_submit_cancels_what_it_had_in_flight(sim, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"slow {k}", **LONG}) for k in range(6)))
    before = counters(sim)
    proc = popen_cli("submit", str(prompts), "--endpoint", sim.endpoint, "--out", str(tmp_path / "out"),
                     "--concurrency", "3", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: status(sim).requests.in_flight == 3, timeout=15, step=0.01)
    wait_until(lambda: denoiser(status(sim)).free_slots == 0, timeout=15, step=0.01)  # two of them denoising
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, out + err
    wait_until(lambda: all_free(sim), timeout=20, step=0.01)
    after = counters(sim)
    stopped_short(before, after)
    assert after.requests.cancelled == before.requests.cancelled + 3


@pytest.mark.e2e
def test_a_cancel_mid_interleave_stops_the_request_waiting_for_the_device_at_once(sim):
    """schedule slo (the default): a long request yields the denoiser to an urgent one and waits; cancelling it
    then frees its slot without waiting for the device: while the urgent one still denoises. The urgent one
    finishes."""
    sock = dealer(sim)
    sock.send_multipart([encode(Submit(request_id="long-one", params=GenerationParams(prompt="slow", **LONG)))])
    denoising(sim, "long-one")
    # 48 steps (8 s): still denoising however late the test sees its slot come back
    urgent = GenerationParams(prompt="urgent", width=1024, height=1024, num_inference_steps=48, priority=5)
    sock.send_multipart([encode(Submit(request_id="urgent-one", params=urgent))])
    denoising(sim, "urgent-one")  # it holds the device; the long one waits for it
    before = status(sim)
    assert denoiser(before).free_slots == 0
    t0 = time.monotonic()
    sock.send_multipart([encode(Cancel(request_id="long-one"))])
    wait_until(lambda: denoiser(status(sim)).free_slots == 1, timeout=20, step=0.01)
    freed_ms = (time.monotonic() - t0) * 1000  # printed, not the verdict
    still = where(sim, "urgent-one")
    print(f"cancel of a waiting request -> slot free: {freed_ms:.0f} ms, the urgent one at step >= {still.step} of "
          f"{still.steps}")
    assert (still.state, still.stage) == ("running", "denoiser"), f"the slot waited for the urgent one: {still}"
    assert status(sim).requests.cancelled == before.requests.cancelled + 1
    replies = replies_until_result(sock, "urgent-one")
    results = [r for r in replies if isinstance(r, Result)]
    assert [r.request_id for r in results] == ["urgent-one"] and results[0].ok, results
    wait_until(lambda: all_free(sim), timeout=20)
    sock.close()
