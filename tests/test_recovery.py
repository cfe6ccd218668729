"""A restarted orchestrator (a Router driven by scripted messages) resumes each request from the furthest
stage its roles hold, answers results that came back, and releases what nobody claims."""

from disagg.orchestrator.parts.recovery import GRACE_S, WINDOW_MAX_S
from disagg.transport.wire.messages import (
    Done,
    GenerationParams,
    Heartbeat,
    Held,
    HeldPreview,
    Partial,
    PoolInfo,
    Preview,
    Register,
    Registered,
    Release,
    Result,
    StatusQuery,
    Submit,
)
from tests.test_router import CLIENT, Harness, runs, staged


def register(h, iid, role, held=(), busy=None, pid=1):
    pool = PoolInfo(host_id="h", engines=["shm"], pool_name=f"p-{iid}", pool_bytes=1 << 20)
    out = h.role(iid, Register(role=role, instance_id=iid, pid=pid, host_id="h", device="cpu", capacity=2, pool=pool,
                               ready=True, busy=busy or {}, held=list(held)))
    assert isinstance(out[0].msg, Registered)
    return out


def held(iid, rid, role, offset, attempt=1, seed=None):
    return Held(request_id=rid, attempt=attempt, role=role, slot=staged(iid, rid, offset=offset).slot, seed=seed)


def resubmit(h, rid, **params):
    params.setdefault("prompt", "a cat")
    return h.router.handle_client(CLIENT, Submit(request_id=rid, params=GenerationParams(**params), resume=True), [], h.now)


def advance(h, seconds, running=None):
    """Time passes, with every instance heartbeating (listing what it runs) each second."""
    out = []
    for _ in range(int(seconds)):
        h.now += 1.0
        for iid in list(h.router.registry.by_id):
            out += h.role(iid, Heartbeat(instance_id=iid, running=(running or {}).get(iid, [])))
        out += h.tick()
    return out


def releases(outs):
    return sorted((o.to_instance, o.msg.offset) for o in outs if isinstance(o.msg, Release))


def test_each_request_resumes_from_its_furthest_stage_after_a_restart():
    h = Harness()
    h.router.restarted(1, h.now)
    out = register(h, "encoder-0", "encoder", held=[held("encoder-0", "at-den", "encoder", 0, seed=7),
                                                    held("encoder-0", "running", "encoder", 1024)])
    out += register(h, "denoiser-0", "denoiser", held=[held("denoiser-0", "at-dec", "denoiser", 0)],
                    busy={"running": 1})
    out += register(h, "decoder-0", "decoder")
    # a decoder sends its recent Done again; the result waits for its client
    out += h.role("decoder-0", Done(request_id="finished", attempt=1, num_images=1), [b"png"])
    assert runs(out) == [] and releases(out) == []
    for rid in ("finished", "at-den", "at-dec", "running", "fresh"):
        assert resubmit(h, rid) == []  # parked: the roles may still be telling what they hold
    out = advance(h, WINDOW_MAX_S, running={"denoiser-0": ["running"]})
    placed = {run.request_id: (to, run) for to, run in runs(out)}
    # done: answered at once, nothing runs
    [result] = [o.msg for o in out if isinstance(o.msg, Result)]
    assert result.request_id == "finished" and result.ok and "finished" not in placed
    # staged by the encoder: to a denoiser, reading the encoder's slot, with the seed the first orchestrator chose
    to, run = placed["at-den"]
    assert to == "denoiser-0" and run.source.slot.instance_id == "encoder-0" and run.params.seed == 7
    # staged by the denoiser: straight to the decoder
    assert placed["at-dec"][0] == "decoder-0" and placed["at-dec"][1].source.slot.instance_id == "denoiser-0"
    # running on the denoiser: nothing sent; its report continues it, and then frees the encoder's slot it read
    assert "running" not in placed and h.router.requests["running"].assigned == "denoiser-0"
    assert placed["fresh"][0] == "encoder-0"  # nothing held: from the start
    out = h.role("denoiser-0", staged("denoiser-0", "running", offset=4096))
    assert ("encoder-0", 1024) in releases(out)
    assert [to for to, run in runs(out) if run.request_id == "running"] == ["decoder-0"]
    assert h.router.recovery.resumed == {"done": 1, "staged": 2, "running": 1}


def test_what_nobody_claims_is_released_after_the_grace_period():
    h = Harness()
    h.router.restarted(1, h.now)
    register(h, "encoder-0", "encoder", held=[held("encoder-0", "orphan", "encoder", 2048)])
    assert releases(advance(h, GRACE_S / 2)) == []
    assert releases(advance(h, GRACE_S)) == [("encoder-0", 2048)]
    assert h.router.registry.get("encoder-0").staged == {}


