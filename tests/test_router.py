"""The Router driven by scripted messages and a fake clock: no sockets, no processes."""

import msgspec
import pytest

from disagg.orchestrator.registry import Instance
from disagg.orchestrator.router import Router, RouterConfig
from disagg.orchestrator.scheduling.dispatch import MaxFreeSlots, RoundRobin
from disagg.orchestrator.scheduling.placement import ConditioningAffinity
from disagg.settings.sections import TimeoutSettings
from disagg.transport.wire.messages import (
    Alive,
    Cancel,
    Dead,
    Done,
    Failed,
    Fetched,
    GenerationParams,
    Heartbeat,
    PoolInfo,
    Register,
    Registered,
    Rejected,
    Release,
    Result,
    Run,
    Shutdown,
    SlotRef,
    Staged,
    StatusQuery,
    StatusReport,
    Stop,
    Stopping,
    Submit,
    TensorSpec,
)

CLIENT = b"client-1"
POOL1 = PoolInfo(host_id="h", engines=["shm"], pool_name="p", pool_bytes=1 << 20)


class Harness:
    """A router plus a fake clock and helpers that speak for roles and clients."""

    def __init__(self, **cfg):
        self.now = 100.0
        self.router = Router(RouterConfig(**cfg), now=self.now)

    def add(self, role, n=1, capacity=1, host="h", engines=("shm", "inline")):
        ids = []
        for i in range(n):
            iid = f"{role}-{len(self.router.registry.of_role(role))}"
            pool = PoolInfo(host_id=host, engines=list(engines), pool_name=f"p-{iid}", pool_bytes=1 << 20)
            out = self.role(iid, Register(role=role, instance_id=iid, pid=1000 + i, host_id=host, device="cpu", capacity=capacity, pool=pool))
            assert isinstance(out[0].msg, Registered)
            self.role(iid, Heartbeat(instance_id=iid, ready=True))
            ids.append(iid)
        return ids

    def submit(self, rid, timeout_s=None, **params):
        params.setdefault("prompt", "a cat")
        return self.router.handle_client(CLIENT, Submit(request_id=rid, params=GenerationParams(**params), timeout_s=timeout_s), [], self.now)

    def role(self, iid, msg, frames=()):
        return self.router.handle_instance(iid, msg, list(frames), self.now)

    def tick(self, dt=0.0):
        self.now += dt
        return self.router.tick(self.now)

    def beat_all(self):
        for iid in self.router.registry.by_id:
            self.role(iid, Heartbeat(instance_id=iid))


def runs(outs):
    return [(o.to_instance, o.msg) for o in outs if isinstance(o.msg, Run)]


def staged(iid, rid, attempt=1, offset=0, nbytes=256):
    slot = SlotRef(instance_id=iid, offset=offset, nbytes=nbytes, tensors=[TensorSpec("x", "float32", [64], 0, 256)])
    return Staged(request_id=rid, attempt=attempt, slot=slot, compute_s=0.01)


def drive_one(h, rid="r1"):
    """Take a submitted request through all three stages; return the Result."""
    [(enc, run)] = runs(h.submit(rid, seed=5))
    assert run.source is None and run.params.seed == 5
    [(den, run)] = runs(h.role(enc, staged(enc, rid)))
    assert run.source.slot.instance_id == enc and run.source.engine == "shm"
    out = h.role(den, Fetched(request_id=rid, attempt=1))
    assert [(o.to_instance, type(o.msg)) for o in out] == [(enc, Release)]
    [(dec, run)] = runs(h.role(den, staged(den, rid)))
    h.role(dec, Fetched(request_id=rid, attempt=1))
    out = h.role(dec, Done(request_id=rid, attempt=1, num_images=1), [b"png"])
    [res] = [o for o in out if isinstance(o.msg, Result)]
    assert res.to_client == CLIENT and res.frames == [b"png"]
    return res.msg


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


def test_queue_waits_for_free_slot_then_dispatches():
    h = Harness()
    [enc] = h.add("encoder")
    assert len(runs(h.submit("a"))) == 1
    assert runs(h.submit("b")) == []  # the only encoder is busy
    assert h.router.snapshot(h.now).queues["encoder"] == 1
    out = h.role(enc, staged(enc, "a"))
    assert [r.request_id for _, r in runs(out)] == ["b"]  # freed slot goes to the queued one


