"""A role frees the outputs it staged before a registration once that registration is accepted: the
orchestrator (a new one, or the same one after declaring it dead) starts it with none it knows."""

from __future__ import annotations

import uuid

import torch

from roles.spec import WorkerSpec
from roles.worker import Worker
from transport.messages import Registered
from transport.pool import make_pool
from transport.shm import list_segments, remove_segments


def test_outputs_staged_before_a_register_are_freed_once_it_is_accepted_and_later_ones_kept():
    name = f"disagg-test-{uuid.uuid4().hex[:8]}"
    pool = make_pool(name, 1 << 20, "cpu")
    worker = Worker(WorkerSpec(role="denoiser", instance_id="denoiser-0", endpoint="tcp://127.0.0.1:1",
                               model="payload", transfer="shm"), lambda: None, pool)
    try:
        worker.connect()  # a socket (to nothing: ZeroMQ connects lazily) and the first Register
        worker.handle_registered(Registered(session=1, heartbeat_interval_s=1.0, orchestrator_id="o1"), [])
        old = pool.stage("denoiser-0", {"x": torch.ones(256)})
        worker.runner.staged.add(old.offset)
        worker.register()  # e.g. after the orchestrator declared us dead: it will not know `old`
        new = pool.stage("denoiser-0", {"x": torch.ones(256)})  # staged after: reported, known, kept
        worker.runner.staged.add(new.offset)
        free = pool.free_bytes
        # the same orchestrator id: it declared us dead and forgot what we had staged
        worker.handle_registered(Registered(session=2, heartbeat_interval_s=1.0, orchestrator_id="o1"), [])
        assert worker.runner.staged == {new.offset}
        assert pool.free_bytes > free
    finally:
        worker.close()
        remove_segments(name)  # what the launcher does for a role's pool
    assert not list_segments(name)
