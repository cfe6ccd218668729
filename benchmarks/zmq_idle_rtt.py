"""ZeroMQ round trip between two processes, with idle time between pings (this VM's wake-up cost).

    python benchmarks/zmq_idle_rtt.py            # prints the median round trip for 0, 1 and 3 ms of idle
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import zmq


def echo(endpoint: str) -> None:
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(b"hi")
    while (msg := sock.recv()) != b"q":
        sock.send(msg)


def main() -> None:
    from launcher.ports import free_port_pair

    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    router = zmq.Context().socket(zmq.ROUTER)
    router.bind(endpoint)
    peer = subprocess.Popen([sys.executable, __file__, "--echo", endpoint])
    ident, _ = router.recv_multipart()
    for idle_ms in (0, 1, 3):
        times = []
        for _ in range(1000):
            time.sleep(idle_ms / 1000)
            t0 = time.perf_counter()
            router.send_multipart([ident, b"x" * 100])
            router.recv_multipart()
            times.append(time.perf_counter() - t0)
        print(f"idle {idle_ms} ms between pings: round trip median {statistics.median(times) * 1e6:.0f} µs")
    router.send_multipart([ident, b"q"])
    peer.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--echo"]:
        echo(sys.argv[2])
    else:
        main()