def test_no_dispatch_to_starting_instance():
    h = Harness()
    pool = PoolInfo(host_id="h", engines=["shm"], pool_name="p", pool_bytes=1 << 20)
    h.role("encoder-0", Register(role="encoder", instance_id="encoder-0", pid=1, host_id="h", device="cpu", capacity=1, pool=pool))
    assert runs(h.submit("a")) == []
    out = h.role("encoder-0", Heartbeat(instance_id="encoder-0", ready=True))
    assert len(runs(out)) == 1


def test_round_robin_policy_skips_full():
    insts = [Instance(f"d-{i}", "denoiser", 1, "h", "cpu", 2, POOL1, 1, 0.0, state="ready", free_slots=2) for i in range(3)]
    rr = RoundRobin()
    picks = [rr.pick("denoiser", insts).id for _ in range(4)]
    assert picks == ["d-0", "d-1", "d-2", "d-0"]
    insts[1].free_slots = 0
    assert [rr.pick("denoiser", insts).id for _ in range(3)] == ["d-2", "d-0", "d-2"]
    for i in insts:
        i.free_slots = 0
    assert rr.pick("denoiser", insts) is None


def test_max_free_slots_policy_prefers_most_free_and_rotates_ties():
    insts = [Instance(f"d-{i}", "denoiser", 1, "h", "cpu", 4, POOL1, 1, 0.0, state="ready", free_slots=f) for i, f in enumerate([1, 3, 3])]
    pol = MaxFreeSlots()
    assert {pol.pick("denoiser", insts).id for _ in range(4)} == {"d-1", "d-2"}
    insts[0].free_slots = 4
    assert pol.pick("denoiser", insts).id == "d-0"
    insts[0].state = "dead"
    assert pol.pick("denoiser", insts).id in ("d-1", "d-2")


@pytest.mark.parametrize("policy", ["round-robin", "max-free-slots"])
def test_policies_spread_load_across_denoisers(policy):
    h = Harness(dispatch=policy)
    [enc] = h.add("encoder", capacity=8)
    dens = h.add("denoiser", 4, capacity=2)
    h.add("decoder")
    for k in range(8):
        h.submit(f"r{k}")
    used = []
    for k in range(8):
        [(den, run)] = runs(h.role(enc, staged(enc, f"r{k}", offset=k * 256)))
        used.append(den)
    assert sorted(used) == sorted(dens * 2)


def test_heartbeat_timeout_marks_dead_and_retries_its_work():
    h = Harness(timeouts=TimeoutSettings(heartbeat=3.0))
    [enc] = h.add("encoder")
    h.add("denoiser"), h.add("decoder")
    h.submit("r1")
    h.tick(2.0)
    h.beat_all()
    assert runs(h.tick(2.0)) == []  # heard from within the timeout
    for iid in ("denoiser-0", "decoder-0"):
        h.role(iid, Heartbeat(instance_id=iid))
    out = h.tick(1.5)  # the encoder has now been silent 3.5 s
    assert not [o for o in out if isinstance(o.msg, Result)]  # not failed: waiting for a new attempt
    snap = {i.id: i for i in h.router.snapshot(h.now).instances}
    assert snap[enc].state == "dead" and snap[enc].free_slots == 0
    assert h.router.requests["r1"].attempt == 2 and h.router.snapshot(h.now).queues["encoder"] == 1
    # a message from the dead instance is refused until it registers again
    out = h.role(enc, Heartbeat(instance_id=enc))
    assert isinstance(out[0].msg, Rejected) and "register" in out[0].msg.reason
    # the restarted encoder takes the retry
    pool = PoolInfo(host_id="h", engines=["shm"], pool_name="p-new", pool_bytes=1 << 20)
    out = h.role(enc, Register(role="encoder", instance_id=enc, pid=77, host_id="h", device="cpu", capacity=1, pool=pool, ready=True, restarts=1))
    [(iid, run)] = runs(out)
    assert iid == enc and run.attempt == 2 and run.request_id == "r1"
    assert h.router.snapshot(h.now).instances[0].restarts == 1


