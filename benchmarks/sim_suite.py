"""Every `sim` number in BENCHMARKS.md, in one command: launches each deployment, runs its benches.

    python benchmarks/sim_suite.py                       # all of it, 3 runs each (~25 min on 2 cores)
    python benchmarks/sim_suite.py --only zero,zero16 --runs 5 --out /tmp/zero.json

Each deployment is started with `disagg launch ... --no-dashboard --port P`, waited for with
`disagg status --json`, loaded with `disagg bench ... --json` (the exact commands are printed and
stored with the results), then stopped with SIGTERM. The output JSON keeps every run's report
plus the medians of the figures the targets are about.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

FLUX_1024 = ["--width", "1024", "--height", "1024", "--steps", "4"]

#: name -> (launch arguments, {bench name: bench arguments})
SUITES: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    "zero": (["--model", "sim:zero", "-d", "1"], {
        "c1": ["--concurrency", "1", "--num-requests", "500", "--warmup", "20"],
        "c64": ["--concurrency", "64", "--num-requests", "3000", "--warmup", "20"],
    }),
    "zero16": (["--model", "sim:zero", "-d", "1", "--capacity", "16,16,16"], {
        "c1": ["--concurrency", "1", "--num-requests", "500", "--warmup", "20"],
        "c64": ["--concurrency", "64", "--num-requests", "3000", "--warmup", "20"],
    }),
    "zero32": (["--model", "sim:zero", "-d", "1", "--capacity", "32,32,32"], {
        "c1": ["--concurrency", "1", "--num-requests", "500", "--warmup", "20"],
        "c64": ["--concurrency", "64", "--num-requests", "3000", "--warmup", "20"],
    }),
    "zero16-nolane": (["--model", "sim:zero", "-d", "1", "--capacity", "16,16,16", "--no-lane"], {
        "c1": ["--concurrency", "1", "--num-requests", "500", "--warmup", "20"],
        "c64": ["--concurrency", "64", "--num-requests", "3000", "--warmup", "20"],
    }),
    "flux-1-6-1": (["--model", "sim:flux-h200", "-e", "1", "-d", "6", "-k", "1", "--capacity", "1,1,1"], {
        "c32": ["--concurrency", "32", "--num-requests", "400", "--warmup", "2", *FLUX_1024],
    }),
    "disagg-8dev": (["--config", "configs/sim-flux-h200-8dev.yaml"], {
        "c32": ["--concurrency", "32", "--num-requests", "300", "--warmup", "2", *FLUX_1024],
    }),
    "colocated-8dev": (["--model", "sim:flux-h200", "--colocated", "8", "--gpus", "0,1,2,3,4,5,6,7"], {
        "c32": ["--concurrency", "32", "--num-requests", "300", "--warmup", "2", *FLUX_1024],
    }),
    "batch1-256": (["--model", "sim:flux-h200", "-e", "1", "-d", "1", "-k", "1", "--max-batch", "1"], {
        "c16": ["--concurrency", "16", "--num-requests", "200", "--warmup", "8", "--width", "256", "--height", "256",
                "--steps", "4"],
    }),
    "batch8-256": (["--model", "sim:flux-h200", "-e", "1", "-d", "1", "-k", "1", "--max-batch", "8"], {
        "c16": ["--concurrency", "16", "--num-requests", "200", "--warmup", "8", "--width", "256", "--height", "256",
                "--steps", "4"],
    }),
    "slow-max-free-slots": (["--config", "configs/sim-flux-h200-slow-denoiser.yaml", "--dispatch", "max-free-slots"], {
        "closed-c6": ["--concurrency", "6", "--num-requests", "60", "--warmup", "3", *FLUX_1024],
        "open-3rps": ["--request-rate", "3", "--num-requests", "90", "--warmup", "3", *FLUX_1024],
    }),
    "slow-least-work": (["--config", "configs/sim-flux-h200-slow-denoiser.yaml", "--dispatch", "least-work"], {
        "closed-c6": ["--concurrency", "6", "--num-requests", "60", "--warmup", "3", *FLUX_1024],
        "open-3rps": ["--request-rate", "3", "--num-requests", "90", "--warmup", "3", *FLUX_1024],
    }),
}


def disagg(*args: str) -> list[str]:
    return [sys.executable, "-m", "disagg", *args]


def wait_ready(endpoint: str, proc: subprocess.Popen, timeout_s: float = 300) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"launch exited with {proc.returncode}")
        res = subprocess.run(disagg("status", "--endpoint", endpoint, "--json"), capture_output=True, text=True)
        if res.returncode == 0:
            doc = json.loads(res.stdout)
            if doc["instances"] and all(i["state"] == "ready" for i in doc["instances"]):
                return len(doc["instances"])
        time.sleep(1)
    raise SystemExit(f"deployment at {endpoint} not ready in {timeout_s} s")


def stop_all(procs) -> None:
    """SIGTERM every launch, then wait for each (SIGKILL after 30 s)."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def launched(config: Path):
    """A deployment of `config` on a free port (no dashboard, no spare interpreters), once ready: its endpoint.
    Stopped on the way out."""
    from disagg.launcher.ports import free_port_pair

    port = free_port_pair()
    proc = subprocess.Popen(disagg("launch", "--config", str(config), "--port", str(port), "--no-dashboard",
                                   "--spares", "0"), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        endpoint = f"tcp://127.0.0.1:{port}"
        wait_ready(endpoint, proc)
        yield endpoint
    finally:
        stop_all([proc])


def summary(report: dict) -> dict:
    utils = [i["utilization"] for i in report["instances"] if i["role"] == "denoiser"]
    return {
        "throughput_rps": report["throughput_rps"],
        "p50_ms": round(report["latency_s"]["p50"] * 1000, 3),
        "p95_s": report["latency_s"]["p95"],
        "p99_s": report["latency_s"]["p99"],
        "mean_s": report["latency_s"]["mean"],
        "failed": report["failed"],
        "denoiser_utilization_mean": round(statistics.fmean(utils), 4) if utils else None,
    }


def run_suite(name: str, port: int, runs: int) -> dict:
    launch_args, benches = SUITES[name]
    endpoint = f"tcp://127.0.0.1:{port}"
    launch = disagg("launch", *launch_args, "--no-dashboard", "--port", str(port))
    print(f"== {name}: {shlex.join(['disagg', *launch[3:]])}", flush=True)
    proc = subprocess.Popen(launch, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    out = {"launch": shlex.join(["disagg", *launch[3:]]), "benches": {}}
    try:
        wait_ready(endpoint, proc)
        for bench, args in benches.items():
            cmd = disagg("bench", "--endpoint", endpoint, *args, "--json")
            reports = []
            for r in range(runs):
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    raise SystemExit(f"{name}/{bench} failed: {res.stderr[-2000:]}")
                reports.append(json.loads(res.stdout))
                s = summary(reports[-1])
                print(f"   {bench} run {r + 1}: {s['throughput_rps']} req/s, p50 {s['p50_ms']} ms, "
                      f"p95 {s['p95_s']} s, denoiser util {s['denoiser_utilization_mean']}", flush=True)
            runs_summary = [summary(x) for x in reports]
            out["benches"][bench] = {
                "command": shlex.join(["disagg", *cmd[3:]]),
                "runs": runs_summary,
                "median": {k: statistics.median([s[k] for s in runs_summary]) for k in runs_summary[0]
                           if runs_summary[0][k] is not None},
                "reports": reports,
            }
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SUITES), help=f"comma-separated, from: {', '.join(SUITES)}")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--port", type=int, default=24400)
    ap.add_argument("--out", default="", help="write the results here (JSON)")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        ap.error(f"unknown suite(s) {unknown}; choose from {list(SUITES)}")
    results = {}
    for i, name in enumerate(names):
        results[name] = run_suite(name, args.port + 2 * i, args.runs)
    print("\nmedians:")
    for name, res in results.items():
        for bench, b in res["benches"].items():
            print(f"  {name:22s} {bench:10s} {json.dumps(b['median'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
