"""The Router driven by scripted messages and a fake clock: a request's way through the stages, retries, failures,
cancels, admission and stopping. Placement: test_router_placement.py; instances coming and going:
test_router_instances.py. No sockets, no processes."""


import msgspec

from disagg.settings.sections import TimeoutSettings
from disagg.transport.wire.messages import (
    Cancel,
    Done,
    Failed,
    GenerationParams,
    PoolInfo,
    Register,
    Rejected,
    Release,
    Result,
    Shutdown,
    StatusQuery,
    StatusReport,
    Stop,
    Stopping,
    Submit,
)
from tests.router_harness import CLIENT, MC, POOL1, Harness, drive_one, drive_rest, runs, staged  # noqa: F401 - also the harness's home for older imports


def test_full_flow_frees_everything():
    h = Harness()
    h.add("encoder"), h.add("denoiser", 2), h.add("decoder")
    result = drive_one(h)
    assert result.ok and result.seed == 5
    for key in ("queue_encoder", "stage_encoder", "compute_encoder", "queue_denoiser", "fetch_denoiser", "total"):
        assert key in result.timings
    snap = h.router.snapshot(h.now)
    assert snap.requests.completed == 1 and snap.requests.in_flight == 0
    assert all(i.free_slots == i.capacity and i.pool_used_bytes == 0 for i in snap.instances)


def test_retry_budget_then_clear_failure():
    h = Harness(max_retries=2)
    h.add("encoder", 3)
    h.add("denoiser"), h.add("decoder")
    h.submit("r1")
    results = []
    for _ in range(3):
        iid = h.router.requests["r1"].assigned if "r1" in h.router.requests else None
        out = []
        h.router.lose_instance(h.router.registry.get(iid), "kill -9", h.now, out)
        h.router.dispatch_queued(h.now, out)
        results += [o.msg for o in out if isinstance(o.msg, Result)]
    [res] = results
    assert not res.ok and "gave up after 3 attempts" in res.error and "encoder" in res.error and "kill -9" in res.error


def test_retryable_failure_gets_new_attempt():
    h = Harness()
    [enc] = h.add("encoder")
    h.add("denoiser", 2), h.add("decoder")
    h.submit("r1")
    [(den, _)] = runs(h.role(enc, staged(enc, "r1")))
    out = h.role(den, Failed(request_id="r1", attempt=1, error="TransferError: peer gone", retryable=True))
    assert not [o for o in out if isinstance(o.msg, Result)]
    assert h.router.requests["r1"].attempt == 2


def test_an_input_that_could_not_be_pulled_is_not_read_again_the_request_starts_over():
    """A Slurm CI failure: a joining node's processes were killed; before its heartbeats stopped, a decoder's pull
    from its denoiser failed three times in a row (each retry read the same dead pool) and the request gave up. An
    attempt whose input could not be read (Failed.source_lost) starts over from the encoder, the input released."""
    h = Harness()
    [enc] = h.add("encoder", capacity=2)
    [den] = h.add("denoiser")
    h.add("decoder", 2)
    h.submit("r1")
    [(to, _)] = runs(h.role(enc, staged(enc, "r1")))
    [(to, _)] = runs(h.role(den, staged(den, "r1", offset=512)))
    assert to.startswith("decoder")
    out = h.role(to, Failed(request_id="r1", attempt=1, error="TransferError: mooncake read failed", retryable=True,
                            source_lost=True))
    assert [(o.to_instance, o.msg.offset) for o in out if isinstance(o.msg, Release)] == [(den, 512)]
    assert [(iid, h.router.requests["r1"].attempt) for iid, _ in runs(out)] == [(enc, 2)]
    # the same failure without source_lost (a compute that failed after its pull): the decoder again
    h.submit("r2")
    [(to, _)] = runs(h.role(enc, staged(enc, "r2", offset=1024)))
    [(to, _)] = runs(h.role(den, staged(den, "r2", offset=1536)))
    out = h.role(to, Failed(request_id="r2", attempt=1, error="PoolFull: transient", retryable=True))
    assert [iid.split("-")[0] for iid, _ in runs(out)] == ["decoder"]


def test_admission_control_refuses_when_queue_full():
    h = Harness(max_queue=2)
    h.add("encoder")
    h.submit("a")  # running
    h.submit("b"), h.submit("c")  # queued: 2
    out = h.submit("d")
    assert isinstance(out[0].msg, Rejected) and "overloaded" in out[0].msg.reason and "encoder queue" in out[0].msg.reason


def test_drain_finishes_work_then_stops():
    h = Harness()
    [enc] = h.add("encoder")
    h.add("denoiser"), h.add("decoder")
    h.submit("r1")
    out = h.router.handle_client(CLIENT, Stop(drain=True), [], h.now)
    assert [type(o.msg) for o in out] == [Stopping]
    assert h.router.snapshot(h.now).orchestrator["state"] == "draining"
    out = h.submit("r2")
    assert isinstance(out[0].msg, Rejected) and "draining" in out[0].msg.reason
    assert not any(isinstance(o.msg, Shutdown) for o in h.tick())
    result = drive_rest(h, "r1", enc)
    assert result.ok
    assert sum(isinstance(o.msg, Shutdown) for o in h.tick()) == 3 and h.router.stopping