def test_dead_consumer_before_fetch_retries_from_the_staged_output():
    h = Harness()
    [enc] = h.add("encoder")
    d0, d1 = h.add("denoiser", 2)
    h.add("decoder")
    h.submit("r1")
    [(den, _)] = runs(h.role(enc, staged(enc, "r1", offset=512)))
    h.router.lose_instance(h.router.registry.get(den), "killed", h.now, [])
    out = h.router.tick(h.now)
    [(other, run)] = runs(out)
    assert other != den and run.attempt == 2 and run.source.slot.offset == 512  # no re-encoding
    # the old attempt's late report changes nothing
    assert runs(h.role(den, staged(den, "r1", attempt=1))) == []


def test_dead_consumer_after_fetch_restarts_from_encoder():
    h = Harness()
    [enc] = h.add("encoder")
    [den, _] = h.add("denoiser", 2)
    h.add("decoder")
    h.submit("r1")
    [(den, _)] = runs(h.role(enc, staged(enc, "r1")))
    h.role(den, Fetched(request_id="r1", attempt=1))  # the encoder's slot is released
    out = []
    h.router.lose_instance(h.router.registry.get(den), "killed", h.now, out)
    h.router.dispatch_queued(h.now, out)
    [(iid, run)] = runs(out)
    assert iid == enc and run.attempt == 2 and run.source is None


def test_dead_producer_with_unfetched_output_restarts_from_encoder():
    h = Harness()
    e0, e1 = h.add("encoder", 2)
    h.add("denoiser"), h.add("decoder")
    [(enc, _)] = runs(h.submit("r1"))
    [(den, run)] = runs(h.role(enc, staged(enc, "r1")))
    out = []
    h.router.lose_instance(h.router.registry.get(enc), "killed", h.now, out)
    h.router.dispatch_queued(h.now, out)
    [(iid, run)] = runs(out)
    assert iid != enc and iid.startswith("encoder") and run.attempt == 2


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


def test_stalled_instance_loses_its_work():
    h = Harness(timeouts=TimeoutSettings(stall=5.0, heartbeat=100.0))
    [enc] = h.add("encoder")
    d0, d1 = h.add("denoiser", 2)
    h.add("decoder")
    h.submit("r1")
    [(den, _)] = runs(h.role(enc, staged(enc, "r1")))
    for step in range(3):  # progressing: fine
        h.now += 2.0
        h.role(den, Heartbeat(instance_id=den, progress=step + 1))
        assert runs(h.router.tick(h.now)) == []
    h.now += 6.0  # heartbeats go on but progress stands still
    h.role(den, Heartbeat(instance_id=den, progress=3))
    [(other, run)] = runs(h.router.tick(h.now))
    assert other != den and run.attempt == 2
    assert h.router.registry.get(den).state == "dead"
    # it re-registers with its stuck work still counted against its capacity
    pool = PoolInfo(host_id="h", engines=["shm"], pool_name="p2", pool_bytes=1 << 20)
    h.role(den, Register(role="denoiser", instance_id=den, pid=5, host_id="h", device="cpu", capacity=1, pool=pool, ready=True, busy={"r1": 1}))
    inst = h.router.registry.get(den)
    assert inst.free_slots == 0
    h.role(den, staged(den, "r1", attempt=1))  # the stuck work finally ends: slot back, output released
    assert inst.free_slots == 1 and inst.staged == {}


def test_retryable_failure_gets_new_attempt():
    h = Harness()
    [enc] = h.add("encoder")
    h.add("denoiser", 2), h.add("decoder")
    h.submit("r1")
    [(den, _)] = runs(h.role(enc, staged(enc, "r1")))
    out = h.role(den, Failed(request_id="r1", attempt=1, error="TransferError: peer gone", retryable=True))
    assert not [o for o in out if isinstance(o.msg, Result)]
    assert h.router.requests["r1"].attempt == 2


def test_admission_control_refuses_when_queue_full():
    h = Harness(max_queue=2)
    h.add("encoder")
    h.submit("a")  # running
    h.submit("b"), h.submit("c")  # queued: 2
    out = h.submit("d")
    assert isinstance(out[0].msg, Rejected) and "overloaded" in out[0].msg.reason and "encoder queue" in out[0].msg.reason


