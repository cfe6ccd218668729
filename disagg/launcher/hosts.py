"""Which host this process runs on, and the address other hosts reach it at (torch-free)."""

from __future__ import annotations

import hashlib
import os
import re
import socket

from disagg.transport.environment import DISAGG_HOST_ID

#: the longest host id kept in an instance id (role-i@HOST)
HOST_LABEL_MAX = 40


def host_id() -> str:
    """`$DISAGG_HOST_ID`, else the hostname plus a digest of what really differs between hosts and
    network namespaces on one machine: the boot id and the network and mount namespaces. Two
    processes with the same id can share memory (/dev/shm) and a Unix socket; two with different ids
    talk over the network."""
    given = os.environ.get(DISAGG_HOST_ID, "").strip()
    if given:
        return label(given)
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/net", "/proc/self/ns/mnt"):
        try:
            parts.append(open(path).read().strip() if "random" in path else str(os.stat(path).st_ino))
        except OSError:
            parts.append("")
    digest = hashlib.sha1("|".join(parts).encode()).hexdigest()[:6]
    return label(f"{socket.gethostname()}-{digest}")


def label(text: str) -> str:
    """`text` as the characters an instance id may hold, at most HOST_LABEL_MAX of them."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "-", text)[:HOST_LABEL_MAX] or "host"


def route_address(head: str, port: int) -> str:
    """This host's address on the interface that routes to `head` (what a peer there can reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((head, port))  # UDP: picks the route, sends nothing
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """tcp://HOST:PORT -> (HOST, PORT); ValueError naming what is wrong."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"{endpoint!r} is not tcp://HOST:PORT")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65534:
        raise ValueError(f"{endpoint!r} is not tcp://HOST:PORT")
    return host.strip("[]"), int(port)
