"""A role's CPU per stage, in one process (no sockets, no other processes): `python benchmarks/role_bench.py`.

Runs requests through an encoder's, a denoiser's and a decoder's StageRunner (disagg/roles/compute.py) of a sim
model, each on its own shared-memory pool, the denoiser and the decoder pulling their input from the stage before
with the shm engine, as three roles on one host do. Prints the CPU microseconds (time.process_time) of each stage's
`execute`: its pull, compute, staging and report, without the loop around it. What the orchestrator's Router costs
per request, `benchmarks/router_bench.py` measures alike.

    python benchmarks/role_bench.py [--model sim:zero] [--requests 3000] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from disagg.roles.compute import StageRunner  # noqa: E402
from disagg.roles.pipelines import load_adapter  # noqa: E402
from disagg.roles.stage import Stage  # noqa: E402
from disagg.transport.data.engines import make_engines  # noqa: E402
from disagg.transport.data.pool import ShmPool  # noqa: E402
from disagg.transport.wire.messages import GenerationParams, PoolInfo, Run, Source  # noqa: E402

ROLES = ("encoder", "denoiser", "decoder")


class Chain:
    """The three stages' runners, each reporting into `reports[role]`."""

    def __init__(self, model: str):
        self.reports: dict[str, object] = {}
        self.runners: dict[str, StageRunner] = {}
        for role in ROLES:
            pool = ShmPool(f"role-bench-{role}-{os.getpid()}", 16 << 20)
            engines = make_engines(pool, "shm", None, logging.getLogger("role_bench"), {})
            runner = StageRunner(f"{role}-0", pool, engines, lambda msg, frames=(), role=role: self._report(role, msg))
            runner.stage = Stage(role, load_adapter(model, role), model=model)
            self.runners[role] = runner

    def _report(self, role: str, msg) -> None:
        if msg is not None:  # (None: the compute's end, counted by the worker)
            self.reports[role] = msg

    def source(self, role: str) -> Source:
        pool = self.runners[role].pool
        info = PoolInfo(host_id="h", engines=["shm"], pool_name=pool.name, pool_bytes=pool.nbytes, device="cpu")
        return Source(slot=self.reports[role].slot, pool=info, engine="shm")

    def one(self, k: int, spent: dict[str, list[float]]) -> None:
        """Request `k` through the three stages; each stage's CPU seconds appended to spent[role]."""
        params = GenerationParams(prompt="a cat", width=64, height=64, num_inference_steps=1, seed=k)
        before = None
        for role in ROLES:
            run = Run(request_id=f"r{k}", attempt=1, params=params,
                      source=self.source(before) if before is not None else None)
            t0 = time.process_time()
            self.runners[role].execute(run, [], time.perf_counter())
            spent[role].append(time.process_time() - t0)
            before = role
        for role in ROLES[:-1]:  # the next stage pulled it: the orchestrator's Release
            self.runners[role].release(self.reports[role].slot.offset, f"r{k}")

    def close(self) -> None:
        for runner in self.runners.values():
            for engine in runner.engines.values():
                engine.close()
            runner.pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="sim:zero")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    chain = Chain(args.model)
    try:
        warm = {r: [] for r in ROLES}
        for k in range(300):
            chain.one(k, warm)
        runs = []
        for run in range(args.runs):
            spent = {r: [] for r in ROLES}
            for k in range(args.requests):
                chain.one(k, spent)
            runs.append({r: statistics.mean(v) * 1e6 for r, v in spent.items()})
    finally:
        chain.close()
    doc = {r: round(statistics.median(x[r] for x in runs), 1) for r in ROLES}
    doc["per_request"] = round(sum(doc[r] for r in ROLES), 1)
    if args.json:
        print(json.dumps({"model": args.model, "us_per_stage": doc, "runs": runs}, indent=1))
    else:
        print(f"{args.model}: µs CPU per stage (median of {args.runs} runs of {args.requests}): "
              + ", ".join(f"{r} {doc[r]}" for r in ROLES) + f"; {doc['per_request']} per request")


if __name__ == "__main__":
    main()