def test_heartbeat_is_answered():
    h = Harness()
    [enc] = h.add("encoder")
    out = h.role(enc, Heartbeat(instance_id=enc))
    assert isinstance(out[0].msg, Alive) and out[0].msg.orchestrator_id == h.router.id


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


def drive_rest(h, rid, enc):
    [(den, _)] = runs(h.role(enc, staged(enc, rid)))
    [(dec, _)] = runs(h.role(den, staged(den, rid)))
    out = h.role(dec, Done(request_id=rid, attempt=1, num_images=1), [b"png"])
    return [o.msg for o in out if isinstance(o.msg, Result)][0]


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


def test_dead_message_and_reregistration():
    h = Harness()
    [enc] = h.add("encoder")
    h.role(enc, Dead(instance_id=enc, reason="CUDA error"))
    assert h.router.registry.get(enc).state == "dead"
    h.add("encoder")  # encoder-1
    pool = PoolInfo(host_id="h", engines=["shm"], pool_name="p2", pool_bytes=1 << 20)
    out = h.role(enc, Register(role="encoder", instance_id=enc, pid=9, host_id="h", device="cpu", capacity=1, pool=pool, ready=True))
    assert out[0].msg.session > 1 and h.router.registry.get(enc).state == "ready"


def test_register_identity_must_match():
    h = Harness()
    pool = PoolInfo(host_id="h", engines=["shm"], pool_name="p", pool_bytes=1)
    out = h.role("encoder-9", Register(role="encoder", instance_id="encoder-0", pid=1, host_id="h", device="cpu", capacity=1, pool=pool))
    assert isinstance(out[0].msg, Rejected)


def test_unregistered_sender_rejected():
    h = Harness()
    out = h.role("ghost", Heartbeat(instance_id="ghost"))
    assert isinstance(out[0].msg, Rejected)


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


def test_inline_transfer_carries_frames():
    h = Harness(transfer="inline")
    [enc] = h.add("encoder")
    h.add("denoiser"), h.add("decoder")
    h.submit("r1")
    [out] = [o for o in h.role(enc, staged(enc, "r1"), [b"x" * 256]) if isinstance(o.msg, Run)]
    assert out.msg.source.engine == "inline" and out.frames == [b"x" * 256]


def test_cross_host_without_inline_bytes_fails_clearly():
    h = Harness()
    [enc] = h.add("encoder", host="h1")
    h.add("denoiser", host="h2"), h.add("decoder", host="h2")
    h.submit("r1")
    out = h.role(enc, staged(enc, "r1"))
    [res] = [o.msg for o in out if isinstance(o.msg, Result)]
    assert not res.ok and "no transfer engine" in res.error and "different hosts" in res.error


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


def test_backpressure_keeps_a_fast_producer_from_filling_its_pool():
    h = Harness()
    [enc] = h.add("encoder", capacity=4)
    h.add("denoiser"), h.add("decoder")
    pool_bytes = h.router.registry.get(enc).pool.pool_bytes
    chunk = pool_bytes // 4
    for k in range(8):
        h.submit(f"r{k}")
    inst = h.router.registry.get(enc)
    for k in range(8):
        if f"r{k}" in inst.running:  # only what was dispatched can report
            h.role(enc, staged(enc, f"r{k}", offset=k * chunk, nbytes=chunk))
    # beyond the first wave (sizes not known yet), it takes only work whose output fits
    assert sum(inst.staged.values()) <= pool_bytes
    assert not inst.dispatchable and h.router.snapshot(h.now).queues["encoder"] > 0


def test_an_input_too_big_for_the_pool_does_not_block_the_consumer():
    h = Harness()
    [enc] = h.add("encoder")
    [den] = h.add("denoiser")
    h.add("decoder")
    h.submit("big")
    huge = h.router.registry.get(den).pool.pool_bytes * 2
    [(iid, _)] = runs(h.role(enc, staged(enc, "big", nbytes=huge)))
    h.role(den, Failed(request_id="big", attempt=1, error="PoolFull: does not fit"))
    h.submit("small")
    [(iid, _)] = runs(h.role(enc, staged(enc, "small", offset=huge, nbytes=256)))
    assert iid == den  # still takes work


