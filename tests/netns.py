"""Hosts for multi-host tests: each a network namespace with its own veth address on one bridge, its own
hostname and a private /dev/shm (so no shared-memory shortcut between "hosts" passes by accident).
Needs root (CI runs as root). Everything made here is removed by `close()`, also after a failure."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def available() -> str:
    """'' when network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root"
    probe = f"dgprobe{uuid.uuid4().hex[:6]}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode:
        return f"ip netns add failed: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


class Hosts:
    """`n` namespace hosts h0..h{n-1} at 10.S.0.1.. on a bridge; the test itself (root namespace) is at
    10.S.0.254, so it reaches every host directly."""

    def __init__(self, n: int):
        self.tag = uuid.uuid4().hex[:5]
        self.bridge = f"dgbr{self.tag}"
        self.names: list[str] = []
        self.procs: list[subprocess.Popen] = []
        try:
            # a subnet no other bridge has (tests running at once each make theirs: two on one subnet would route
            # one test's packets to the other's hosts), chosen and taken under a lock shared by every test process
            with open("/tmp/disagg-netns.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                taken = {int(m) for m in re.findall(r"inet 10\.(\d+)\.0\.254/", _ip("-o", "addr", "show").stdout)}
                self.subnet = next((s for s in range(200, 250) if s not in taken), None)
                if self.subnet is None:
                    raise RuntimeError("every test subnet 10.200-249.0.0/24 is taken: namespace hosts left behind?")
                _ip("link", "add", self.bridge, "type", "bridge")
                _ip("addr", "add", f"10.{self.subnet}.0.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for _ in range(n):
                self.add()
        except BaseException:
            self.close()
            raise

    def add(self) -> int:
        """One more host (a late joiner); its index."""
        i = len(self.names)
        name = f"dg{self.tag}h{i}"
        veth = f"dgv{self.tag}{i}"
        _ip("netns", "add", name)
        self.names.append(name)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", name, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")
        return i

    def addr(self, i: int) -> str:
        return f"10.{self.subnet}.0.{i + 1}"

    def popen(self, i: int, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        """Run `argv` on host i: its network namespace, a hostname of its own, a private /dev/shm."""
        script = f'mount -t tmpfs -o size=2g tmpfs /dev/shm && hostname {self.names[i]} && exec "$@"'
        cmd = ["ip", "netns", "exec", self.names[i], "unshare", "--mount", "--uts", "sh", "-c", script, "sh", *argv]
        proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        self.procs.append(proc)
        return proc

    def launch(self, i: int, args: list[str], log: Path) -> subprocess.Popen:
        from tests.conftest import tiny_unless_named

        return self.popen(i, [sys.executable, "-m", "disagg", "launch", "--no-dashboard", "--spares", "0",
                              *tiny_unless_named(args)], log)

    def link(self, i: int, up: bool) -> None:
        _ip("link", "set", f"dgv{self.tag}{i}", "up" if up else "down")

    def kill_host(self, i: int) -> None:
        """SIGKILL every process in host i's namespace (a host that dies)."""
        res = _ip("netns", "pids", self.names[i], check=False)
        for pid in res.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for i in range(len(self.names)):
            self.kill_host(i)
        for name in self.names:
            _ip("netns", "del", name, check=False)
        _ip("link", "del", self.bridge, check=False)
