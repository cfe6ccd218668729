"""One denoiser rank against a 2-rank Ulysses denoiser, same requests: per-request latency and denoiser time.

    python benchmarks/parallel.py                       # tiny, 256x256, 8 steps, 6 requests each, 3 runs
    python benchmarks/parallel.py --size 512 --out benchmarks/results/parallel-cpu.json

Each layout is a real 1:1:1 deployment (the denoiser's ranks over gloo on this host's CPUs); requests run one
at a time, so the time is the latency one request sees. On a 2-core VM the two ranks share the cores the
one rank had, and the all-to-alls cost more than they save: this measures the mechanism's overhead, not a
speedup (that needs a device per rank).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from disagg.client import Client, Unreachable  # noqa: E402
from disagg.launcher.ports import free_port_pair  # noqa: E402
from disagg.transport.wire.messages import GenerationParams  # noqa: E402

LAYOUTS = {"1 rank": "", "ulysses 2": "parallel:\n  denoiser: {ulysses: 2}\n"}


def measure(name: str, extra: str, params: list[GenerationParams]) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="disagg-par-"))
    cfg = run_dir / "config.yaml"
    cfg.write_text("denoisers: {count: 1}\n" + extra)
    port = free_port_pair()
    proc = subprocess.Popen([sys.executable, "-m", "disagg", "launch", "--config", str(cfg), "--port", str(port),
                             "--no-dashboard", "--spares", "0", "--run-dir", str(run_dir)], cwd=ROOT,
                            stdout=open(run_dir / "launch.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with Client(endpoint) as c:
                    if sum(i.state == "ready" for i in c.status(timeout_s=2).instances) == 3:
                        break
            except Unreachable:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{name}: not ready; see {run_dir}")
            time.sleep(0.3)
        with Client(endpoint) as c:
            c.run_all(params[:1], concurrency=1)  # warm-up
            outcomes = c.run_all(params, concurrency=1, timeout_s=600)
        bad = [o.error for o in outcomes if not o.ok]
        if bad:
            raise RuntimeError(f"{name}: {bad[0]}")
        return {"latency_s": statistics.median(o.latency_s for o in outcomes),
                "denoiser_s": statistics.median(o.timings["compute_denoiser"] for o in outcomes)}
    finally:
        try:
            with Client(endpoint) as c:
                c.stop(timeout_s=5)
        except Exception:  # noqa: BLE001
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    params = [GenerationParams(prompt=f"a photo {i}", seed=i, width=args.size, height=args.size,
                               num_inference_steps=args.steps) for i in range(args.requests)]
    runs = []
    for r in range(args.runs):  # the layouts alternate, so a noisy stretch of the machine hits both
        runs.append({name: measure(name, extra, params) for name, extra in LAYOUTS.items()})
        print(f"run {r + 1}: " + ", ".join(f"{n}: {v['latency_s'] * 1e3:.0f} ms/request "
                                           f"(denoiser {v['denoiser_s'] * 1e3:.0f} ms)" for n, v in runs[-1].items()),
              flush=True)
    summary = {name: {k: round(statistics.median(run[name][k] for run in runs), 4) for k in ("latency_s", "denoiser_s")}
               for name in LAYOUTS}
    for name, v in summary.items():
        print(f"{name:>10}: median {v['latency_s'] * 1e3:.0f} ms per request, denoiser {v['denoiser_s'] * 1e3:.0f} ms "
              f"({v['denoiser_s'] / args.steps * 1e3:.1f} ms per step)")
    if args.out:
        args.out.write_text(json.dumps({"size": args.size, "steps": args.steps, "requests": args.requests,
                                        "runs": runs, "median": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