def test_a_report_before_its_roles_register_is_kept_and_replayed():
    h = Harness()
    h.router.restarted(1, h.now)
    # a compute thread's Staged overtakes its role's Register
    assert h.role("denoiser-0", staged("denoiser-0", "early", offset=512)) == []
    register(h, "denoiser-0", "denoiser")
    register(h, "decoder-0", "decoder")
    resubmit(h, "early")
    [(to, run)] = runs(advance(h, WINDOW_MAX_S))
    assert to == "decoder-0" and run.source.slot.offset == 512


def test_outputs_of_requests_known_to_have_moved_on_are_released_at_once():
    h = Harness()
    [enc] = h.add("encoder")
    h.add("denoiser"), h.add("decoder")
    h.submit("r1")
    h.role(enc, staged(enc, "r1"))
    # the encoder re-registers (it was thought dead): its old output of r1, a request that moved on, goes
    out = register(h, enc, "encoder", held=[held(enc, "r1", "encoder", 0)], pid=2)
    assert releases(out) == [(enc, 0)]
    # and an output of a request that ended here is released at once too, not kept
    h.router.handle_client(CLIENT, __import__("disagg.transport.wire.messages", fromlist=["Cancel"]).Cancel(request_id="r1"), [], h.now)
    out = h.role("denoiser-0", staged("denoiser-0", "r1", offset=64))
    assert releases(out) == [("denoiser-0", 64)]


def test_a_resumed_running_request_whose_report_was_lost_is_tried_again():
    h = Harness()
    h.router.restarted(1, h.now)
    register(h, "encoder-0", "encoder")
    register(h, "denoiser-0", "denoiser", busy={"r": 1})
    resubmit(h, "r")
    advance(h, WINDOW_MAX_S, running={"denoiser-0": ["r"]})
    assert h.router.requests["r"].assigned == "denoiser-0"
    advance(h, 2)  # it no longer runs r, and no report came in a heartbeat's time
    req = h.router.requests["r"]
    assert req.attempt == 2 and req.stage == "encoder"


def test_a_late_copy_of_the_report_a_resumed_request_reads_from_does_not_release_it():
    h = Harness()
    h.router.restarted(1, h.now)
    register(h, "denoiser-0", "denoiser", held=[held("denoiser-0", "r", "denoiser", 128)], busy={"r": 1})
    register(h, "decoder-0", "decoder", busy={"other": 1})  # busy: r waits in the decoder queue
    resubmit(h, "r")
    advance(h, WINDOW_MAX_S, running={"denoiser-0": ["r"], "decoder-0": ["other"]})
    assert h.router.requests["r"].source.slot.offset == 128
    # the compute thread's Staged for that same output comes in only now
    out = h.role("denoiser-0", staged("denoiser-0", "r", offset=128))
    assert releases(out) == [] and h.router.requests["r"].source.slot.offset == 128


def preview_copy(iid, rid, offset, index, step=3, steps=8, attempt=1):
    return Held(request_id=rid, attempt=attempt, role="denoiser", slot=staged(iid, rid, offset=offset).slot,
                preview=HeldPreview(index=index, step=step, steps=steps, staged_at=50.0))


def test_a_request_resumed_after_its_denoiser_reads_its_output_not_a_preview_copy():
    """The denoiser holds a preview's copy of the latents (staged first) and the request's final output: the
    request continues from the output, with its step-cache report; the copy is decoded and sent again."""
    h = Harness()
    h.router.restarted(1, h.now)
    final = Held(request_id="r", attempt=1, role="denoiser", slot=staged("denoiser-0", "r", offset=4096).slot,
                 cache="first_block threshold=0.3", steps_computed=5, steps_skipped=3)
    register(h, "denoiser-0", "denoiser", held=[preview_copy("denoiser-0", "r", 0, index=0), final])
    register(h, "decoder-0", "decoder")
    resubmit(h, "r", previews=2)
    placed = {run.request_id: run for _, run in runs(advance(h, WINDOW_MAX_S))}
    assert placed["r"].source.slot.offset == 4096  # the final latents, not the copy after step 3
    assert placed["r"].carry == {"cache": "first_block threshold=0.3", "steps_computed": 5, "steps_skipped": 3}
    assert placed["r:p0"].source.slot.offset == 0 and placed["r:p0"].params.previews is None
    out = h.role("decoder-0", Done(request_id="r:p0", attempt=1, num_images=1), [b"preview"])
    [partial] = [o for o in out if isinstance(o.msg, Partial)]
    assert (partial.to_client, partial.msg.index, partial.msg.step, partial.frames) == (CLIENT, 0, 3, [b"preview"])
    assert releases(out) == [("denoiser-0", 0)]
    out = h.role("decoder-0", Done(request_id="r", attempt=1, num_images=1), [b"png"])
    [result] = [o.msg for o in out if isinstance(o.msg, Result)]
    assert result.ok and result.resolved["steps_computed"] == 5 and result.resolved["cache"] == "first_block threshold=0.3"
    assert releases(out) == [("denoiser-0", 4096)]
    assert (h.router.previews.sent, h.router.previews.lost) == (1, 0)


