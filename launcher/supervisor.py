"""Starts, watches and stops the deployment's processes (only the launcher starts processes)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from transport.messages import BOOT_ERROR_EXIT

log = logging.getLogger("disagg.launcher")

STOP_GRACE_S = 5.0


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cpus: list[int]
    proc: subprocess.Popen | None = None
    returncode: int | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def boot_error(self) -> bool:
        return self.returncode == BOOT_ERROR_EXIT

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Supervisor:
    """Spawns children in their own process groups, with their own env and log file; reaps them."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.children: dict[str, Child] = {}

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, cpus: list[int] | None = None) -> Child:
        child = Child(name, argv, {**os.environ, **(env or {})}, self.logs / f"{name}.log", cpus or [])
        with open(child.log_path, "ab") as logf:
            child.proc = subprocess.Popen(
                argv,
                env=child.env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: a terminal's Ctrl-C reaches only us
                close_fds=True,
            )
        if child.cpus:
            try:
                psutil.Process(child.proc.pid).cpu_affinity(child.cpus)
            except (psutil.Error, AttributeError, ValueError) as exc:
                log.warning("cannot pin %s to CPUs %s: %s", name, child.cpus, exc)
        self.children[name] = child
        log.info("started %s (pid %d)", name, child.proc.pid)
        return child

    def python(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args]

    def reap_children(self) -> list[Child]:
        """Children that exited since the last call."""
        exited = []
        for child in self.children.values():
            if child.proc is not None and child.returncode is None:
                rc = child.proc.poll()
                if rc is not None:
                    child.returncode = rc
                    exited.append(child)
        return exited

    def running(self) -> list[Child]:
        return [c for c in self.children.values() if c.proc is not None and c.proc.poll() is None]

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every child's process group, then SIGKILL what is left after `grace_s`."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.running():
            log.warning("killing %s", ", ".join(c.name for c in self.running()))
            self._signal_all(signal.SIGKILL)
        for child in self.children.values():
            if child.proc is not None:
                try:
                    child.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
                if child.returncode is None:
                    child.returncode = child.proc.returncode
            # anything its group left behind (grandchildren) goes too
            self._kill_group(child)

    def _signal_all(self, sig: int) -> None:
        for child in self.running():
            try:
                os.killpg(child.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _kill_group(self, child: Child) -> None:
        try:
            os.killpg(child.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, AttributeError):
            pass
