"""Forwards (disagg/orchestrator/forwards.py) on the Router's fake clock: a stage's instance sends the next stage's Run
on itself; reservations, reports that overtake their producer's, withdrawals and relays. No sockets, no processes."""

import msgspec

from disagg.settings.sections import ForwardSettings
from disagg.transport.wire.messages import Cancel, Done, Failed, Forward, Release, Result, Run, Withdraw
from tests.router_harness import CLIENT, Harness, runs, staged

FAST = 1e-4  # a stage's compute_s: far below forward.max_wait_ms


def fast(iid, rid, attempt=1, offset=0, forwarded=False, fetch_s=None):
    return msgspec.structs.replace(staged(iid, rid, attempt, offset), compute_s=FAST, forwarded=forwarded,
                                   fetch_s=fetch_s)


def done(rid, attempt=1):
    return Done(request_id=rid, attempt=attempt, num_images=1, compute_s=FAST, fetch_s=FAST)


def deployment(capacity=2, **cfg):
    """1:1:1 on one host, each taking Forwards, with its stage times measured by one request the orchestrator placed
    itself (none are measured before it: nothing is forwarded)."""
    h = Harness(**cfg)
    for role in ("encoder", "denoiser", "decoder"):
        h.add(role, capacity=capacity, peer_lane=True)
    [(enc, run)] = runs(h.submit("warm"))
    assert run.then is None
    [(den, _)] = runs(h.role(enc, fast(enc, "warm")))
    [(dec, _)] = runs(h.role(den, fast(den, "warm", fetch_s=FAST)))
    assert [o.msg.ok for o in h.role(dec, done("warm"), [b"png"]) if isinstance(o.msg, Result)] == [True]
    return h


def free(h, iid):
    return h.router.registry.get(iid).free_slots


def sent(out, kind):
    return [(o.to_instance, o.msg) for o in out if isinstance(o.msg, kind)]


def test_each_stage_sends_the_next_run_on_and_the_orchestrator_sends_none():
    h = deployment()
    [(enc, run)] = runs(h.submit("r1"))
    fwd = run.then
    assert (fwd.instance_id, fwd.run.then.instance_id) == ("denoiser-0", "decoder-0")
    den = h.router.registry.get("denoiser-0")
    assert fwd.session == den.session and fwd.orchestrator_id == h.router.id and fwd.lane == den.peer_lane
    assert fwd.run.source.slot.instance_id == enc and fwd.run.source.engine == "shm"
    assert free(h, "denoiser-0") == free(h, "decoder-0") == 1  # reserved
    out = h.role(enc, fast(enc, "r1", forwarded=True))
    assert runs(out) == [] and h.router.requests["r1"].assigned == "denoiser-0"
    out = h.role("denoiser-0", fast("denoiser-0", "r1", forwarded=True, fetch_s=FAST))
    assert runs(out) == [] and sent(out, Release) == [(enc, Release(request_id="r1", offset=0))]
    out = h.role("decoder-0", done("r1"), [b"png"])
    [res] = [o for o in out if isinstance(o.msg, Result)]
    assert res.to_client == CLIENT and res.msg.ok and res.frames == [b"png"]
    assert "queue_denoiser" in res.msg.timings and "stage_decoder" in res.msg.timings
    assert h.router.reservations == {} and all(i.free_slots == i.capacity for i in h.router.registry.alive())
    assert h.router.snapshot(h.now).orchestrator["forwarded"] == 2


def test_a_stage_that_sent_nothing_on_leaves_the_next_to_the_orchestrator():
    h = deployment()
    [(enc, run)] = runs(h.submit("r1"))
    assert run.then is not None
    out = h.role(enc, fast(enc, "r1"))  # e.g. it registered again meanwhile: it forwards nothing
    [(den, run)] = runs(out)
    assert den == "denoiser-0" and run.source.slot.instance_id == enc and sent(out, Withdraw) == []
    # the reservations made with the encoder's Run came back (none was told of them); the decoder's is made again
    assert run.then.instance_id == "decoder-0" and h.router.reservations == {("decoder-0", "r1"): 1}
    assert free(h, "decoder-0") == 1 and free(h, "denoiser-0") == 1


def test_a_report_that_overtakes_its_producers_staged_waits_for_it():
    h = deployment()
    [(enc, _)] = runs(h.submit("r1"))
    assert h.role("denoiser-0", fast("denoiser-0", "r1", forwarded=True, fetch_s=FAST)) == []  # kept
    out = h.role(enc, fast(enc, "r1", forwarded=True))
    assert sent(out, Release) == [(enc, Release(request_id="r1", offset=0))]
    assert h.router.requests["r1"].assigned == "decoder-0"
    assert [o.msg.ok for o in h.role("decoder-0", done("r1"), [b"png"]) if isinstance(o.msg, Result)] == [True]


def test_a_producer_lost_withdraws_what_was_reserved_and_keeps_those_slots_until_answered():
    h = deployment()
    [(enc, _)] = runs(h.submit("r1"))
    h.add("encoder", capacity=2, peer_lane=True)
    out = []
    h.router.lose_instance(h.router.registry.get(enc), "kill -9", h.now, out)
    h.router.dispatch_queued(h.now, out)
    assert sorted(sent(out, Withdraw)) == [("decoder-0", Withdraw(request_id="r1", attempt=1)),
                                           ("denoiser-0", Withdraw(request_id="r1", attempt=1))]
    [(enc2, run)] = runs(out)
    assert enc2 == "encoder-1" and run.attempt == 2
    assert free(h, "denoiser-0") == free(h, "decoder-0") == 1  # attempt 1's, until its instances answer
    for iid in ("denoiser-0", "decoder-0"):
        h.role(iid, Failed(request_id="r1", attempt=1, error="withdrawn by the orchestrator", code="cancelled"))
        h.role(iid, Failed(request_id="r1", attempt=1, error="withdrawn by the orchestrator", code="cancelled"))
    assert free(h, "denoiser-0") == free(h, "decoder-0") == 2  # freed once each, whatever answers twice