def test_a_preview_copy_of_a_request_answered_already_is_released_and_counted_lost():
    h = Harness()
    h.router.restarted(1, h.now)
    register(h, "denoiser-0", "denoiser", held=[preview_copy("denoiser-0", "r", 0, index=1)])
    register(h, "decoder-0", "decoder")
    h.role("decoder-0", Done(request_id="r", attempt=1, num_images=1, resolved={"steps_computed": 4}), [b"png"])
    resubmit(h, "r", previews=2)
    out = advance(h, WINDOW_MAX_S)
    [result] = [o.msg for o in out if isinstance(o.msg, Result)]
    assert result.ok and result.resolved["steps_computed"] == 4  # as the decoder's Done carried it (Run.carry)
    assert runs(out) == [] and releases(out) == [("denoiser-0", 0)]
    [report] = h.router.handle_client(CLIENT, StatusQuery(), [], h.now)
    assert report.msg.orchestrator["previews_lost"] == 1


def test_a_preview_copy_alone_is_released_and_the_request_starts_again():
    h = Harness()
    h.router.restarted(1, h.now)
    register(h, "encoder-0", "encoder")
    register(h, "denoiser-0", "denoiser", held=[preview_copy("denoiser-0", "r", 0, index=0)])
    register(h, "decoder-0", "decoder")
    resubmit(h, "r", previews=1)
    out = advance(h, WINDOW_MAX_S)
    assert [to for to, run in runs(out)] == ["encoder-0"] and releases(out) == [("denoiser-0", 0)]


def test_a_preview_staged_while_its_request_waits_to_resume_is_decoded_once():
    """A denoiser registered with the successor stages a preview of a request whose client has not resent it yet
    (or whose resubmission is parked): the copy waits with the rest and is decoded once, when the request resumes;
    decoding it at once as well released its slot twice, the second time under whatever was staged there since."""
    h = Harness()
    h.router.restarted(1, h.now)
    register(h, "denoiser-0", "denoiser", busy={"r": 1})
    register(h, "decoder-0", "decoder")
    resubmit(h, "r", previews=2)  # parked: the window is open
    copy = preview_copy("denoiser-0", "r", 512, index=0)
    out = h.role("denoiser-0", Preview(request_id="r", attempt=1, index=0, step=3, steps=8, slot=copy.slot))
    assert runs(out) == [] and releases(out) == []
    out = h.role("denoiser-0", staged("denoiser-0", "r", offset=4096))
    placed = [run.request_id for _, run in runs(out + advance(h, WINDOW_MAX_S, running={"denoiser-0": ["r"]}))]
    assert sorted(placed) == ["r", "r:p0"]  # the output to the decoder, and the preview once
    out = h.role("decoder-0", Done(request_id="r:p0", attempt=1, num_images=1), [b"preview"])
    assert releases(out) == [("denoiser-0", 512)]
    assert h.router.registry.get("denoiser-0").staged == {4096: 256}


def test_a_preview_that_decodes_after_a_newer_one_was_sent_is_dropped():
    """Two previews' decodes on one decoder end out of order: the newer one's image goes to the client, the older
    one's is dropped (counted skipped), so a client's previews never go back (the web page shows the last index)."""
    h = Harness()
    register(h, "encoder-0", "encoder")
    register(h, "denoiser-0", "denoiser")
    register(h, "decoder-0", "decoder")
    h.router.registry.get("decoder-0").capacity = h.router.registry.get("decoder-0").free_slots = 4
    enc = runs(h.submit("r", previews=2))[0][0]
    h.role(enc, staged(enc, "r"))
    for index in (0, 1):
        copy = preview_copy("denoiser-0", "r", 512 * (index + 1), index=index)
        out = h.role("denoiser-0", Preview(request_id="r", attempt=1, index=index, step=3 + index, steps=8, slot=copy.slot))
        assert [run.request_id for _, run in runs(out)] == [f"r:p{index}"]
    partials = []
    for pid in ("r:p1", "r:p0"):  # the second preview's decode ends first
        out = h.role("decoder-0", Done(request_id=pid, attempt=1, num_images=1), [b"preview"])
        partials += [o.msg.index for o in out if isinstance(o.msg, Partial)]
        assert ("denoiser-0", 512 * (int(pid[-1]) + 1)) in releases(out)  # its latents' copy is freed either way
    assert partials == [1]
    report = h.router.snapshot(h.now).orchestrator
    assert (report["previews_sent"], report["previews_skipped"]) == (1, 1)