def test_least_work_avoids_the_slow_instance():
    from disagg.orchestrator.scheduling.dispatch import LeastWork

    fast = Instance("d-fast", "denoiser", 1, "h", "cpu", 4, POOL1, 1, 0.0, state="ready", free_slots=3)
    slow = Instance("d-slow", "denoiser", 1, "h", "cpu", 4, POOL1, 1, 0.0, state="ready", free_slots=4)
    fast.running = {"a": 1}
    fast.stage_s_avg, slow.stage_s_avg = 1.0, 3.0
    pol = LeastWork()
    # fast: (1+1) x 1.0 / 4 = 0.5 s; slow: (0+1) x 3.0 / 4 = 0.75 s; max-free-slots would pick slow
    assert pol.pick("denoiser", [fast, slow]).id == "d-fast"
    assert MaxFreeSlots().pick("denoiser", [fast, slow]).id == "d-slow"
    fast.running = {k: 1 for k in "abc"}  # (3+1) x 1.0 / 4 = 1.0 > 0.75
    assert pol.pick("denoiser", [fast, slow]).id == "d-slow"
    unknown = Instance("d-new", "denoiser", 1, "h", "cpu", 4, POOL1, 1, 0.0, state="ready", free_slots=4)
    assert pol.pick("denoiser", [fast, slow, unknown]).id == "d-new"


def test_batching_denoisers_get_requests_whose_shape_joins_their_batch():
    h = Harness()
    [enc] = h.add("encoder", capacity=8)
    dens = []
    for _ in range(2):
        iid = f"denoiser-{len(dens)}"
        pool = PoolInfo(host_id="h", engines=["shm"], pool_name=f"p-{iid}", pool_bytes=1 << 20)
        h.role(iid, Register(role="denoiser", instance_id=iid, pid=1, host_id="h", device="cpu", capacity=4,
                             max_batch=4, pool=pool))
        h.role(iid, Heartbeat(instance_id=iid, ready=True))
        dens.append(iid)
    h.add("decoder")
    assert h.router.registry.get(dens[0]).status(h.now).max_batch == 4
    sizes = [256, 512, 256, 256, 512]
    for k, size in enumerate(sizes):
        h.submit(f"r{k}", width=size, height=size)
    placed = {}
    for k in range(len(sizes)):
        [(den, run)] = runs(h.role(enc, staged(enc, f"r{k}", offset=k * 256)))
        placed[f"r{k}"] = den
    # r0 (256) and r1 (512) start batches on the two idle denoisers; later requests follow their shape
    assert placed["r0"] != placed["r1"]
    assert placed["r2"] == placed["r3"] == placed["r0"] and placed["r4"] == placed["r1"]


def test_batched_results_count_their_device_share_as_busy_time():
    inst = Instance("d", "denoiser", 1, "h", "cpu", 4, POOL1, 1, 0.0, state="ready", free_slots=4, max_batch=4)
    inst.record_stage_time(0.8, device_s=0.2)  # four requests shared 0.8 s of steps
    assert inst.busy_s == pytest.approx(0.2) and inst.stage_s_avg == pytest.approx(0.8)
    inst.record_stage_time(0.5)
    assert inst.busy_s == pytest.approx(0.7)


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


def test_a_role_of_another_deployment_is_refused_and_the_instance_keeps_its_registration():
    h = Harness(deployment_id="ours")
    pool = PoolInfo(host_id="h", engines=["shm"], pool_name="p", pool_bytes=1 << 20)
    mine = Register(role="encoder", instance_id="encoder-0", pid=1, host_id="h", device="cpu", capacity=1, pool=pool,
                    deployment_id="ours")
    assert isinstance(h.role("encoder-0", mine)[0].msg, Registered)
    foreign = msgspec.structs.replace(mine, pid=2, deployment_id="theirs")
    [out] = h.role("encoder-0", foreign)
    assert isinstance(out.msg, Rejected) and out.msg.reason.startswith("another deployment")
    assert "'ours'" in out.msg.reason and "'theirs'" in out.msg.reason
    inst = h.router.registry.get("encoder-0")
    assert inst.pid == 1 and inst.state != "dead"


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