def test_a_withdrawn_instance_that_ran_it_anyway_frees_its_slot_and_its_output():
    h = deployment()
    [(enc, _)] = runs(h.submit("r1"))
    h.role("denoiser-0", fast("denoiser-0", "r1", offset=512, forwarded=True))  # kept: overtook the encoder's
    out = h.router.handle_client(CLIENT, Cancel(request_id="r1"), [], h.now)
    assert sorted(iid for iid, _ in sent(out, Withdraw)) == ["decoder-0", "denoiser-0"]
    assert ("denoiser-0", Release(request_id="r1", offset=512)) in sent(out, Release)  # its stale report, handled
    assert free(h, "denoiser-0") == 2 and free(h, "decoder-0") == 1  # the decoder's comes with its answer
    h.role("decoder-0", Failed(request_id="r1", attempt=1, error="withdrawn by the orchestrator", code="cancelled"))
    assert free(h, "decoder-0") == 2 and h.router.reservations == {}


def test_a_forward_its_producer_could_not_send_goes_through_the_orchestrator():
    h = deployment()
    [(enc, run)] = runs(h.submit("r1"))
    h.role(enc, fast(enc, "r1", forwarded=True))
    fwd = msgspec.structs.replace(run.then, run=msgspec.structs.replace(
        run.then.run, source=msgspec.structs.replace(run.then.run.source, slot=staged(enc, "r1").slot)))
    [(den, relayed)] = runs(h.role(enc, fwd))
    assert den == "denoiser-0" and relayed == fwd.run
    stale = msgspec.structs.replace(fwd, run=msgspec.structs.replace(fwd.run, attempt=7))
    assert runs(h.role(enc, stale)) == []


def test_nothing_is_forwarded_where_it_would_not_pay_or_could_not_work():
    h = deployment(capacity=8, forward=ForwardSettings(max_in_flight=2))
    first = [runs(h.submit(f"r{k}"))[0][1] for k in range(3)]
    assert [r.then is not None for r in first] == [True, True, False]  # a third in flight: over max_in_flight
    h = deployment()
    then = runs(h.submit("r1", previews=2))[0][1].then
    assert then.instance_id == "denoiser-0" and then.run.then is None  # its previews come first: the decoder is not
    h = deployment(forward=ForwardSettings(max_wait_ms=0.05))  # the encoder's measured 0.1 ms is over it
    assert runs(h.submit("r1"))[0][1].then is None
    h = deployment(forward=ForwardSettings(max_wait_ms=0))
    assert runs(h.submit("r1"))[0][1].then is None
    h = Harness()
    h.add("encoder", capacity=2, peer_lane=True), h.add("denoiser", capacity=2), h.add("decoder", capacity=2)
    h.router.deadlines.predictor.record("encoder", runs(h.submit("w"))[0][1].params, FAST, 1.0)
    assert runs(h.submit("r1"))[0][1].then is None  # the denoiser takes no Forwards
    h = Harness()
    h.add("encoder", capacity=2, peer_lane=True), h.add("denoiser", capacity=2, peer_lane=True, host="other")
    h.add("decoder", capacity=2, peer_lane=True)
    h.router.deadlines.predictor.record("encoder", runs(h.submit("w"))[0][1].params, FAST, 1.0)
    assert runs(h.submit("r1"))[0][1].then is None  # another host: its input could not be read from there


def test_a_reservation_never_jumps_a_queue():
    h = deployment(capacity=1, forward=ForwardSettings(max_in_flight=100))
    [(enc, run)] = runs(h.submit("r1"))
    assert run.then is not None and run.then.run.then is not None
    [(enc2, run2)] = runs(h.role(enc, fast(enc, "r1", forwarded=True)) + h.submit("r2"))
    assert run2.then is None  # the denoiser is taken: r2 will wait for it in its queue
    assert isinstance(run2, Run) and not isinstance(run2.then, Forward)


def test_a_reserved_instance_lost_before_its_run_came_has_the_next_stage_placed_under_a_new_attempt():
    h = deployment()
    h.add("denoiser", capacity=2, peer_lane=True)
    [(enc, run)] = runs(h.submit("r1"))
    assert run.then.instance_id == "denoiser-0"
    out = []
    h.router.lose_instance(h.router.registry.get("denoiser-0"), "kill -9", h.now, out)
    assert runs(out) == [] and h.router.requests["r1"].attempt == 1  # its encoder still runs it
    out = h.role(enc, fast(enc, "r1", forwarded=True))  # sent on to the dead one
    assert sent(out, Withdraw) == [("decoder-0", Withdraw(request_id="r1", attempt=1))]
    [(den, run)] = runs(out)
    assert den == "denoiser-1" and run.attempt == 2 and run.source.slot.instance_id == enc
    # the decoder's answer to the withdrawal frees attempt 1's slot and changes nothing else
    h.role("decoder-0", Failed(request_id="r1", attempt=1, error="withdrawn by the orchestrator", code="cancelled"))
    assert h.router.requests["r1"].attempt == 2
    assert [o.msg.ok for o in h.role(den, fast(den, "r1", attempt=2, forwarded=True, fetch_s=FAST))
            + h.role("decoder-0", done("r1", attempt=2), [b"png"]) if isinstance(o.msg, Result)] == [True]
    assert all(i.free_slots == i.capacity for i in h.router.registry.alive())
