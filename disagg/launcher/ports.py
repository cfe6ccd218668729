"""Finding free ports for a deployment the launcher starts on its own (benchmarks, tests)."""

from __future__ import annotations

import random
import socket

from disagg.transport.wire.lane import lane_in_use

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


class PortBusy(RuntimeError):
    """A port (or the same-host lane) the deployment needs is already taken; the message says which."""


def _bindable(host: str, port: int) -> OSError | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        # as ZeroMQ binds: a port left in TIME_WAIT is free, one another socket listens on is not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host.strip("[]"), port))
        return None
    except OSError as exc:
        return exc
    finally:
        s.close()


def check_http_port(host: str, port: int) -> None:
    """Raise PortBusy unless the HTTP gateway's port is free."""
    err = _bindable(host, port)
    if err is not None:
        raise PortBusy(f"HTTP port {port} on {host} is {'in use' if err.errno in (98, 48) else err.strerror}; "
                       "choose another --http-port")


def check_ports(host: str, port: int, lane: str | None) -> None:
    """Raise PortBusy unless the client port, the role port (PORT+1) and the lane are all free."""
    for p, what in ((port, "client"), (port + 1, "role")):
        err = _bindable(host, p)
        if err is not None:
            why = "in use" if err.errno in (98, 48) else (err.strerror or str(err))
            raise PortBusy(
                f"port {p} on {host} ({what} port of --port {port}) is {why}. If a deployment runs there, "
                f"`disagg status --endpoint tcp://{host}:{p}` shows it (or :{p - 1}, whose role port {p} would be); "
                "choose another --port")
    if lane and lane_in_use(lane):
        raise PortBusy(f"the same-host lane {lane} of port {port} is in use by a running orchestrator (on another "
                       f"address?); `disagg status --endpoint tcp://127.0.0.1:{port}` may show it; choose another --port")
