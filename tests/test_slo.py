"""Deadlines and priorities on the orchestrator's side (disagg/orchestrator/scheduling/deadlines.py), on a fake clock: queue order,
admission, shedding, what Run, RequestStates and status carry; and the trace pieces of `disagg bench`."""

from __future__ import annotations

import json

import pytest

from benchmarks.traces.mixed import generate
from disagg.launcher.bench.trace import TraceError, label, load_trace
from disagg.roles.pipelines.sim_profile import load_profile
from disagg.settings.sections import ScheduleSettings
from disagg.transport.wire.messages import Done, ErrorCode, Rejected, RequestQuery, StatusQuery
from tests.test_router import Harness, runs, staged


def measured(h, rid="m", steps=10, width=512, height=512, device_s=(0.02, 1.0, 0.05)):
    """Run one request through, its stages reporting these device times: the predictor learns them."""
    [(enc, _)] = runs(h.submit(rid, width=width, height=height, num_inference_steps=steps))
    s = staged(enc, rid)
    s.device_s = device_s[0]
    [(den, _)] = runs(h.role(enc, s))
    s = staged(den, rid, offset=512)
    s.device_s = device_s[1]
    [(dec, _)] = runs(h.role(den, s))
    h.role(dec, Done(request_id=rid, attempt=1, num_images=1, compute_s=0.05, device_s=device_s[2]))


def finish(h, rid, offset):
    """Take a request whose encoder run was sent through its denoiser and decoder."""
    enc = h.router.requests[rid].assigned
    [(den, _)] = [r for r in runs(h.role(enc, staged(enc, rid, offset=offset))) if r[1].request_id == rid]
    [(dec, _)] = [r for r in runs(h.role(den, staged(den, rid, offset=offset + 512))) if r[1].request_id == rid]
    h.role(dec, Done(request_id=rid, attempt=1, num_images=1, compute_s=0.05))


def test_queues_order_by_priority_then_least_slack_and_fifo_keeps_arrival_order():
    for schedule, want in (("slo", ["urgent", "tight", "roomy", "none"]), ("fifo", ["none", "roomy", "tight", "urgent"])):
        h = Harness(schedule=ScheduleSettings(order=schedule))
        h.add("encoder"), h.add("denoiser"), h.add("decoder")
        measured(h)
        [(enc, _)] = runs(h.submit("busy", width=512, height=512, num_inference_steps=10))  # takes the one slot
        h.submit("none", width=512, height=512, num_inference_steps=10)
        h.submit("roomy", width=512, height=512, num_inference_steps=10, slo_ms=60_000)
        h.submit("tight", width=512, height=512, num_inference_steps=10, slo_ms=3_000)
        h.submit("urgent", width=512, height=512, num_inference_steps=10, priority=5)
        order = []
        out = h.role(enc, staged(enc, "busy"))
        for _ in range(4):
            [(enc, run)] = [r for r in runs(out) if r[0].startswith("encoder")]
            order.append(run.request_id)
            out = h.role(enc, staged(enc, run.request_id, offset=1024 * len(order)))
        assert order == want, schedule


def test_a_request_that_cannot_make_its_deadline_goes_after_those_that_can():
    h = Harness(schedule=ScheduleSettings(order="slo"))
    h.add("encoder"), h.add("denoiser"), h.add("decoder")
    measured(h)  # ~1.07 s alone at 512^2 x 10 steps
    [(enc, _)] = runs(h.submit("busy", width=512, height=512, num_inference_steps=10))
    h.submit("hopeless", width=512, height=512, num_inference_steps=10, slo_ms=500)
    h.submit("feasible", width=512, height=512, num_inference_steps=10, slo_ms=5_000)
    [(_, run)] = [r for r in runs(h.role(enc, staged(enc, "busy"))) if r[0].startswith("encoder")]
    assert run.request_id == "feasible"
    assert run.stage_deadline_s == pytest.approx(5.0 - 1.0 - 0.05, abs=1e-6)  # the later stages' time left out


