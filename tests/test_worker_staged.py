"""A role keeps what it staged across registrations and lists it in every Register (the orchestrator
resumes requests from it, or releases it); after a restart of the orchestrator it sends its recent Done
messages again, since a result may have died with the old one."""

from __future__ import annotations

import uuid

import torch

from disagg.roles.spec import WorkerSpec
from disagg.roles.worker import Worker
from disagg.transport.data.pool import make_pool
from disagg.transport.data.shm import list_segments, remove_segments
from disagg.transport.wire.bundle import decode_frames
from disagg.transport.wire.messages import Done, Held, Register, Registered, RoleMessage


def sent(worker) -> list:
    """What the worker's loop would send at the end of this turn."""
    frames = []
    worker.outbox.flush(lambda _dest, f: frames.append(f))
    return [msg for f in frames for msg, _ in decode_frames(f, RoleMessage)]


def test_staged_outputs_are_kept_and_told_and_recent_results_sent_again_to_a_new_orchestrator():
    name = f"disagg-test-{uuid.uuid4().hex[:8]}"
    pool = make_pool(name, 1 << 20, "cpu")
    worker = Worker(WorkerSpec(role="denoiser", instance_id="denoiser-0", endpoint="tcp://127.0.0.1:1",
                               model="payload", transfer="shm"), lambda: None, pool)
    try:
        worker.connect()  # a socket (to nothing: ZeroMQ connects lazily) and the first Register
        worker.handle_registered(Registered(session=1, heartbeat_interval_s=1.0, orchestrator_id="o1"), [])
        slot = pool.stage("denoiser-0", {"x": torch.ones(256)})
        worker.runner.staged[slot.offset] = Held(request_id="r1", attempt=1, role="denoiser", slot=slot, seed=3)
        worker.runner.keep_result(Done(request_id="r0", attempt=1, num_images=1), [b"png"])
        sent(worker)
        worker.register()
        [register] = [m for m in sent(worker) if isinstance(m, Register)]
        assert [(h.request_id, h.slot.offset, h.seed) for h in register.held] == [("r1", slot.offset, 3)]
        free = pool.free_bytes
        # the same orchestrator again: nothing is freed by the role itself, nothing sent again
        worker.handle_registered(Registered(session=2, heartbeat_interval_s=1.0, orchestrator_id="o1"), [])
        assert worker.runner.staged and pool.free_bytes == free and sent(worker) == []
        # a new orchestrator: the recent result goes to it again
        worker.handle_registered(Registered(session=1, heartbeat_interval_s=1.0, orchestrator_id="o2"), [])
        assert [(m.request_id, type(m).__name__) for m in sent(worker)] == [("r0", "Done")]
        # a stale Release for another request at the same offset frees nothing
        assert not worker.runner.release(slot.offset, "r0") and worker.runner.staged
        assert worker.runner.release(slot.offset, "r1") and not worker.runner.staged
    finally:
        worker.close()
        remove_segments(name)  # what the launcher does for a role's pool
    assert not list_segments(name)


def test_a_run_handed_over_before_a_register_and_not_started_by_then_is_not_run():
    """Issue 42: a role held still while its orchestrator died holds the dead one's Runs unstarted; its Register
    to the successor does not list them (busy: started ones only), so the successor places those requests again.
    Run as well, such a Run would compute the request twice and its Fetched would free the input the successor's
    own Run still reads (a wrong image): it is not run, and one Register answers the refusals of before it."""
    from disagg.roles.pipelines.payload import PayloadAdapter
    from disagg.roles.stage import Stage
    from disagg.roles.worker import REGISTER_AGAIN_S
    from disagg.transport.wire.messages import ErrorCode, GenerationParams, Rejected, Run

    name = f"disagg-test-{uuid.uuid4().hex[:8]}"
    pool = make_pool(name, 1 << 20, "cpu")
    worker = Worker(WorkerSpec(role="encoder", instance_id="encoder-0", endpoint="tcp://127.0.0.1:1",
                               model="payload", transfer="shm"), lambda: None, pool)
    try:
        worker.connect()
        worker.runner.stage = Stage("encoder", PayloadAdapter("encoder"))
        sent(worker)
        worker.register_sent -= REGISTER_AGAIN_S  # the first Register (connect's) is older than that
        run = Run(request_id="old", attempt=1, params=GenerationParams(prompt="p", width=8, height=8, seed=1))
        epoch = worker.runner.epoch  # handed to a compute thread then, not started yet
        worker.handle_rejected(Rejected(reason="not registered", code=ErrorCode.NOT_REGISTERED), [])
        worker.handle_rejected(Rejected(reason="not registered", code=ErrorCode.NOT_REGISTERED), [])
        assert [type(m).__name__ for m in sent(worker)] == ["Register"]  # one Register for both refusals
        worker.runner.execute(run, [], 0.0, epoch)
        assert sent(worker) == [] and not worker.runner.staged  # not run: nothing staged, nothing reported
        worker.runner.execute(msgspec_replace(run, request_id="new"), [], 0.0, worker.runner.epoch)
        assert [(m.request_id, type(m).__name__) for m in sent(worker)] == [("new", "Staged")]
    finally:
        worker.close()
        remove_segments(name)


