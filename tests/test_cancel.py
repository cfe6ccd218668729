"""Cancellation end to end (real processes, sim:flux-h200: a 1024² step takes 170 ms): a Cancel from a
ZeroMQ client, an HTTP client that hangs up, and Ctrl-C of `disagg submit`. Each gives the slots back,
leaves nothing queued and sends no result."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import httpx
import pytest
import zmq

from disagg.client import Client
from tests.conftest import launch_with_http, popen_cli, wait_until
from disagg.transport.wire.messages import Cancel, GenerationParams, Result, ServerReply, Submit, decode, encode

pytestmark = pytest.mark.e2e

SLOW = dict(width=1024, height=1024, num_inference_steps=28)


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


def denoiser(report):
    return next(i for i in report.instances if i.role == "denoiser")


def all_free(dep) -> bool:
    r = status(dep)
    return (all(i.free_slots == i.capacity for i in r.instances) and not any(r.queues.values())
            and r.requests.in_flight == 0)


def test_a_cancel_while_denoising_frees_the_slot_within_a_step_and_sends_no_result(sim):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sim.endpoint)
    before = status(sim).requests.cancelled
    sock.send_multipart([encode(Submit(request_id="cancel-me", params=GenerationParams(prompt="slow", **SLOW)))])
    wait_until(lambda: denoiser(status(sim)).free_slots == 1, timeout=10, step=0.01)  # one of its 2 slots: denoising
    time.sleep(0.5)  # a few steps in
    t0 = time.monotonic()
    sock.send_multipart([encode(Cancel(request_id="cancel-me"))])
    wait_until(lambda: denoiser(status(sim)).free_slots == 2, timeout=10, step=0.01)
    freed_s = time.monotonic() - t0
    print(f"cancel -> denoiser slot free: {freed_s * 1000:.0f} ms (one step: 170 ms)")
    assert freed_s <= 0.3
    assert all_free(sim) and status(sim).requests.cancelled == before + 1
    time.sleep(5.0)  # the 28 steps would have ended by now: nothing may arrive
    while sock.poll(0):
        reply = decode(sock.recv_multipart()[0], ServerReply)
        assert not (isinstance(reply, Result) and reply.request_id == "cancel-me"), reply
    sock.close()


def test_an_http_client_that_hangs_up_cancels_its_request(sim):
    before = status(sim).requests.cancelled
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sim.http + "/v1/images/generations", json={"prompt": "slow", "size": "1024x1024",
                                                              "num_inference_steps": 28}, timeout=1.5)
    wait_until(lambda: all_free(sim), timeout=2.0, step=0.01)
    assert status(sim).requests.cancelled == before + 1


def test_ctrl_c_of_submit_cancels_what_it_had_in_flight(sim, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"slow {k}", **SLOW}) for k in range(6)))
    before = status(sim).requests
    proc = popen_cli("submit", str(prompts), "--endpoint", sim.endpoint, "--out", str(tmp_path / "out"),
                     "--concurrency", "3", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: status(sim).requests.in_flight == 3, timeout=15, step=0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, out + err
    wait_until(lambda: all_free(sim), timeout=2.0, step=0.01)
    after = status(sim).requests
    assert after.cancelled == before.cancelled + 3 and after.completed == before.completed


def test_a_cancel_mid_interleave_stops_the_request_waiting_for_the_device_at_once(sim):
    """schedule slo (the default): a long request yields the denoiser to an urgent one and waits; cancelling it
    then frees its slot without waiting for the device, and the urgent one finishes."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sim.endpoint)
    sock.send_multipart([encode(Submit(request_id="long-one", params=GenerationParams(prompt="slow", **SLOW)))])
    wait_until(lambda: denoiser(status(sim)).free_slots == 1, timeout=10, step=0.01)
    time.sleep(0.3)  # a step or two in
    urgent = GenerationParams(prompt="urgent", width=1024, height=1024, num_inference_steps=12, priority=5)
    sock.send_multipart([encode(Submit(request_id="urgent-one", params=urgent))])
    wait_until(lambda: denoiser(status(sim)).free_slots == 0, timeout=10, step=0.01)
    time.sleep(0.5)  # the urgent one holds the device; the long one waits for it
    t0 = time.monotonic()
    sock.send_multipart([encode(Cancel(request_id="long-one"))])
    wait_until(lambda: denoiser(status(sim)).free_slots == 1, timeout=10, step=0.01)
    freed_s = time.monotonic() - t0
    print(f"cancel of a waiting request -> slot free: {freed_s * 1000:.0f} ms (the urgent one's 12 steps: 2 s)")
    assert freed_s <= 0.5
    deadline = time.monotonic() + 15
    result = None
    while time.monotonic() < deadline and result is None:
        if sock.poll(100):
            reply = decode(sock.recv_multipart()[0], ServerReply)
            if isinstance(reply, Result):
                assert reply.request_id == "urgent-one", reply
                result = reply
    assert result is not None and result.ok, result
    wait_until(lambda: all_free(sim), timeout=10)
    sock.close()