def test_a_request_with_a_deadline_goes_where_it_gets_the_device_soonest():
    """Two denoisers with a free slot each: one holds an urgent request, the other a roomy one. Under slo a new
    urgent request joins the roomy one (it takes the device at the next step); max-free-slots alone would not
    know the difference."""
    for trial in range(2):  # the roomy request on either instance: the choice follows it, not an id order
        h = Harness(schedule=ScheduleSettings(order="slo"))
        [enc] = h.add("encoder", capacity=8)
        h.add("denoiser", 2, capacity=2)
        h.add("decoder")
        measured(h)  # 0.1 s a step at 512^2
        first, second = ("roomy", "tight") if trial == 0 else ("tight", "roomy")
        budget = {"roomy": dict(num_inference_steps=30, slo_ms=60_000), "tight": dict(num_inference_steps=10, slo_ms=2_500)}
        where = {}
        for k, rid in enumerate((first, second)):
            runs(h.submit(rid, width=512, height=512, **budget[rid]))
            [(den, _)] = [r for r in runs(h.role(enc, staged(enc, rid, offset=1024 * k))) if r[1].request_id == rid]
            where[rid] = den
            h.now += 0.1
        assert where["roomy"] != where["tight"]
        runs(h.submit("next", width=512, height=512, num_inference_steps=10, slo_ms=2_500))
        [(den, _)] = [r for r in runs(h.role(enc, staged(enc, "next", offset=4096))) if r[1].request_id == "next"]
        assert den == where["roomy"], trial


def test_a_resumed_request_keeps_the_deadline_of_its_first_arrival():
    """A restarted orchestrator hears of a request again from its client, with its age: the deadline still
    counts from the first Submit."""
    from disagg.transport.wire.messages import GenerationParams, Submit
    from tests.test_router import CLIENT

    h = Harness(schedule=ScheduleSettings(order="slo"))
    h.add("encoder"), h.add("denoiser"), h.add("decoder")
    measured(h)
    params = GenerationParams(prompt="a cat", width=512, height=512, num_inference_steps=10, slo_ms=5_000)
    for rid, age in (("fresh", 0.0), ("resumed", 2.0)):
        h.router.handle_client(CLIENT, Submit(request_id=rid, params=params, resume=age > 0, age_s=age), [], h.now)
        assert h.router.requests[rid].slo_deadline == pytest.approx(h.now + 5.0 - age)


def test_admission_refuses_a_deadline_it_cannot_meet_only_once_it_has_measurements():
    h = Harness(admission="slo")
    h.add("encoder"), h.add("denoiser"), h.add("decoder")
    assert runs(h.submit("early", width=512, height=512, num_inference_steps=10, slo_ms=10))  # nothing known: taken
    h = Harness(admission="slo")
    h.add("encoder"), h.add("denoiser"), h.add("decoder")
    measured(h)
    [out] = h.submit("r1", width=512, height=512, num_inference_steps=10, slo_ms=500)
    assert isinstance(out.msg, Rejected) and out.msg.code == ErrorCode.DEADLINE and out.msg.param == "slo_ms"
    assert "slo_ms 500" in out.msg.reason and "1070 ms" in out.msg.reason, out.msg.reason
    assert "r1" not in h.router.requests
    # another size scales from what was measured: 4x the pixels, twice the steps
    [out] = h.submit("r2", width=1024, height=1024, num_inference_steps=20, slo_ms=5_000)
    assert isinstance(out.msg, Rejected) and "8" in out.msg.reason
    assert runs(h.submit("r3", width=512, height=512, num_inference_steps=10, slo_ms=2_000))
    h.submit("r4", width=512, height=512, num_inference_steps=10)  # no deadline: always taken (queued here)
    assert "r4" in h.router.requests


def test_a_full_queue_sheds_its_lowest_priority_request_for_a_higher_one():
    h = Harness(max_queue=2, schedule=ScheduleSettings(order="slo"))
    h.add("encoder"), h.add("denoiser"), h.add("decoder")
    h.submit("busy")
    h.submit("low", priority=-1)
    h.submit("mid")
    out = h.submit("high", priority=3)
    failed = [o.msg for o in out if getattr(o.msg, "ok", True) is False]
    assert [m.request_id for m in failed] == ["low"] and failed[0].code == ErrorCode.OVERLOADED
    assert "high" in h.router.requests and "low" not in h.router.requests
    [out] = h.submit("same", priority=0)  # nothing lower than it waits: refused as before
    assert isinstance(out.msg, Rejected) and out.msg.code == ErrorCode.OVERLOADED