def test_status_counts_bytes_per_edge_and_engine():
    h = Harness()
    for role in ("encoder", "denoiser", "decoder"):
        h.add(role)
    drive_one(h, "a")
    drive_one(h, "b")
    edges = {(t.source, t.target, t.engine): (t.count, t.bytes) for t in h.router.snapshot(h.now).transfers}
    assert edges == {("encoder", "denoiser", "shm"): (2, 512), ("denoiser", "decoder", "shm"): (2, 512)}


def test_a_slot_inherited_from_register_is_freed_when_its_work_is_gone():
    """The report of work it ran across a re-registration can overtake the Register and be dropped."""
    h = Harness()
    pool = PoolInfo(host_id="h", engines=["shm"], pool_name="p", pool_bytes=1 << 20)
    reg = Register(role="denoiser", instance_id="denoiser-0", pid=1, host_id="h", device="cpu", capacity=1,
                   pool=pool, ready=True, busy={"old": 1})
    h.role("denoiser-0", reg)
    inst = h.router.registry.get("denoiser-0")
    assert inst.free_slots == 0
    h.role("denoiser-0", Heartbeat(instance_id="denoiser-0", running=["old"]))
    assert inst.free_slots == 0  # still running there
    h.role("denoiser-0", Heartbeat(instance_id="denoiser-0", running=[]))
    assert inst.free_slots == 0  # its report may still be on its way: one heartbeat later
    h.now += 1.0
    h.role("denoiser-0", Heartbeat(instance_id="denoiser-0", running=[]))
    assert inst.free_slots == 1 and not inst.running


def test_an_inherited_slot_is_not_freed_under_a_new_attempt_sent_to_the_same_instance():
    h = Harness()
    pool = PoolInfo(host_id="h", engines=["shm"], pool_name="p", pool_bytes=1 << 20)
    h.role("denoiser-0", Register(role="denoiser", instance_id="denoiser-0", pid=1, host_id="h", device="cpu",
                                  capacity=2, pool=pool, ready=True, busy={"r": 1}))
    inst = h.router.registry.get("denoiser-0")
    inst.running["r"] = 2  # attempt 2 of the same request was sent here meanwhile
    h.role("denoiser-0", Heartbeat(instance_id="denoiser-0", running=[]))
    assert inst.running == {"r": 2} and not inst.inherited


MC = ("shm", "mooncake", "inline")


def test_of_equally_good_instances_the_one_on_the_producers_host_wins_under_every_policy():
    for policy in ("max-free-slots", "round-robin", "least-work"):
        h = Harness(dispatch=policy)
        [enc] = h.add("encoder", host="b", engines=MC)
        h.add("denoiser", host="a", engines=MC), h.add("denoiser", host="b", engines=MC), h.add("denoiser", host="c", engines=MC)
        h.add("decoder", host="a", engines=MC)
        for inst in h.router.registry.of_role("denoiser"):
            inst.stage_s_avg = 0.01  # all measured equally fast (least-work tries unmeasured ones first)
        for k in range(4):  # every time, whatever the rotation says
            h.submit(f"r{k}")
            [(to, _)] = runs(h.role(enc, staged(enc, f"r{k}", offset=k * 256)))
            assert h.router.registry.get(to).host == "b", policy
            h.role(to, staged(to, f"r{k}"))  # done with it: the slot is free again
            h.role("decoder-0", Done(request_id=f"r{k}", attempt=1, num_images=1), [b"png"])


def test_stop_host_stops_only_that_hosts_instances_and_their_work_moves():
    h = Harness()
    [enc] = h.add("encoder", host="a", engines=MC)
    [d_a] = h.add("denoiser", host="a", engines=MC)
    [d_c] = h.add("denoiser", host="c", engines=MC)
    h.add("decoder", host="a", engines=MC)
    h.submit("r1")
    h.role(enc, staged(enc, "r1"))
    held_by = h.router.requests["r1"].assigned
    out = h.router.handle_client(CLIENT, __import__("disagg.transport.wire.messages", fromlist=["StopHost"]).StopHost(host_id="c"), [], h.now)
    assert any(isinstance(o.msg, Stopping) for o in out)
    assert [o.to_instance for o in out if isinstance(o.msg, Shutdown)] == [d_c]
    assert h.router.registry.get(d_c).state == "dead" and h.router.registry.get(d_a).state == "ready"
    assert h.router.requests["r1"].assigned == d_a  # the work it held moved (or stayed) on host a
    del held_by
    out = h.router.handle_client(CLIENT, __import__("disagg.transport.wire.messages", fromlist=["StopHost"]).StopHost(host_id="zz"), [], h.now)
    assert isinstance(out[0].msg, Rejected) and "hosts: a" in out[0].msg.reason


