"""How fast `admission: slo` refuses a request whose deadline it cannot meet: Submit to Rejected, as the client sees it.

    python benchmarks/admission.py            # 3 runs of 200 refusals each, one at a time

It launches sim:flux-h200 1:1:1 with --admission slo, runs 4 requests at 256^2 x 2 steps so every stage is
measured, then sends 200 requests of that shape with slo_ms 5 (they take ~160 ms alone) one after another and
reports the median and p99 of their latency: the refusal's whole round trip through the ZeroMQ client (what
a caller waits). Prints one JSON object per run, then the median of the medians and the worst p99.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.sim_suite import disagg, stop_all, wait_ready  # noqa: E402
from disagg.launcher.ports import free_port_pair  # noqa: E402

SHAPE = {"width": 256, "height": 256, "num_inference_steps": 2}


def run_once(n: int) -> dict:
    from disagg.client import Client
    from disagg.transport.wire.messages import ErrorCode, GenerationParams

    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(disagg("launch", "--model", "sim:flux-h200", "-e", "1", "-d", "1", "-k", "1", "--port",
                                   str(port), "--admission", "slo", "--no-dashboard", "--spares", "0"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_ready(endpoint, proc)
        with Client(endpoint) as client:
            client.run_all([GenerationParams(prompt="measure", seed=k, **SHAPE) for k in range(4)], concurrency=1)
            outs = client.run_all([GenerationParams(prompt="too soon", seed=k, slo_ms=5, **SHAPE) for k in range(n)],
                                  concurrency=1)
    finally:
        stop_all([proc])
    refused = sorted(o.latency_s * 1000 for o in outs if o.code == ErrorCode.DEADLINE)
    return {"refused": len(refused), "sent": n, "median_ms": round(statistics.median(refused), 3),
            "p99_ms": round(refused[min(len(refused) - 1, int(0.99 * len(refused)))], 3),
            "reason": next((o.error for o in outs if o.code == ErrorCode.DEADLINE), None)}


def main() -> None:
    runs = [run_once(200) for _ in range(3)]
    for r in runs:
        print(json.dumps(r))
    print(json.dumps({"median_of_medians_ms": statistics.median(r["median_ms"] for r in runs),
                      "worst_p99_ms": max(r["p99_ms"] for r in runs)}))


if __name__ == "__main__":
    main()
