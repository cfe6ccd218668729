"""A deployment's start with and without the fork server, in the same run: `disagg launch` of the tiny model
until every instance is ready, alternating `--fork-server` and `--no-fork-server`, ROUNDS times each.
Prints the medians of the seconds to ready and of the CPU seconds of the launch and all its processes.

    python benchmarks/fork_start.py [--rounds 3] [--layout 1,1,1]
"""

from __future__ import annotations

import argparse
import json
import resource
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


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def one_start(flag: str, layout: list[str], n: int, run_dir: Path) -> tuple[float, float]:
    port = free_port_pair()
    cpu0, t0 = children_cpu(), time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "disagg", "launch", "--model", "tiny", "-e", layout[0], "-d",
                             layout[1], "-k", layout[2], "--no-dashboard", "--spares", "0", flag, "--port", str(port),
                             "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    ready = None
    with Client(f"tcp://127.0.0.1:{port}") as client:
        while ready is None and time.monotonic() - t0 < 120:
            try:
                if sum(i.state == "ready" for i in client.status(timeout_s=2).instances) >= n:
                    ready = time.monotonic() - t0
            except Unreachable:
                pass
            time.sleep(0.05)
    proc.terminate()
    proc.communicate(timeout=60)
    if ready is None:
        raise SystemExit(f"{flag}: not ready in 120 s")
    return ready, children_cpu() - cpu0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layout", default="1,1,1", help="encoders,denoisers,decoders")
    args = ap.parse_args()
    layout = args.layout.split(",")
    n = sum(map(int, layout))
    runs: dict[str, list[tuple[float, float]]] = {"--fork-server": [], "--no-fork-server": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            for flag in runs:
                runs[flag].append(one_start(flag, layout, n, Path(tmp) / f"{flag[2:]}-{k}"))
    doc = {"layout": args.layout, "rounds": args.rounds, **{
        flag[2:]: {"ready_s": round(statistics.median(r for r, _ in v), 2),
                   "cpu_s": round(statistics.median(c for _, c in v), 2)} for flag, v in runs.items()}}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