def test_a_draining_host_gets_no_new_work_and_is_shut_down_once_idle():
    from disagg.transport.wire.messages import StopHost

    h = Harness()
    [enc] = h.add("encoder", host="a", engines=MC)
    [d_c] = h.add("denoiser", host="c", engines=MC)
    h.add("decoder", host="a", engines=MC)
    h.submit("r1")
    [(to, _)] = runs(h.role(enc, staged(enc, "r1")))
    assert to == d_c
    out = h.router.handle_client(CLIENT, StopHost(host_id="c", drain=True), [], h.now)
    assert not [o for o in out if isinstance(o.msg, Shutdown)]  # it still runs r1
    assert h.router.registry.get(d_c).state == "draining"
    h.submit("r2")
    assert runs(h.role(enc, staged(enc, "r2", offset=256))) == []  # nobody else: r2 waits
    out = h.role(d_c, staged(d_c, "r1"))  # r1's output: staged there, still to be fetched
    assert not [o for o in out if isinstance(o.msg, Shutdown)]
    out = h.role("decoder-0", Fetched(request_id="r1", attempt=1)) + h.tick()
    assert [o.to_instance for o in out if isinstance(o.msg, Shutdown)] == [d_c]


def test_host_aware_dispatch_sends_fewer_bytes_across_hosts_than_a_host_blind_run():
    def cross_host(host_aware):
        h = Harness(host_aware=host_aware)
        encs = h.add("encoder", 2, host="b", engines=MC)
        dens = h.add("denoiser", 2, host="b", engines=MC) + h.add("denoiser", 2, host="c", engines=MC)
        h.add("decoder", host="b", engines=MC)
        host = {i: h.router.registry.get(i).host for i in encs + dens}
        crossed = 0
        for k in range(40):
            [(enc, _)] = runs(h.submit(f"r{k}"))
            [(den, _)] = runs(h.role(enc, staged(enc, f"r{k}", offset=k % 8 * 256)))
            crossed += host[enc] != host[den]
            h.role(den, staged(den, f"r{k}", offset=k % 8 * 256))
            h.role("decoder-0", Done(request_id=f"r{k}", attempt=1, num_images=1), [b"png"])
        return crossed

    blind, aware = cross_host(False), cross_host(True)
    assert aware == 0 and blind >= 10, (aware, blind)


def test_a_report_from_a_role_declared_dead_is_handled_once_it_registers_again():
    """SIGSTOP, then SIGCONT: the role's compute thread reports its output before the loop's new Register
    arrives (another socket). Refused, but kept: once registered, the stale output is released, not leaked."""
    h = Harness(timeouts=TimeoutSettings(heartbeat=3.0))
    [enc] = h.add("encoder")
    [den] = h.add("denoiser")
    h.add("decoder")
    h.submit("r1")
    h.role(enc, staged(enc, "r1"))
    h.role(den, Fetched(request_id="r1", attempt=1))
    for iid in (enc, "decoder-0"):
        h.tick(2.0)
        h.role(enc, Heartbeat(instance_id=enc)), h.role("decoder-0", Heartbeat(instance_id="decoder-0"))
    assert h.router.registry.get(den).state == "dead"  # silent 4 s, mid-compute
    out = h.role(den, staged(den, "r1", attempt=1, offset=768))
    assert [type(o.msg) for o in out] == [Rejected]
    pool = h.router.registry.get(den).pool
    out = h.role(den, Register(role="denoiser", instance_id=den, pid=1000, host_id="h", device="cpu", capacity=1,
                               pool=pool, ready=True, busy={"r1": 1}))
    assert [(o.to_instance, o.msg.offset) for o in out if isinstance(o.msg, Release)] == [(den, 768)]
    snap = {i.id: i for i in h.router.snapshot(h.now).instances}
    assert snap[den].free_slots == 1 and snap[den].pool_used_bytes == 0
    # a restarted process (another pid) never gets a Release meant for its predecessor's pool
    h.router.lose_instance(h.router.registry.get(den), "killed", h.now, [])
    h.role(den, staged(den, "r1", attempt=1, offset=1024))
    out = h.role(den, Register(role="denoiser", instance_id=den, pid=2000, host_id="h", device="cpu", capacity=1,
                               pool=pool, ready=True))
    assert not [o for o in out if isinstance(o.msg, Release)]


