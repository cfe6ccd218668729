"""A same-run A/B of two checkouts on `sim:zero` 1:1:1: each launches its own deployment with its own defaults,
and the rounds alternate between them (concurrency 1, 8, then 64, per round). Besides throughput and p50, each
bench reports the orchestrator's CPU time per request (its threads' time on a CPU over the bench's requests, warm-up
included: Linux's schedstat, in nanoseconds; elsewhere psutil's user + system time).

    git worktree add /tmp/before BASE_COMMIT
    python benchmarks/before_after.py --before /tmp/before [--rounds 3] [--launches 1] [--benches c1,c8,c64] [--out FILE]

`--launches N` starts both sides' deployments afresh N times (each then runs `--rounds` rounds) and reports medians
over every round of every launch: one deployment's figures can sit a few percent off another's of the same code for
as long as it runs (two deployments of one checkout, 15 rounds each: medians 159 against 166 µs at c64), so a
difference of that size needs several launches, not more rounds.

Each side runs its own `python -m disagg launch` and `python -m disagg bench` from its folder. `--before-set
DISAGG_X=V` (repeatable) sets a setting's variable for the before side's deployment only: with `--before .`, one
checkout with a setting against its default (`--before . --before-set DISAGG_FORWARD_MAX_WAIT_MS=0`: forwards off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.sim_suite import stop_all  # noqa: E402

BENCHES = {"c1": ["--concurrency", "1", "--num-requests", "500", "--warmup", "20"],
           "c8": ["--concurrency", "8", "--num-requests", "3000", "--warmup", "20"],
           "c64": ["--concurrency", "64", "--num-requests", "3000", "--warmup", "20"]}


def requests_of(bargs: list[str]) -> int:
    return int(bargs[bargs.index("--num-requests") + 1]) + int(bargs[bargs.index("--warmup") + 1])


def orchestrator(launch) -> psutil.Process:
    for child in psutil.Process(launch.pid).children(recursive=True):
        if "disagg.orchestrator" in " ".join(child.cmdline()):
            return child
    raise SystemExit("no orchestrator process under the launcher")


def cpu_s(proc: psutil.Process) -> float:
    """Its threads' CPU time: from /proc/PID/task/*/schedstat (nanoseconds) where there is one, else psutil's user +
    system (clock ticks: 10 ms, 3.3 µs a request of a 3,000-request bench)."""
    try:
        return sum(int(open(f"/proc/{proc.pid}/task/{tid}/schedstat").read().split()[0])
                   for tid in os.listdir(f"/proc/{proc.pid}/task")) / 1e9
    except (OSError, ValueError):
        t = proc.cpu_times()
        return t.user + t.system


def cli(tree: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "disagg", *args]


def ready(tree: Path, endpoint: str, proc, timeout_s: float = 180, count: int = 1) -> dict:
    """The deployment's status once at least `count` instances are registered and every one is ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{tree}: launch exited {proc.returncode}")
        res = subprocess.run(cli(tree, "status", "--endpoint", endpoint, "--json"), cwd=tree, capture_output=True,
                             text=True)
        if res.returncode == 0:
            doc = json.loads(res.stdout)
            if len(doc["instances"]) >= count and all(i["state"] == "ready" for i in doc["instances"]):
                return doc
        time.sleep(1)
    raise SystemExit(f"{tree}: not ready")


def run_launch(args, sides: dict, benches: dict, before_env: dict, base_port: int, launch: int, runs: dict) -> None:
    """Both sides' deployments launched afresh, `args.rounds` rounds alternating between them, rows added to `runs`.
    Odd launches run the after side first in each round (an order effect then cancels over an even number)."""
    procs, endpoints = {}, {}
    order = list(sides.items()) if launch % 2 == 0 else list(sides.items())[::-1]
    try:
        for i, (side, tree) in enumerate(sides.items()):
            port = base_port + 2 * i
            endpoints[side] = f"tcp://127.0.0.1:{port}"
            procs[side] = subprocess.Popen(cli(tree, "launch", "--model", "sim:zero", "-d", "1", "--spares", "0",
                                               "--no-dashboard", "--port", str(port)), cwd=tree,
                                           env=before_env if side == "before" else None,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for side, tree in sides.items():
            ready(tree, endpoints[side], procs[side])
        orchs = {side: orchestrator(procs[side]) for side in sides}
        for r in range(args.rounds):
            for side, tree in order:
                for bench, bargs in benches.items():
                    cpu0 = cpu_s(orchs[side])
                    res = subprocess.run(cli(tree, "bench", "--endpoint", endpoints[side], *bargs, "--json"), cwd=tree,
                                         capture_output=True, text=True)
                    if res.returncode != 0:
                        raise SystemExit(f"{side}/{bench}: {res.stderr[-1500:]}")
                    rep = json.loads(res.stdout)
                    row = {"rps": rep["throughput_rps"], "p50_ms": round(rep["latency_s"]["p50"] * 1000, 3),
                           "orch_cpu_us": round((cpu_s(orchs[side]) - cpu0) / requests_of(bargs) * 1e6, 1)}
                    runs[side][bench].append(row)
                    print(f"launch {launch + 1} round {r + 1} {side:6s} {bench:3s} {row['rps']:9.1f} req/s  "
                          f"p50 {row['p50_ms']:7.3f} ms  orchestrator {row['orch_cpu_us']:6.1f} µs CPU/request", flush=True)
    finally:
        stop_all(procs.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--launches", type=int, default=1, help="fresh deployments of both sides, each for --rounds rounds")
    ap.add_argument("--port", type=int, default=24800)
    ap.add_argument("--out", default="")
    ap.add_argument("--benches", default=",".join(BENCHES), help="which benches, comma-separated (c1, c8, c64)")
    ap.add_argument("--before-set", action="append", default=[], metavar="DISAGG_X=V",
                    help="a setting's environment variable for the before side's deployment only (repeatable)")
    args = ap.parse_args()
    before_env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.before_set))
    benches = {b: BENCHES[b] for b in args.benches.split(",")}
    sides = {"before": args.before.resolve(), "after": ROOT}
    runs = {s: {b: [] for b in benches} for s in sides}
    for launch in range(args.launches):
        run_launch(args, sides, benches, before_env, args.port + 4 * launch, launch, runs)
    print(f"\n| side | bench | req/s (median of {args.rounds * args.launches}) | p50 ms | orchestrator µs CPU/request |\n"
          "|---|---|---|---|---|")
    medians = {}
    for side, side_runs in runs.items():
        for bench, rows in side_runs.items():
            m = {k: statistics.median(x[k] for x in rows) for k in ("rps", "p50_ms", "orch_cpu_us")}
            medians[f"{side}/{bench}"] = m
            print(f"| {side} | {bench} | {m['rps']:.1f} | {m['p50_ms']:.3f} | {m['orch_cpu_us']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"medians": medians, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
