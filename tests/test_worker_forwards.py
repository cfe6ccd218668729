"""Forwards between two real role workers (disagg/roles/peers.py) over their real peer lanes and shared-memory pools, with
no orchestrator: the producer reports its Staged, then sends the next Run on; the consumer runs a Forward only for its
registration, never one withdrawn first; one that cannot be sent on goes to the orchestrator."""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest
import zmq

from disagg.roles.pipelines.payload import PayloadAdapter
from disagg.roles.spec import WorkerSpec
from disagg.roles.stage import Stage
from disagg.roles.worker import Worker
from disagg.transport.data.pool import make_pool
from disagg.transport.data.shm import remove_segments
from disagg.transport.wire.bundle import decode_frames
from disagg.transport.wire.messages import (
    ErrorCode,
    Failed,
    Forward,
    GenerationParams,
    PoolInfo,
    Registered,
    RoleMessage,
    Run,
    SlotRef,
    Source,
    Staged,
    Withdraw,
)
from tests.test_worker_staged import sent


def worker(role: str, made: list) -> Worker:
    """A registered worker of `role` on its own pool; [worker, pool name] goes into `made` first, for the clean-up."""
    name = f"disagg-test-{uuid.uuid4().hex[:8]}"
    entry = [None, name]
    made.append(entry)
    w = entry[0] = Worker(WorkerSpec(role=role, instance_id=f"{role}-0", endpoint="tcp://127.0.0.1:1", model="payload",
                                     transfer="shm"), lambda: None, make_pool(name, 1 << 20, "cpu"))
    w.connect()
    w.handle_registered(Registered(session=3, heartbeat_interval_s=1.0, orchestrator_id="orch"), [])
    w.runner.stage = Stage(role, PayloadAdapter(role))
    w.runner.recent.extend([1e-6] * w.runner.recent.maxlen)  # short computes: run on the loop thread, as a test can
    w.poller = zmq.Poller()
    w.poller.register(w.peers.fileno(), zmq.POLLIN)
    sent(w)  # its Register
    return w


@pytest.fixture
def pair():
    made: list = []
    try:
        yield worker("encoder", made), worker("denoiser", made)
    finally:
        for w, name in made:
            if w is not None:
                w.close()
            remove_segments(name)


def forward_for(den: Worker, enc: Worker, rid: str = "r1", attempt: int = 1, session: int = 3) -> Forward:
    pool = PoolInfo(host_id="h", engines=["shm"], pool_name=enc.pool.name, pool_bytes=enc.pool.nbytes)
    run = Run(request_id=rid, attempt=attempt, params=GenerationParams(prompt="p", width=16, height=16, seed=1),
              source=Source(slot=SlotRef(instance_id="encoder-0", offset=0, nbytes=0, tensors=[]), pool=pool, engine="shm"))
    return Forward(instance_id="denoiser-0", lane=den.peers.path, orchestrator_id="orch", session=session, run=run)


def serve_peers(w: Worker, until) -> list:
    """Run `w`'s peer side of its loop until `until(messages sent)` holds; what it sent."""
    got, deadline = [], time.monotonic() + 10
    while not until(got):
        assert time.monotonic() < deadline, got
        w.drain_peers(dict(w.poller.poll(100)))
        got += sent(w)
    return got


def test_the_producer_reports_then_sends_the_next_run_on_and_the_consumer_runs_it(pair):
    enc, den = pair
    fwd = forward_for(den, enc)
    enc.runner.execute(Run(request_id="r1", attempt=1, params=fwd.run.params, then=fwd), [], time.perf_counter())
    [staged] = sent(enc)  # what left first, at the end of the turn: the Staged that says it went on
    assert isinstance(staged, Staged) and staged.forwarded and enc.pending_forwards
    enc.send_forwards()
    assert not enc.pending_forwards and sent(enc) == []
    [out] = serve_peers(den, lambda got: got)
    assert isinstance(out, Staged) and out.request_id == "r1" and out.fetch_s is not None  # it pulled the slot
    assert den.runner.computed == 1


def test_a_forward_for_another_registration_or_withdrawn_first_is_not_run(pair):
    enc, den = pair
    stale = forward_for(den, enc, "r1", session=2)  # made for its registration before this one
    enc.runner.execute(Run(request_id="r0", attempt=1, params=stale.run.params), [], time.perf_counter())
    [staged] = sent(enc)
    slot = staged.slot  # an encoder's output: what each Forward below reads
    den.handle_withdraw(Withdraw(request_id="r2", attempt=1), [])
    [answer] = sent(den)
    assert isinstance(answer, Failed) and answer.code == ErrorCode.CANCELLED and answer.request_id == "r2"
    for fwd in (stale, forward_for(den, enc, "r2")):
        fwd.run.source.slot = slot
        assert enc.peers.send(fwd)
    probe = forward_for(den, enc, "r3")
    probe.run.source.slot = slot
    assert enc.peers.send(probe)  # runs: the two before it were read and dropped
    got = serve_peers(den, lambda got: got)
    assert [(type(m).__name__, m.request_id) for m in got] == [("Staged", "r3")] and den.runner.computed == 1


def test_a_forward_that_cannot_be_sent_on_goes_to_the_orchestrator(pair):
    enc, den = pair
    fwd = msgspec.structs.replace(forward_for(den, enc), lane=den.peers.path + ".gone")
    enc.runner.execute(Run(request_id="r1", attempt=1, params=fwd.run.params, then=fwd), [], time.perf_counter())
    [staged] = sent(enc)
    frames = []
    enc.send_frames = frames.append  # what leaves for the orchestrator
    enc.send_forwards()
    [(relayed, _)] = [item for f in frames for item in decode_frames(f, RoleMessage)]
    assert isinstance(relayed, Forward) and relayed.run.source.slot == staged.slot


def test_a_lane_to_an_instance_that_went_away_is_forgotten(pair):
    enc, den = pair
    fwd = forward_for(den, enc)
    assert enc.peers.send(fwd) and fwd.lane in enc.peers.outbound
    den.peers.close()  # its process ended: the listener and the lanes to it are gone
    sends = [enc.peers.send(fwd) for _ in range(2)]
    assert sends[-1] is False and fwd.lane not in enc.peers.outbound
