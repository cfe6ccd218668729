"""The Router on a fake clock: which instance gets a request (policies, hosts, batching, backpressure, conditioning)
and how its input travels (inline, across hosts)."""


import pytest

from disagg.orchestrator.registry import Instance
from disagg.orchestrator.scheduling.dispatch import MaxFreeSlots, RoundRobin
from disagg.orchestrator.scheduling.placement import ConditioningAffinity
from disagg.transport.wire.messages import (
    Done,
    Failed,
    GenerationParams,
    Heartbeat,
    PoolInfo,
    Register,
    Result,
    Run,
)
from tests.router_harness import MC, POOL1, Harness, drive_one, runs, staged


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


def test_status_counts_bytes_per_edge_and_engine():
    h = Harness()
    for role in ("encoder", "denoiser", "decoder"):
        h.add(role)
    drive_one(h, "a")
    drive_one(h, "b")
    edges = {(t.source, t.target, t.engine): (t.count, t.bytes) for t in h.router.snapshot(h.now).transfers}
    assert edges == {("encoder", "denoiser", "shm"): (2, 512), ("denoiser", "decoder", "shm"): (2, 512)}


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
    from disagg.orchestrator.requests import Request

    def key(**params):
        return Request(id="k", params=GenerationParams(**params), clients=[], submitted_at=0.0, deadline=1.0).conditioning_key

    assert key(prompt="a red fox", image=b"1") is None
    assert key(prompt="a red fox") == h.router.requests["r1"].conditioning_key
    assert key(prompt="a red fox", guidance_scale=5) != h.router.requests["r1"].conditioning_key