def msgspec_replace(struct, **changes):
    import msgspec

    return msgspec.structs.replace(struct, **changes)


def test_a_requests_adapters_are_unpinned_before_its_output_is_reported():
    """The report lets the orchestrator hand the next request on: an adapter still pinned then cannot be unloaded
    for the next one's, and a bank of one slot held two (a CI failure of tests/test_loras.py)."""
    from disagg.roles.compute import StageRunner
    from disagg.roles.extensions.lora_backends import SimLoras
    from disagg.roles.extensions.loras import LoraBank
    from disagg.roles.pipelines.payload import PayloadAdapter
    from disagg.roles.stage import Stage
    from disagg.transport.wire.messages import GenerationParams, LoraRef, Run

    name = f"disagg-test-{uuid.uuid4().hex[:8]}"
    pool = make_pool(name, 1 << 20, "cpu")
    bank = LoraBank(SimLoras(0.0), slots=1, max_bytes=1 << 30)
    pins_told = []
    runner = StageRunner("encoder-0", pool, {}, lambda msg, *a: pins_told.append(
        (type(msg).__name__, sum(bank.pins.values()))) if msg is not None else None)
    runner.stage = Stage("encoder", PayloadAdapter("encoder"), loras=bank)
    try:
        run = Run(request_id="r1", attempt=1, lora_sources={"A": "a"},
                  params=GenerationParams(prompt="p", width=8, height=8, seed=1, loras=[LoraRef(name="A")]))
        runner.execute(run, [], 0.0)
        assert ("Staged", 0) in pins_told and all(p == 0 for _, p in pins_told), pins_told
        assert bank.names() == ["A"] and bank.loads == 1
    finally:
        for held in list(runner.staged.values()):
            pool.free(held.slot.offset)
        remove_segments(name)


def test_a_failed_pull_of_the_input_says_source_lost_and_a_failed_compute_does_not():
    """Failed.source_lost: the orchestrator starts such a request over instead of reading that input again."""
    from disagg.roles.compute import StageRunner
    from disagg.roles.pipelines.payload import PayloadAdapter
    from disagg.roles.stage import Stage
    from disagg.transport.wire.messages import Failed, GenerationParams, PoolInfo, Run, SlotRef, Source, TensorSpec

    name = f"disagg-test-{uuid.uuid4().hex[:8]}"
    pool = make_pool(name, 1 << 20, "cpu")
    told = []
    runner = StageRunner("decoder-0", pool, {}, lambda msg, *a: told.append(msg) if isinstance(msg, Failed) else None)
    runner.stage = Stage("decoder", PayloadAdapter("decoder"))
    try:
        slot = SlotRef(instance_id="denoiser-1", offset=0, nbytes=256, tensors=[TensorSpec("x", "float32", [64], 0, 256)])
        source = Source(slot=slot, pool=PoolInfo(host_id="h2", engines=["mooncake"], pool_name="p", pool_bytes=1 << 20),
                        engine="mooncake")  # no such engine here: the pull fails with a TransferError
        params = GenerationParams(prompt="p", width=8, height=8, seed=1)
        runner.execute(Run(request_id="r1", attempt=1, params=params, source=source), [], 0.0)
        # no input to pull: its compute fails (the payload decoder finds no latents), after the pull
        runner.execute(Run(request_id="r2", attempt=1, params=params), [], 0.0)
        assert [(f.request_id, f.retryable, f.source_lost) for f in told] == [("r1", True, True), ("r2", False, False)]
        assert "TransferError" in told[0].error and "KeyError" in told[1].error
        assert pool.free_bytes == 1 << 20  # the slot for the input that never came is free again
    finally:
        remove_segments(name)