def test_request_states_and_status_carry_predictions_slack_and_met_missed_counts():
    h = Harness(schedule=ScheduleSettings(order="slo"))
    h.add("encoder"), h.add("denoiser"), h.add("decoder")
    measured(h)
    h.submit("a", width=512, height=512, num_inference_steps=10, slo_ms=4_000, priority=2)
    h.submit("b", width=512, height=512, num_inference_steps=10, slo_ms=2_000)
    [state_out] = h.router.handle_client(b"c", RequestQuery(request_ids=["a", "b"]), [], h.now)
    a, b = state_out.msg.states["a"], state_out.msg.states["b"]
    assert a.finish_in_s == pytest.approx(1.07, abs=0.01) and a.slack_s == pytest.approx(4 - 1.07, abs=0.01)
    assert b.state == "queued" and b.slack_s == pytest.approx(2 - 1.07, abs=0.01)
    report = h.router.handle_client(b"c", StatusQuery(), [], h.now)[0].msg
    assert report.schedule == "slo" and report.queue_slack == {"encoder": pytest.approx(0.93, abs=0.01)}
    # "a" finishes in time, "b" late
    finish(h, "a", 512)
    h.now += 3
    finish(h, "b", 4096)
    report = h.router.handle_client(b"c", StatusQuery(), [], h.now)[0].msg
    by = {c.priority: c for c in report.slo}
    assert (by[2].met, by[2].missed, by[0].met, by[0].missed) == (1, 0, 0, 1)
    assert by[0].slack_s == pytest.approx(-1.0) and by[0].buckets[1] == 1  # slack <= -1 s


def test_traces_are_read_and_checked_and_the_generator_mixes_its_classes(tmp_path):
    lines = generate(2.0, 400, seed=3)
    assert all(b["t"] >= a["t"] for a, b in zip(lines, lines[1:]))
    counts = {}
    for line in lines:
        counts[line.get("num_frames", 0), line["num_inference_steps"]] = counts.get((line.get("num_frames", 0), line["num_inference_steps"]), 0) + 1
    assert 0.4 < counts[0, 4] / 400 < 0.6 and 0.3 < counts[0, 28] / 400 < 0.5 and 0.05 < counts[33, 30] / 400 < 0.16
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines[:5]) + "\n")
    got = load_trace(str(path))
    assert len(got) == 5 and label(got[0]) in ("512x512/4", "1024x1024/28", "832x480x33f/30")
    path.write_text('{"t": 0, "width": 1000, "height": 512}\n')
    with pytest.raises(TraceError, match="t.jsonl:1.*width"):
        load_trace(str(path))
    path.write_text('{"t": 0, "colour": "red"}\n')
    with pytest.raises(TraceError, match="colour"):
        load_trace(str(path))


def test_the_video_profile_meets_its_measurements_and_the_mixed_one_uses_it_for_videos():
    wan = load_profile("wan-h200")
    for frames, step_ms, decode_ms in ((33, 176, 740), (81, 611, 1820)):
        prof, px = load_profile("mixed-h200").for_request({"width": 832, "height": 480, "num_frames": frames})
        assert prof is wan
        assert prof.denoiser.step_ms(px) == pytest.approx(step_ms, rel=0.01)
        assert prof.decoder.fixed_ms(px) == pytest.approx(decode_ms, rel=0.05)
    prof, px = load_profile("mixed-h200").for_request({"width": 1024, "height": 1024})
    assert prof.denoiser.step_ms(px) == pytest.approx(170, abs=0.5)


def test_a_queue_in_urgency_order_is_not_ranked_again_and_aging_and_priorities_still_reorder_it():
    """order_queue re-ranked every waiting request after every message (issue 45): with 500 waiting, a request
    through the encoder now ranks none of them, while priorities and aging reorder the queue as before."""
    h = Harness(schedule=ScheduleSettings(order="slo", aging_s=10.0))
    [enc] = h.add("encoder")
    h.add("denoiser"), h.add("decoder")
    ranked = []
    urgency = h.router.deadlines.urgency
    h.router.deadlines.urgency = lambda req, now: ranked.append(req.id) or urgency(req, now)
    [(_, run)] = runs(h.submit("r0"))
    for k in range(1, 500):
        h.submit(f"r{k}")
    order = []

    def next_run():
        nonlocal run
        ranked.clear()
        out = h.role(enc, staged(enc, run.request_id, offset=256 * len(order)))
        [(_, run)] = [r for r in runs(out) if r[0] == enc]
        order.append(run.request_id)
        return len(ranked)

    h.now += 1.0
    assert next_run() == 499  # sorted once
    assert [next_run() for _ in range(3)] == [0, 0, 0]  # and known to be in order since
    h.now += 4.0
    h.submit("b1", priority=1), h.submit("b2", priority=1)  # more urgent than the last: ranked again
    h.now += 1.0
    assert next_run() > 0
    h.now += 5.0  # r5 and on waited 11 s: one priority up, as b2, and they came first
    next_run()
    assert order == ["r1", "r2", "r3", "r4", "b1", "r5"]
