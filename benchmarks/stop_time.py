"""How long a deployment takes to stop, two checkouts in the same run: `disagg launch --model tiny -e 1 -d 1 -k 1`
(with and without a gateway) until every instance is ready, then SIGTERM to the launcher, timed until it exited;
checkouts alternate, ROUNDS times each. Prints the medians.

    git worktree add /tmp/before COMMIT
    python benchmarks/stop_time.py --before /tmp/before [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from disagg.client import Client, Unreachable  # noqa: E402
from disagg.launcher.ports import free_port_pair  # noqa: E402


def one_stop(checkout: Path, http: bool) -> float:
    """Seconds from SIGTERM to the launcher's exit, once its deployment (run from `checkout`) was ready."""
    port = free_port_pair()
    extra = ["--http-port", str(free_port_pair())] if http else []
    proc = subprocess.Popen([sys.executable, "-m", "disagg", "launch", "--model", "tiny", "-e", "1", "-d", "1", "-k",
                             "1", "--no-dashboard", "--spares", "0", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=checkout)
    t0 = time.monotonic()
    with Client(f"tcp://127.0.0.1:{port}") as client:
        while True:
            if time.monotonic() - t0 > 120:
                proc.kill()
                raise SystemExit(f"{checkout}: not ready in 120 s")
            try:
                if sum(i.state == "ready" for i in client.status(timeout_s=2).instances) >= 3:
                    break
            except Unreachable:
                pass
            time.sleep(0.05)
    time.sleep(1.0)  # a gateway's first look at the orchestrator, as in any deployment that served a while
    t1 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return time.monotonic() - t1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="another checkout (git worktree) to compare with this one")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    checkouts = {"before": Path(args.before).resolve(), "after": ROOT}
    runs = {(name, http): [] for name in checkouts for http in (False, True)}
    for _ in range(args.rounds):
        for (name, http), times in runs.items():
            times.append(one_stop(checkouts[name], http))
    doc = {"rounds": args.rounds, **{f"{name}{' + gateway' if http else ''}": round(statistics.median(v), 2)
                                     for (name, http), v in runs.items()}}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
