"""Cost of the Router's logic per request (no sockets), by cluster size: `python benchmarks/router_bench.py`.

Drives requests through Submit, Staged, Fetched, Staged, Fetched, Done with the scripted harness of
tests/router_harness.py, with 1 to 1,024 instances per role, and prints microseconds per request:
- `idle`: one request at a time (every instance free);
- `backlog`: the same while 10,000 requests wait in the encoder queue (every instance busy: dispatch
  must not scan them all for each message);
plus the time of one `status` snapshot and one `tick` at that size.

    python benchmarks/router_bench.py --sizes 1,8,64,256,1024 --requests 2000 --json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from disagg.transport.wire.messages import Done, Fetched, Result, Run  # noqa: E402
from tests.test_router import Harness, staged  # noqa: E402


def deployment(n: int) -> Harness:
    h = Harness()
    for role in ("encoder", "denoiser", "decoder"):
        h.add(role, n)
    return h


class Driver:
    """Answers every Run the router sends, as its role would, oldest first; counts finished requests."""

    def __init__(self, h: Harness):
        self.h = h
        self.runs: collections.deque = collections.deque()
        self.done = 0
        self.offsets: dict[str, int] = collections.Counter()

    def feed(self, out) -> None:
        for o in out:
            if isinstance(o.msg, Run):
                self.runs.append((o.to_instance, o.msg.request_id))
            elif isinstance(o.msg, Result):
                self.done += 1

    def step(self) -> None:
        iid, rid = self.runs.popleft()
        h = self.h
        offset = self.offsets[iid] = (self.offsets[iid] + 256) % (1 << 19)  # a slot of its own per output
        if iid.startswith("encoder"):
            self.feed(h.role(iid, staged(iid, rid, offset=offset)))
        elif iid.startswith("denoiser"):
            self.feed(h.role(iid, Fetched(request_id=rid, attempt=1)))
            self.feed(h.role(iid, staged(iid, rid, offset=offset)))
        else:
            self.feed(h.role(iid, Fetched(request_id=rid, attempt=1)))
            self.feed(h.role(iid, Done(request_id=rid, attempt=1, num_images=1), [b"png"]))


def measure(n: int, requests: int, backlog: int) -> dict:
    h = deployment(n)
    d = Driver(h)
    k = 0
    for k in range(n + backlog if backlog else 1):  # with a backlog: every encoder busy, `backlog` waiting
        d.feed(h.submit(f"r{k}", seed=1))
    t0 = time.perf_counter()
    while d.done < requests:
        before = d.done
        d.step()
        if d.done > before:  # one finished: one more comes in, so the backlog (or the single one) stays
            k += 1
            d.feed(h.submit(f"r{k}", seed=1))
    per_request = (time.perf_counter() - t0) / requests
    t0 = time.perf_counter()
    for _ in range(20):
        h.router.snapshot(h.now)
    status_s = (time.perf_counter() - t0) / 20
    t0 = time.perf_counter()
    for _ in range(20):
        h.router.tick(h.now)
    tick_s = (time.perf_counter() - t0) / 20
    return {"instances_per_role": n, "backlog": backlog, "us_per_request": round(per_request * 1e6, 1),
            "status_ms": round(status_s * 1e3, 2), "tick_ms": round(tick_s * 1e3, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,8,64,256,1024")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--backlog", type=int, default=10_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for n in map(int, args.sizes.split(",")):
        for backlog in (0, args.backlog):
            rows.append(measure(n, args.requests, backlog))
            if not args.json:
                r = rows[-1]
                print(f"{n:5d} per role, backlog {backlog:6d}: {r['us_per_request']:8.1f} µs/request, "
                      f"status {r['status_ms']:7.2f} ms, tick {r['tick_ms']:7.3f} ms", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