def test_deadline_fails_request_and_quarantines_slot_until_report():
    h = Harness(timeouts=TimeoutSettings(heartbeat=100.0))
    [enc] = h.add("encoder")
    h.add("denoiser"), h.add("decoder")
    h.submit("slow", timeout_s=5.0)
    h.beat_all()
    out = h.tick(6.0)
    [res] = [o.msg for o in out if isinstance(o.msg, Result)]
    assert not res.ok and "timed out" in res.error and "encoder" in res.error
    inst = h.router.registry.get(enc)
    assert inst.free_slots == 0  # still computing for the dead request: quarantined
    out = h.role(enc, staged(enc, "slow"))
    assert [type(o.msg) for o in out] == [Release]  # output nobody wants is released at once
    assert inst.free_slots == 1 and inst.staged == {}


def test_old_attempt_and_foreign_reports_ignored():
    h = Harness()
    [enc] = h.add("encoder")
    [den] = h.add("denoiser")
    h.add("decoder")
    h.submit("r1")
    # a report for an attempt that does not exist changes nothing
    assert runs(h.role(enc, staged(enc, "r1", attempt=7))) == []
    # a report from an instance that does not hold the request changes nothing
    assert h.role(den, Done(request_id="r1", attempt=1, num_images=1)) == []
    assert h.router.requests["r1"].state == "running"


def test_failed_stage_fails_request_with_stage_and_instance():
    h = Harness()
    [enc] = h.add("encoder")
    h.add("denoiser"), h.add("decoder")
    h.submit("r1")
    [(den, _)] = runs(h.role(enc, staged(enc, "r1")))
    out = h.role(den, Failed(request_id="r1", attempt=1, error="TransferError: boom"))
    res = [o.msg for o in out if isinstance(o.msg, Result)][0]
    assert not res.ok and "denoiser denoiser-0" in res.error and "boom" in res.error
    # the encoder's staged slot was never fetched: it is released
    assert any(isinstance(o.msg, Release) and o.to_instance == enc for o in out)


def test_same_request_again_joins_its_run_and_other_parameters_are_refused():
    h = Harness()
    [enc] = h.add("encoder")
    [(_, run)] = runs(h.submit("r1"))
    assert run.params.seed is not None
    assert h.submit("r1") == []  # the same request again (a resubmission): no second run, no error
    other = h.router.handle_client(b"gateway-2", Submit(request_id="r1", params=GenerationParams(prompt="a cat")), [], h.now)
    assert other == [] and h.router.requests["r1"].clients == [CLIENT, b"gateway-2"]
    out = h.submit("r1", prompt="a dog")
    assert isinstance(out[0].msg, Rejected) and "duplicate" in out[0].msg.reason
    # its one Result goes to each client waiting for it
    h.add("denoiser"), h.add("decoder")
    h.role(enc, staged(enc, "r1"))
    h.role("denoiser-0", staged("denoiser-0", "r1"))
    results = [o for o in h.role("decoder-0", Done(request_id="r1", attempt=1, num_images=1), [b"png"]) if isinstance(o.msg, Result)]
    assert sorted(o.to_client for o in results) == [CLIENT, b"gateway-2"]


def test_status_and_stop():
    h = Harness()
    h.add("encoder"), h.add("denoiser"), h.add("decoder")
    [rep] = h.router.handle_client(CLIENT, StatusQuery(), [], h.now)
    [rep] = [o for o in h.router.handle_client(CLIENT, StatusQuery(), [], h.now)]
    assert isinstance(rep.msg, StatusReport) and len(rep.msg.instances) == 3
    assert [i.role for i in rep.msg.instances] == ["encoder", "denoiser", "decoder"]
    out = h.router.handle_client(CLIENT, Stop(), [], h.now)
    assert sum(isinstance(o.msg, Shutdown) for o in out) == 3 and isinstance(out[0].msg, Stopping)
    out = h.submit("late")
    assert isinstance(out[0].msg, Rejected) and "shutting down" in out[0].msg.reason


def test_a_fetched_folded_into_staged_or_done_releases_the_source():
    h = Harness()
    [enc], [den], [dec] = h.add("encoder"), h.add("denoiser"), h.add("decoder")
    h.submit("r1")
    h.role(enc, staged(enc, "r1"))
    outs = h.role(den, msgspec.structs.replace(staged(den, "r1"), fetch_s=0.001))  # no Fetched of its own
    assert any(isinstance(o.msg, Release) and o.to_instance == enc for o in outs)
    assert h.router.registry.get(enc).staged == {}
    outs = h.role(dec, Done(request_id="r1", attempt=1, num_images=1, fetch_s=0.002))
    assert any(isinstance(o.msg, Release) and o.to_instance == den for o in outs)
    [res] = [o.msg for o in outs if isinstance(o.msg, Result)]
    assert res.ok and res.timings["fetch_denoiser"] == 0.001 and res.timings["fetch_decoder"] == 0.002


