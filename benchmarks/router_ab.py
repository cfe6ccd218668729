"""Same decisions before and after a change to the Router: drive it with seeded random scripts (submits with
priorities and deadlines, stages, fetches, retryable failures, cancels, ticks, one and two hosts, aging from 0.05 to
10 s, a queue limit of 8 or 4,096) and print one digest of every message it sent and of periodic status snapshots.
Run it in two checkouts; equal digests: the same behaviour on every script.

    git worktree add /tmp/before BASE && (cd /tmp/before && python /path/to/benchmarks/router_ab.py 400)
    python benchmarks/router_ab.py 400

It reads the tree it runs in (the current directory), so the same file drives an older checkout; it knows the
layout before the move to disagg/transport/wire and before the schedule section.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import sys

sys.path.insert(0, os.getcwd())

from tests.test_router import Harness, staged  # noqa: E402 - the checkout's own

try:
    from disagg.transport.wire.messages import Cancel, Done, Failed, Fetched, Run  # noqa: E402
except ImportError:  # before the layout of issue 45
    from disagg.transport.messages import Cancel, Done, Failed, Fetched, Run  # noqa: E402


def harness(aging_s: float, max_queue: int) -> Harness:
    try:
        from disagg.settings.sections import ScheduleSettings
    except ImportError:  # before the schedule section
        return Harness(schedule_aging_s=aging_s, max_queue=max_queue)
    return Harness(schedule=ScheduleSettings(aging_s=aging_s), max_queue=max_queue)


def scenario(seed: int) -> list:
    rng = random.Random(seed)
    h = harness(rng.choice([0.05, 0.3, 10.0]), rng.choice([8, 4096]))
    for role in ("encoder", "denoiser", "decoder"):
        for _ in range(rng.randint(1, 4)):
            h.add(role, 1, capacity=rng.randint(1, 3), host=rng.choice(["h", "g"]))
    log, running, k = [], [], 0

    def feed(out):
        for o in out:
            m = o.msg
            log.append((o.to_client, o.to_instance, type(m).__name__, getattr(m, "request_id", None),
                        getattr(m, "attempt", None), getattr(m, "ok", None)))
            if isinstance(m, Run):
                running.append([o.to_instance, m.request_id, m.attempt])

    for step in range(400):
        r = rng.random()
        if r < 0.35:
            k += 1
            kw = dict(seed=1, priority=rng.choice([None, None, 0, 1, 2]))
            if rng.random() < 0.2:
                kw["slo_ms"] = rng.choice([50, 500, 5000])
            h.now += rng.choice([0, 0, 0.001, 0.02])
            feed(h.submit(f"r{k}", **kw))
        elif r < 0.8 and running:
            iid, rid, att = running.pop(rng.randrange(len(running)) if rng.random() < 0.5 else 0)
            h.now += rng.choice([0, 0.001, 0.01, 0.1])
            if rng.random() < 0.07:
                feed(h.role(iid, Failed(request_id=rid, attempt=att, error="boom", retryable=True)))
            elif iid.startswith("encoder"):
                feed(h.role(iid, staged(iid, rid, attempt=att, offset=rng.randrange(0, 1 << 18, 256))))
            elif iid.startswith("denoiser"):
                feed(h.role(iid, Fetched(request_id=rid, attempt=att)))
                feed(h.role(iid, staged(iid, rid, attempt=att, offset=rng.randrange(0, 1 << 18, 256))))
            else:
                feed(h.role(iid, Fetched(request_id=rid, attempt=att)))
                feed(h.role(iid, Done(request_id=rid, attempt=att, num_images=1), [b"png"]))
        elif r < 0.87 and k:
            feed(h.router.handle_client(b"client-1", Cancel(request_id=f"r{rng.randint(1, k)}"), [], h.now))
        else:
            feed(h.tick(rng.choice([0.0, 0.05, 0.5])))
        if step % 50 == 0:
            s = h.router.snapshot(h.now)
            log.append(("q", tuple(sorted(s.queues.items())), s.requests.completed, s.requests.failed,
                        repr(s.stage_times), repr(s.transfers), repr(s.pairs),
                        [(i.id, i.free_slots, i.in_flight, i.completed, i.state) for i in s.instances],
                        repr(s.rebalance), repr(s.queue_slack), repr(s.slo)))
    return log


def main() -> None:
    logging.disable(logging.CRITICAL)  # the Router logs every failure it scripts
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    digest = hashlib.sha256()
    for seed in range(n):
        digest.update(repr(scenario(seed)).encode())
    print(f"{n} scripts: {digest.hexdigest()}")


if __name__ == "__main__":
    main()
