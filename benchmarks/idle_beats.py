"""The orchestrator's CPU while no request is in flight, as a large deployment's heartbeats arrive: a `sim:zero`
1:1:1 deployment, plus N more instances whose heartbeats come spread over each second (one every 1/N s), as those of
a deployment of N instances on many hosts do. Its idle cost should grow with the heartbeats it handles, not with a
busy-poll window each of them opens.

    python benchmarks/idle_beats.py [--instances 0,250,1000] [--seconds 10] [--runs 3]

The N instances are one process of ZeroMQ sockets that speak the role protocol (Register, then a Heartbeat every
second, each answered Alive): a load generator, as `disagg bench` is one for requests. Prints the orchestrator's
CPU in milliseconds per second (its threads' time on a CPU: benchmarks/before_after.py cpu_s) for each N, the median of `--runs` windows of `--seconds`.
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

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.before_after import cpu_s, orchestrator, ready  # noqa: E402
from benchmarks.sim_suite import stop_all  # noqa: E402
from disagg.roles.limits import served_model  # noqa: E402
from disagg.transport.wire.messages import Heartbeat, PoolInfo, Register, encode  # noqa: E402


class Beats:
    """N instances of the role protocol in this process, each heartbeating once a second at its own phase."""

    def __init__(self, endpoint: str, deployment_id: str, n: int):
        self.ctx = zmq.Context()
        self.socks = []
        role_port = int(endpoint.rsplit(":", 1)[1]) + 1
        identity = served_model("sim:zero", "auto")
        for k in range(n):
            iid = f"beat-{k}@idle"
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"{deployment_id}/{iid}".encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{role_port}")
            pool = PoolInfo(host_id=f"idle-{k % 64}", engines=["inline"], pool_name=f"idle-{k}", pool_bytes=1 << 20)
            sock.send(encode(Register(role=("encoder", "denoiser", "decoder")[k % 3], instance_id=iid, pid=os.getpid(),
                                      host_id=pool.host_id, device="cpu", capacity=1, pool=pool, ready=True,
                                      deployment_id=deployment_id, model="sim:zero", identity=identity)))
            self.socks.append((sock, encode(Heartbeat(instance_id=iid, ready=True))))

    def run(self, seconds: float) -> None:
        """Heartbeats for `seconds`, instance k at k/N of each second; replies read and dropped."""
        n = len(self.socks)
        start = time.monotonic()
        k = 0
        while True:
            due = start + k / n
            if due - start > seconds:
                return
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            sock, beat = self.socks[k % n]
            sock.send(beat)
            while sock.poll(0):
                sock.recv_multipart()
            k += 1

    def close(self) -> None:
        for sock, _ in self.socks:
            sock.close()
        self.ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", default="0,250,1000", help="extra heartbeating instances, comma-separated")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--port", type=int, default=24960)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    endpoint = f"tcp://127.0.0.1:{args.port}"
    proc = subprocess.Popen([sys.executable, "-m", "disagg", "launch", "--model", "sim:zero", "-d", "1", "--spares", "0",
                             "--no-dashboard", "--port", str(args.port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    rows = []
    try:
        doc = ready(ROOT, endpoint, proc, count=3)
        orch = orchestrator(proc)
        for n in map(int, args.instances.split(",")):
            beats = Beats(endpoint, doc["orchestrator"]["deployment_id"], n) if n else None
            try:
                if beats is not None:
                    beats.run(2.0)  # registered, heartbeating, ready
                    ready(ROOT, endpoint, proc, count=3 + n)
                windows = []
                for _ in range(args.runs):
                    c0, t0 = cpu_s(orch), time.monotonic()
                    if beats is not None:
                        beats.run(args.seconds)
                    else:
                        time.sleep(args.seconds)
                    windows.append((cpu_s(orch) - c0) / (time.monotonic() - t0) * 1000)
            finally:
                if beats is not None:
                    beats.close()
            rows.append({"instances": 3 + n, "cpu_ms_per_s": round(statistics.median(windows), 2),
                         "windows": [round(w, 2) for w in windows]})
            if not args.json:
                print(f"{3 + n:5d} instances: orchestrator {rows[-1]['cpu_ms_per_s']:7.2f} ms CPU per second "
                      f"(windows {', '.join(f'{w:.1f}' for w in windows)})", flush=True)
    finally:
        stop_all([proc])
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
