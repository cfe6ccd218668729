"""Issue 23 item 9: choose per-role capacities and the orchestrator's busy polling by measurement.

    python benchmarks/defaults_ab.py [--rounds 3] [--out benchmarks/results/defaults-cpu.json]

Every variant is a deployment started once; the rounds alternate between them (round 1 of every variant, then
round 2, ...), so each comparison is within one run of this script on this machine. Per bench run it records
throughput, p50 latency and the orchestrator's CPU time per request (before_after.cpu_s, before and after the bench). Prints
a table of medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.before_after import cpu_s  # noqa: E402
from benchmarks.sim_suite import disagg, stop_all, summary, wait_ready  # noqa: E402

SMALL = ["--width", "256", "--height", "256", "--steps", "4"]
BENCHES = {
    "c1": ["--concurrency", "1", "--num-requests", "300", "--warmup", "10"],
    "c64": ["--concurrency", "64", "--num-requests", "2000", "--warmup", "20"],
}
FLUX_BENCHES = {
    "c1": ["--concurrency", "1", "--num-requests", "40", "--warmup", "2", *SMALL],
    "c64": ["--concurrency", "64", "--num-requests", "400", "--warmup", "8", *SMALL],
}
#: name -> (launch arguments, benches)
VARIANTS = {
    "zero cap 1,1,1": (["--model", "sim:zero", "-d", "1", "--capacity", "1,1,1"], BENCHES),
    "zero cap 4,2,4": (["--model", "sim:zero", "-d", "1", "--capacity", "4,2,4"], BENCHES),
    "zero cap 4,2,4 no busy-poll": (["--model", "sim:zero", "-d", "1", "--capacity", "4,2,4", "--busy-poll", "0"],
                                    BENCHES),
    "zero cap 4,2,4 busy-poll 1 ms": (["--model", "sim:zero", "-d", "1", "--capacity", "4,2,4", "--busy-poll", "0.001"],
                                      BENCHES),
    "zero cap 4,2,4 busy-poll 2 ms": (["--model", "sim:zero", "-d", "1", "--capacity", "4,2,4", "--busy-poll", "0.002"],
                                      BENCHES),
    # on simulated devices, one per instance: one instance's computes take turns on its device, as on a GPU
    "flux cap 1,1,1": (["--model", "sim:flux-h200", "-e", "1", "-d", "2", "-k", "1", "--gpus", "0,1,2,3",
                        "--capacity", "1,1,1"], FLUX_BENCHES),
    "flux cap 4,2,4": (["--model", "sim:flux-h200", "-e", "1", "-d", "2", "-k", "1", "--gpus", "0,1,2,3",
                        "--capacity", "4,2,4"], FLUX_BENCHES),
}


def orchestrator_cpu_s(endpoint: str) -> float:
    res = subprocess.run(disagg("status", "--endpoint", endpoint, "--json"), capture_output=True, text=True, check=True)
    pid = int(json.loads(res.stdout)["orchestrator"]["pid"])
    return cpu_s(psutil.Process(pid))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="variants whose name contains this text (default: all), e.g. flux")
    ap.add_argument("--port", type=int, default=24600)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    names = [n for n in VARIANTS if args.only in n]
    procs, endpoints = {}, {}
    results: dict = {n: {b: [] for b in VARIANTS[n][1]} for n in names}
    try:
        for i, name in enumerate(names):
            port = args.port + 2 * i
            endpoints[name] = f"tcp://127.0.0.1:{port}"
            procs[name] = subprocess.Popen(disagg("launch", *VARIANTS[name][0], "--spares", "0", "--no-dashboard",
                                                  "--port", str(port)),
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for name in names:
            wait_ready(endpoints[name], procs[name])
        for r in range(args.rounds):
            for name in names:
                for bench, bench_args in VARIANTS[name][1].items():
                    cpu0 = orchestrator_cpu_s(endpoints[name])
                    res = subprocess.run(disagg("bench", "--endpoint", endpoints[name], *bench_args, "--json"),
                                         capture_output=True, text=True)
                    if res.returncode != 0:
                        raise SystemExit(f"{name}/{bench}: {res.stderr[-1500:]}")
                    cpu = orchestrator_cpu_s(endpoints[name]) - cpu0
                    report = json.loads(res.stdout)
                    s = summary(report)
                    n = report.get("completed") or report.get("num_requests") or 1
                    s["orchestrator_cpu_ms_per_request"] = round(cpu * 1000 / n, 3)
                    results[name][bench].append(s)
                    print(f"round {r + 1} {name:28s} {bench:4s} {s['throughput_rps']:9.1f} req/s  p50 "
                          f"{s['p50_ms']:9.2f} ms  orch CPU {s['orchestrator_cpu_ms_per_request']:.3f} ms/req", flush=True)
    finally:
        stop_all(procs.values())
    print(f"\nmedians of {args.rounds} alternating rounds:")
    print("| variant | bench | req/s | p50 ms | orchestrator CPU ms/request |\n|---|---|---|---|---|")
    table = {}
    for name, benches in results.items():
        for bench, runs in benches.items():
            med = {k: statistics.median([x[k] for x in runs]) for k in ("throughput_rps", "p50_ms",
                                                                          "orchestrator_cpu_ms_per_request")}
            table[f"{name} / {bench}"] = med
            print(f"| {name} | {bench} | {med['throughput_rps']:.1f} | {med['p50_ms']:.2f} | "
                  f"{med['orchestrator_cpu_ms_per_request']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"medians": table, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
