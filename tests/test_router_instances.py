"""The Router on a fake clock: instances coming and going (heartbeats, stalls, deaths, registering again, inherited
slots, stopped and draining hosts, gateways gone silent) and the work they held."""


import msgspec

from disagg.settings.sections import TimeoutSettings
from disagg.transport.wire.messages import (
    Alive,
    Cancel,
    Dead,
    Fetched,
    GenerationParams,
    Heartbeat,
    PoolInfo,
    Register,
    Registered,
    Rejected,
    Release,
    Result,
    Shutdown,
    Stopping,
    Submit,
)
from tests.router_harness import CLIENT, MC, Harness, runs, staged


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


def test_heartbeat_is_answered():
    h = Harness()
    [enc] = h.add("encoder")
    out = h.role(enc, Heartbeat(instance_id=enc))
    assert isinstance(out[0].msg, Alive) and out[0].msg.orchestrator_id == h.router.id


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
