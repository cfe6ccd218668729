"""Round trip between two processes over ZeroMQ and over the fast lane, with idle time between pings.

    PYTHONPATH=. python benchmarks/zmq_idle_rtt.py     # median round trip for 0, 1 and 3 ms of idle

A ZeroMQ message crosses four threads (each side's application and I/O thread); the lane
(disagg/transport/wire/lane.py, a Unix SOCK_SEQPACKET socket polled by the same zmq.Poller the loops use) crosses
two. On this VM every wake of a thread that has been idle costs tens of microseconds, so the gap
grows with the idle time between messages, which is what a request at concurrency 1 sees at every hop.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import zmq

PINGS = 1000


def echo_zmq(endpoint: str) -> None:
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(b"hi")
    while (msg := sock.recv()) != b"q":
        sock.send(msg)


def echo_lane(path: str) -> None:
    from disagg.transport.wire.lane import connect

    lane = connect(path, [b"hi"])
    poller = zmq.Poller()
    poller.register(lane.fd, zmq.POLLIN)
    while True:
        poller.poll(1000)
        for frames in lane.recv():
            if frames == [b"q"]:
                return
            lane.send(frames)


def rounds(ping, label: str) -> dict[int, float]:
    out = {}
    for idle_ms in (0, 1, 3):
        times = []
        for _ in range(PINGS):
            time.sleep(idle_ms / 1000)
            t0 = time.perf_counter()
            ping()
            times.append(time.perf_counter() - t0)
        out[idle_ms] = statistics.median(times) * 1e6
        print(f"{label}: idle {idle_ms} ms between pings: round trip median {out[idle_ms]:.0f} µs")
    return out


def main() -> None:
    from disagg.launcher.ports import free_port_pair
    from disagg.transport.wire.lane import LaneListener

    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    router = zmq.Context().socket(zmq.ROUTER)
    router.bind(endpoint)
    peer = subprocess.Popen([sys.executable, __file__, "--echo-zmq", endpoint])
    ident, _ = router.recv_multipart()

    def ping_zmq():
        router.send_multipart([ident, b"x" * 100])
        router.recv_multipart()

    rounds(ping_zmq, "zeromq")
    router.send_multipart([ident, b"q"])
    peer.wait()

    path = os.path.join(tempfile.mkdtemp(), "lane.sock")
    listener = LaneListener(path)
    peer = subprocess.Popen([sys.executable, __file__, "--echo-lane", path], env={**os.environ, "PYTHONPATH": os.getcwd()})
    poller = zmq.Poller()
    poller.register(listener.fileno(), zmq.POLLIN)
    poller.poll(10_000)
    (lane,) = listener.accept()
    poller = zmq.Poller()
    poller.register(lane.fd, zmq.POLLIN)
    while not lane.recv():  # the hello
        poller.poll(1000)

    def ping_lane():
        lane.send([b"x" * 100])
        while True:
            poller.poll(1000)
            if lane.recv():
                return

    rounds(ping_lane, "lane")
    lane.send([b"q"])
    peer.wait()
    listener.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--echo-zmq"]:
        echo_zmq(sys.argv[2])
    elif sys.argv[1:2] == ["--echo-lane"]:
        echo_lane(sys.argv[2])
    else:
        main()
