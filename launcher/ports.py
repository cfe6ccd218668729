"""Finding free ports for a deployment the launcher starts on its own (benchmarks, tests)."""

from __future__ import annotations

import random
import socket

# below Linux's ephemeral range (32768+), where outgoing connections would race us for the port,
# and above Mooncake's RPC ports
PORT_RANGE = (20000, 32000)


def free_port_pair() -> int:
    """A port P such that P and P+1 are both free on 127.0.0.1."""
    for _ in range(500):
        port = random.randrange(*PORT_RANGE)
        socks = []
        try:
            for p in (port, port + 1):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no two adjacent free ports")