# --- issue 11: deployments, stop, limits --------------------------------------------------------


def test_a_stop_naming_another_orchestrator_is_refused():
    h = Harness()
    [out] = h.router.handle_client(CLIENT, Stop(orchestrator_id="someone-else"), [], h.now)
    assert isinstance(out.msg, Rejected) and not h.router.stopping
    outs = h.router.handle_client(CLIENT, Stop(orchestrator_id=h.router.id), [], h.now)
    assert isinstance(outs[0].msg, Stopping) and h.router.stopping


def test_a_plain_stop_ends_every_request_at_once_telling_its_client():
    h = Harness()
    h.add("encoder")
    h.submit("running")
    h.submit("queued")
    outs = h.router.handle_client(CLIENT, Stop(), [], h.now)
    results = {o.msg.request_id: o.msg for o in outs if isinstance(o.msg, Result)}
    assert set(results) == {"running", "queued"} and not h.router.requests
    assert all(r.stopping and not r.ok and "stopping" in r.error for r in results.values())
    assert any(isinstance(o.msg, Shutdown) for o in outs)


def test_sizes_over_what_the_instances_report_are_refused_at_submit():
    h = Harness()
    pool = PoolInfo(host_id="h", engines=["shm"], pool_name="p", pool_bytes=1 << 20)
    h.role("encoder-0", Register(role="encoder", instance_id="encoder-0", pid=1, host_id="h", device="cpu", capacity=1,
                                 pool=pool, max_width=1024, max_height=512, max_frames=81))
    for params, needle in ((dict(width=2048), "width 2048"), (dict(height=528), "height 528"),
                           (dict(num_frames=82), "num_frames 82")):
        [out] = h.submit(f"r-{needle}", **params)
        assert isinstance(out.msg, Rejected) and needle in out.msg.reason and "maximum" in out.msg.reason
    h.submit("fits", width=1024, height=512)
    assert "fits" in h.router.requests


def test_cancel_of_a_queued_request_drops_it_without_a_result():
    h = Harness()
    h.add("encoder")
    h.submit("first")  # takes the only slot
    h.submit("second")
    assert h.router.handle_client(b"someone-else", Cancel(request_id="second"), [], h.now) == []
    assert "second" in h.router.requests  # only its own client may cancel it
    outs = h.router.handle_client(CLIENT, Cancel(request_id="second"), [], h.now)
    assert "second" not in h.router.requests and not any(isinstance(o.msg, Result) for o in outs)
    assert h.router.stats.cancelled == 1 and h.router.snapshot(h.now).queues["encoder"] == 0


def test_cancel_of_a_running_request_tells_its_role_and_the_slot_comes_back_when_it_reports():
    h = Harness()
    [enc] = h.add("encoder")
    [(_, run)] = runs(h.submit("r1"))
    outs = h.router.handle_client(CLIENT, Cancel(request_id="r1"), [], h.now)
    [cancel] = [o for o in outs if isinstance(o.msg, Cancel)]
    assert cancel.to_instance == enc and cancel.msg.attempt == run.attempt
    assert not any(isinstance(o.msg, Result) for o in outs) and "r1" not in h.router.requests
    assert h.router.registry.get(enc).free_slots == 0  # until the role says it stopped
    h.role(enc, Failed(request_id="r1", attempt=1, error="cancelled"))
    assert h.router.registry.get(enc).free_slots == 1


def test_status_lists_the_pairs_that_handed_over_most_recently_at_most_max_pairs():
    from types import SimpleNamespace

    from disagg.orchestrator.stats import MAX_PAIRS, Stats

    stats = Stats()
    enc = [SimpleNamespace(id=f"encoder-{i}", role="encoder", host="h") for i in range(MAX_PAIRS + 10)]
    den = SimpleNamespace(id="denoiser-0", role="denoiser", host="g")
    for e in enc[:MAX_PAIRS]:
        stats.transferred(e, den, "shm", 100)
    stats.transferred(enc[0], den, "shm", 100)  # the oldest hands over again: now the most recent
    for e in enc[MAX_PAIRS:]:  # ten more pairs: the ten least recent go, encoder-1 to encoder-10
        stats.transferred(e, den, "shm", 100)
    assert len(stats.pairs) == MAX_PAIRS
    assert ("encoder-0", "denoiser-0") in stats.pairs and stats.pairs[("encoder-0", "denoiser-0")][1] == 2
    assert ("encoder-1", "denoiser-0") not in stats.pairs  # the least recent went
    assert ("encoder-11", "denoiser-0") in stats.pairs
    # every handoff still counts in the per-edge totals
    assert stats.transfers[("encoder", "denoiser", "shm")] == [MAX_PAIRS + 11, (MAX_PAIRS + 11) * 100]