def test_the_requests_of_a_gateway_gone_silent_are_cancelled():
    """Issue 22 L15: a killed gateway's requests kept computing, so the ones its clients retried ran twice."""
    from disagg.transport.wire.messages import GatewayBeat

    h = Harness()
    [enc] = h.add("encoder")
    gw, other = b"client-gateway", CLIENT
    h.router.handle_client(gw, GatewayBeat(url="http://x", pid=7), [], h.now)
    [(_, run)] = runs(h.router.handle_client(gw, Submit(request_id="g1", params=GenerationParams(prompt="a")), [], h.now))
    h.submit("c1")  # a CLI client's request: not the gateway's
    h.router.handle_client(gw, Submit(request_id="c1", params=GenerationParams(prompt="a cat")), [], h.now)  # joins
    h.tick(3.0)
    h.beat_all()  # the roles are fine; only the gateway went silent
    assert "g1" in h.router.requests
    h.tick(3.0)
    h.beat_all()
    assert "g1" in h.router.requests and not h.router.snapshot(h.now).gateways  # not listed after 5 s
    h.tick(3.0)
    h.beat_all()
    outs = h.tick(2.0)  # 11 s without a beat from the gateway
    [cancel] = [o for o in outs if isinstance(o.msg, Cancel)]
    assert cancel.to_instance == enc and cancel.msg.request_id == "g1"
    assert "g1" not in h.router.requests and h.router.requests["c1"].clients == [other]


def test_an_inline_transfer_between_hosts_is_a_warning_status_shows():
    """Issue 22 L12: the warning that tensors go inline through the orchestrator was only in its log; status
    carries it now, and the launcher prints each new one on its console (events_between)."""
    from disagg.launcher.cli.dashboard import events_between

    h = Harness()
    [enc] = h.add("encoder", host="h1")
    h.add("denoiser", host="h2"), h.add("decoder", host="h2")
    before = h.router.snapshot(h.now)
    h.submit("r1")
    [run] = [o for o in h.role(enc, staged(enc, "r1"), [b"x" * 256]) if isinstance(o.msg, Run)]
    assert run.msg.source.engine == "inline"
    after = h.router.snapshot(h.now)
    [warning] = after.warnings
    assert "inline" in warning and [line for line in events_between(before, after) if "warning" in line] == [
        f"warning: {warning}"]


def test_a_repeated_prompt_goes_to_the_encoder_that_encoded_it_when_it_has_room():
    """Conditioning affinity: round-robin would send the repeat elsewhere; the holder takes it while free, and
    a repeat never waits for a busy holder."""
    h = Harness(dispatch="round-robin")
    h.add("encoder", 3, capacity=1)
    h.add("denoiser")
    [(first, _)] = runs(h.submit("r1", prompt="a red fox"))
    h.role(first, staged(first, "r1"))  # it encoded "a red fox"
    [(second, _)] = runs(h.submit("r2", prompt="a blue car"))
    assert second != first
    h.role(second, staged(second, "r2", offset=256))
    [(again, _)] = runs(h.submit("r3", prompt="a red fox"))
    assert again == first
    # the holder busy (r3 runs there): the next repeat goes to a free encoder at once, and is remembered there
    [(busy_case, _)] = runs(h.submit("r4", prompt="a red fox"))
    assert busy_case != first
    h.role(busy_case, staged(busy_case, "r4", offset=512))
    assert h.router.placement.step(ConditioningAffinity).holders[h.router.requests["r4"].conditioning_key] == busy_case
    # an image request has no key: the policy decides
    from disagg.transport.wire.params import conditioning_key

    assert conditioning_key(GenerationParams(prompt="a red fox", image=b"1")) is None
    assert conditioning_key(GenerationParams(prompt="a red fox", guidance_scale=5)) != h.router.requests["r1"].conditioning_key
