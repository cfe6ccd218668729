"""Chaos: a constant load while a random process of the deployment is killed with SIGKILL every 15 s.

    python benchmarks/chaos.py                          # tiny 1:2:1 + gateway, 60 s calm, 180 s chaos
    python benchmarks/chaos.py --runs 3 --out benchmarks/results/chaos-cpu.json
    python benchmarks/chaos.py --duration 60 --baseline 20 --interval 10     # a quick look

It launches `disagg launch -e 1 -d 2 -k 1 --http-port P` (plus any --launch-arg), then drives two
closed loops at once for the whole time: `--concurrency` threads through the ZeroMQ client (as `disagg
submit` does) and as many through the HTTP gateway (each retries a dropped connection under the same
X-Request-Id, as an HTTP client of a service should). First `--baseline` seconds without faults, then
`--duration` seconds in which every `--interval` s one of the orchestrator, the gateway or a role process
(each in turn, in a random order every round) gets SIGKILL. It reports, per run:
- requests completed, lost (ended in an error, or no answer) and duplicated (answered twice);
- p50 / p99 latency with and without faults;
- the longest a request waited because of a fault (its latency minus the fault-free median, over the
  requests in flight at a kill);
- whether, after the load drained, every instance is back, with every slot free and nothing left in
  any pool.
It exits 1 if a request was lost or duplicated, or the deployment did not come back to capacity.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from disagg.client import Client, Unreachable  # noqa: E402
from disagg.launcher.ports import free_port_pair  # noqa: E402
from disagg.transport.wire.messages import GenerationParams  # noqa: E402

REQUEST = {"width": 64, "height": 64, "num_inference_steps": 4}
#: --deadlines: requests mix long and short, priorities 0-2 and a deadline each, so that a `schedule: slo`
#: deployment reorders queues and interleaves steps while processes die
DEADLINES = False


def scheduling(n: int) -> dict:
    if not DEADLINES:
        return {}
    return {"num_inference_steps": (4, 16, 4)[n % 3], "priority": n % 3, "slo_ms": (5_000, 20_000, 60_000)[n % 3]}


class Run:
    """One chaos run: its deployment, its load threads, its kills."""

    def __init__(self, args, run_dir: Path):
        self.args = args
        self.port, self.http_port = free_port_pair(), free_port_pair()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.run_dir = run_dir
        self.records: list[dict] = []
        self.lock = threading.Lock()
        self.kills: list[tuple[float, str]] = []
        self.phase = "baseline"
        self.stop_at = 0.0
        self.answers: dict[str, int] = {}
        self.cmd = [sys.executable, "-m", "disagg", "launch", "-e", "1", "-d", "2", "-k", "1", "--model", args.model,
                    "--port", str(self.port), "--http-port", str(self.http_port), "--no-dashboard",
                    "--run-dir", str(run_dir), *args.launch_arg]

    def status(self):
        with Client(self.endpoint) as client:
            return client.status(timeout_s=3)

    def start(self) -> None:
        print("$", " ".join(self.cmd), flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.run_dir / "launch.log", "w"), stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                report = self.status()
                if sum(i.state in ("ready", "standby") for i in report.instances) >= 4 and report.gateways:
                    return
            except (Unreachable, RuntimeError):
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"the deployment exited: see {self.run_dir / 'launch.log'}")
            time.sleep(0.5)
        raise SystemExit("the deployment was not ready in 300 s")

    def record(self, path: str, rid: str, t0: float, ok: bool, error: str | None) -> None:
        with self.lock:
            if ok:
                self.answers[rid] = self.answers.get(rid, 0) + 1
            self.records.append({"path": path, "id": rid, "phase": self.phase, "start": t0, "end": time.monotonic(),
                                 "ok": ok, "error": error})

    # --- the load ------------------------------------------------------------------------------

    def zmq_loop(self, k: int) -> None:
        n = 0
        with Client(self.endpoint) as client:
            while time.monotonic() < self.stop_at:
                rid = f"z{k}-{uuid.uuid4().hex[:8]}"
                t0 = time.monotonic()
                try:
                    [o] = client.run_all([GenerationParams(prompt=f"chaos zmq {k} {n}", seed=n, **{**REQUEST, **scheduling(n)})], ids=[rid])
                    self.record("zmq", rid, t0, o.ok, o.error)
                except (Unreachable, RuntimeError) as exc:
                    self.record("zmq", rid, t0, False, str(exc))
                    time.sleep(0.2)
                n += 1

    def http_loop(self, k: int) -> None:
        n = 0
        with httpx.Client(base_url=self.http, timeout=120) as http:
            while time.monotonic() < self.stop_at:
                rid = f"h{k}-{uuid.uuid4().hex[:8]}"
                t0 = time.monotonic()
                body = {"prompt": f"chaos http {k} {n}", "size": "64x64", "seed": n, "num_inference_steps": 4, **scheduling(n)}
                ok, error = False, None
                while time.monotonic() < t0 + 120:
                    try:
                        r = http.post("/v1/images/generations", json=body, headers={"X-Request-Id": rid})
                    except httpx.TransportError as exc:  # the gateway died under us: again, same id
                        error = f"{type(exc).__name__}: {exc}"
                        time.sleep(0.2)
                        continue
                    if r.status_code in (502, 503):  # the orchestrator is restarting: the gateway says so
                        error = r.text[:200]
                        time.sleep(0.2)
                        continue
                    ok, error = r.status_code == 200, None if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
                    break
                self.record("http", rid, t0, ok, error)
                n += 1

    # --- the faults ----------------------------------------------------------------------------

    def victims(self) -> dict[str, int]:
        report = self.status()
        pids = {i.id: i.pid for i in report.instances if i.state != "dead"}
        pids["orchestrator"] = int(report.orchestrator["pid"])
        for g in report.gateways:
            pids["gateway"] = g.pid
        return pids

    def chaos(self, rng: random.Random) -> None:
        """Every interval one process: each in turn, in an order shuffled anew every round."""
        next_kill = time.monotonic() + self.args.interval
        turn: list[str] = []
        while time.monotonic() < self.stop_at:
            time.sleep(max(0.0, min(next_kill, self.stop_at) - time.monotonic()))
            if time.monotonic() >= self.stop_at:
                return
            try:
                pids = self.victims()
            except (Unreachable, RuntimeError):
                next_kill = time.monotonic() + 1  # between a kill and its recovery: try again soon
                continue
            if not turn:
                turn = sorted(pids)
                rng.shuffle(turn)
            name = turn.pop()
            if name not in pids:  # not back yet: the next one
                continue
            try:
                os.kill(pids[name], signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.kills.append((time.monotonic(), name))
            print(f"  {time.strftime('%H:%M:%S')} kill -9 {name} (pid {pids[name]})", flush=True)
            next_kill += self.args.interval

    def load(self, seconds: float, rng: random.Random | None) -> None:
        self.stop_at = time.monotonic() + seconds
        threads = [threading.Thread(target=self.zmq_loop, args=(k,), daemon=True) for k in range(self.args.concurrency)]
        threads += [threading.Thread(target=self.http_loop, args=(k,), daemon=True) for k in range(self.args.concurrency)]
        if rng is not None:
            threads.append(threading.Thread(target=self.chaos, args=(rng,), daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 300)

    def back_at_capacity(self) -> tuple[bool, str]:
        """After the drain: every instance up, every slot free, nothing in any pool."""
        deadline = time.monotonic() + 60
        why = ""
        while time.monotonic() < deadline:
            try:
                r = self.status()
            except (Unreachable, RuntimeError) as exc:
                why = str(exc)
                time.sleep(1)
                continue
            up = [i for i in r.instances if i.state in ("ready", "standby")]
            bad = [f"{i.id}: {i.state}, {i.free_slots}/{i.capacity} free, {i.pool_used_bytes} B staged, "
                   f"{i.pool_bytes - i.pool_free_bytes} B used" for i in up
                   if i.free_slots != i.capacity or i.pool_used_bytes or i.pool_free_bytes != i.pool_bytes]
            why = "; ".join(bad) or (f"{len(up)} of 4 instances up" if len(up) < 4 else "") or (
                "" if r.gateways else "no gateway") or ("" if r.requests.in_flight == 0 else f"{r.requests.in_flight} in flight")
            if not why:
                return True, "every instance up, every slot free, every pool empty"
            time.sleep(1)
        return False, why

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(run: Run, capacity: tuple[bool, str]) -> dict:
    calm = [r["end"] - r["start"] for r in run.records if r["phase"] == "baseline" and r["ok"]]
    chaos_recs = [r for r in run.records if r["phase"] == "chaos"]
    lat = [r["end"] - r["start"] for r in chaos_recs if r["ok"]]
    p50_calm = statistics.median(calm) if calm else 0.0
    hit = [r for r in chaos_recs if any(r["start"] <= t <= r["end"] for t, _ in run.kills)]
    lost = [r for r in run.records if not r["ok"]]
    duplicated = [rid for rid, n in run.answers.items() if n > 1]
    return {
        "requests": len(run.records), "completed": sum(r["ok"] for r in run.records), "lost": len(lost),
        "duplicated": len(duplicated), "lost_errors": sorted({str(r["error"])[:160] for r in lost})[:10],
        "kills": [name for _, name in run.kills],
        "latency_s": {"baseline_p50": round(p50_calm, 3), "baseline_p99": round(pct(calm, 0.99), 3),
                      "chaos_p50": round(statistics.median(lat) if lat else 0.0, 3), "chaos_p99": round(pct(lat, 0.99), 3)},
        "requests_hit_by_a_fault": len(hit),
        "longest_fault_wait_s": round(max((r["end"] - r["start"] - p50_calm for r in hit), default=0.0), 3),
        "per_path": {path: {"completed": sum(r["ok"] for r in run.records if r["path"] == path),
                            "lost": sum(not r["ok"] for r in run.records if r["path"] == path)} for path in ("zmq", "http")},
        "back_at_capacity": capacity[0], "capacity_check": capacity[1],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of load with faults (default 180)")
    ap.add_argument("--baseline", type=float, default=60.0, help="seconds of the same load without faults first (default 60)")
    ap.add_argument("--interval", type=float, default=15.0, help="seconds between kills (default 15)")
    ap.add_argument("--concurrency", type=int, default=2, help="closed-loop clients per path, ZeroMQ and HTTP (default 2)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="the victims' order (run i uses seed + i)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--launch-arg", action="append", default=[], help="one more argument for disagg launch (repeatable)")
    ap.add_argument("--out", help="write every run's report here as JSON")
    ap.add_argument("--deadlines", action="store_true", help="requests of 4 and 16 steps with priorities 0-2 and "
                    "slo_ms 5, 20 and 60 s (for --launch-arg=--schedule --launch-arg=slo)")
    args = ap.parse_args()
    global DEADLINES
    DEADLINES = args.deadlines
    reports = []
    for i in range(args.runs):
        run = Run(args, Path(tempfile.mkdtemp(prefix="disagg-chaos-")))
        print(f"run {i + 1}/{args.runs}: logs in {run.run_dir}", flush=True)
        run.start()
        try:
            time.sleep(8)  # the spare interpreter's imports: not part of the load
            run.phase = "baseline"
            run.load(args.baseline, None)
            run.phase = "chaos"
            run.load(args.duration, random.Random(args.seed + i))
            report = summarize(run, run.back_at_capacity())
        finally:
            run.stop()
        report["command"] = " ".join(run.cmd)
        print(json.dumps(report, indent=1), flush=True)
        reports.append(report)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": reports}, indent=1) + "\n")
    failed = [r for r in reports if r["lost"] or r["duplicated"] or not r["back_at_capacity"]]
    print(f"{len(reports) - len(failed)} of {len(reports)} runs: 0 lost, 0 duplicated, back at capacity")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
