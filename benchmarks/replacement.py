"""How fast a killed role is replaced: kill -9 of each role kind under load, 3 times, per configuration.

    python benchmarks/replacement.py                      # tiny 1:1:1: no spare, one spare, a standby
    python benchmarks/replacement.py --kills 5 --out benchmarks/results/replacement-cpu.json

For each configuration it launches `disagg launch -e 1 -d 1 -k 1` plus the configuration's flags, runs a
closed loop of 4 clients, and for each role kind kills its serving instance `--kills` times, each kill
`--gap` s (default 12) after the previous replacement was up: the launcher treats a process that dies
within 10 s of its start as crash-looping and restarts it after 0.5, 1, 2 ... s, which is not what
this measures. Per kill it measures, from the SIGKILL:
- serving: until an instance of that role is ready again (the replacement, or a standby);
- replaced: until the killed instance's id is back with a new process, ready (or standby);
and counts the requests that failed. Medians per role kind are printed and stored.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from disagg.client import Client, Unreachable  # noqa: E402
from disagg.launcher.ports import free_port_pair  # noqa: E402
from disagg.transport.wire.messages import GenerationParams  # noqa: E402

CONFIGS = {
    "no spare": ["--spares", "0"],
    "one spare": ["--spares", "1"],
    "standby 0,1,0": ["--spares", "1", "--standby", "0,1,0"],
}
UP = ("ready", "standby")


def status(endpoint: str):
    with Client(endpoint) as client:
        return client.status(timeout_s=3)


def measure(name: str, flags: list[str], kills: int, gap: float) -> dict:
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    run_dir = Path(tempfile.mkdtemp(prefix="disagg-replace-"))
    cmd = [sys.executable, "-m", "disagg", "launch", "-e", "1", "-d", "1", "-k", "1", "--port", str(port),
           "--no-dashboard", "--run-dir", str(run_dir), *flags]
    print(f"{name}: $ {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=open(run_dir / "launch.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)
    n = 3 + flags.count("--standby")
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if sum(i.state in UP for i in status(endpoint).instances) >= n:
                    break
            except (Unreachable, RuntimeError):
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"not ready: see {run_dir / 'launch.log'}")
            time.sleep(0.5)
        time.sleep(8)  # a spare interpreter's imports
        stop = threading.Event()
        failed: list[str] = []

        def loop(k: int) -> None:
            with Client(endpoint) as client:
                i = 0
                while not stop.is_set():
                    [o] = client.run_all([GenerationParams(prompt=f"r {k} {i}", width=64, height=64, num_inference_steps=4,
                                                           seed=i)])
                    if not o.ok:
                        failed.append(o.error or "")
                    i += 1

        threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        result: dict = {"command": " ".join(cmd)}
        for role in ("encoder", "denoiser", "decoder"):
            serving, replaced = [], []
            for _ in range(kills):
                time.sleep(gap)
                victim = next(i for i in status(endpoint).instances if i.role == role and i.state == "ready")
                os.kill(victim.pid, signal.SIGKILL)
                t0, t_serving = time.monotonic(), None
                while time.monotonic() < t0 + 120:
                    try:
                        r = status(endpoint)
                    except (Unreachable, RuntimeError):
                        continue
                    now = time.monotonic()
                    if t_serving is None and any(i.role == role and i.state == "ready" and i.pid != victim.pid
                                                 for i in r.instances):
                        t_serving = now - t0
                    if any(i.id == victim.id and i.pid != victim.pid and i.state in UP for i in r.instances):
                        replaced.append(round(now - t0, 3))
                        serving.append(round(t_serving if t_serving is not None else now - t0, 3))
                        break
                    time.sleep(0.01)
            result[role] = {"serving_s": serving, "replaced_s": replaced,
                            "serving_median_s": statistics.median(serving), "replaced_median_s": statistics.median(replaced)}
            print(f"  {role}: serving again after {result[role]['serving_median_s']:.2f} s, replaced after "
                  f"{result[role]['replaced_median_s']:.2f} s (medians of {serving} / {replaced})", flush=True)
        stop.set()
        for t in threads:
            t.join(60)
        result["failed_requests"] = len(failed)
        print(f"  failed requests: {len(failed)}", flush=True)
        return result
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=3, help="kills per role kind and configuration (default 3)")
    ap.add_argument("--gap", type=float, default=12.0, help="seconds from a replacement to the next kill (default 12)")
    ap.add_argument("--only", help="comma-separated configuration names: " + ", ".join(CONFIGS))
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    results = {name: measure(name, CONFIGS[name], args.kills, args.gap) for name in names}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 1 if any(r["failed_requests"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
