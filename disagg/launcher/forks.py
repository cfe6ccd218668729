"""The launcher's end of the fork server (disagg/roles/forks.py): one process that imported a role's torch,
diffusers and adapter once forks the CPU roles, so each starts in a fraction of a second instead of ~5 s of
imports. A forked role is the server's child: the server reaps it and tells us its status, and
`ForkedProc` gives the supervisor what it uses of a `subprocess.Popen` (pid, poll, wait, returncode)."""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
from pathlib import Path

from disagg.launcher.supervisor import open_log
from disagg.transport.data.shm import pid_alive
from disagg.transport.environment import DISAGG_TITLE_ROOM

log = logging.getLogger("disagg.launcher")

#: how long a fork may wait for the server's imports (then the role starts a fresh interpreter)
READY_WAIT_S = 120.0
#: bytes of room for a forked role's process title
TITLE_ROOM = 8192


class ForkedProc:
    """A role forked by the server, as the supervisor sees a Popen."""

    def __init__(self, server: "ForkServer", pid: int):
        self.server, self.pid = server, pid
        self.returncode: int | None = None
        self.exited = threading.Event()

    def _ended(self, rc: int) -> None:
        self.returncode = rc
        self.exited.set()

    def poll(self) -> int | None:
        if self.returncode is None and not self.server.alive() and not pid_alive(self.pid):
            self._ended(-9)  # the server died before it could tell us: the status is lost
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked role {self.pid}", timeout)
            self.exited.wait(0.05 if left is None else min(0.05, left))
        return self.returncode


class ForkServer:
    """`python -m disagg.roles --fork-server MODEL`, started at once so its imports overlap the launch's."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path):
        # a forked role's title (what ps shows: its `python -m disagg.roles SPEC`) is written over the server's own
        # command line and environment: this keeps room for a whole settings object there
        env = {**env, DISAGG_TITLE_ROOM: " " * TITLE_ROOM}
        with open_log(log_path) as logf:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf,
                                         start_new_session=True, close_fds=True)
        self.ready = threading.Event()
        self.log_path = log_path
        #: it said it imported what the roles need (else it ended first); and whether its end was told to the user
        self.imported = False
        self._told_gone = False
        self._lock = threading.Lock()
        self._answers: dict[str, dict] = {}
        self._answered = threading.Condition(self._lock)
        self._forked: dict[int, ForkedProc] = {}
        self._early: dict[int, int] = {}  # exits read before their fork's answer was taken
        threading.Thread(target=self._read, name="fork-server", daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("ready"):
                self.imported = True
                self.ready.set()
            elif "exited" in msg:
                with self._lock:
                    proc = self._forked.get(msg["exited"])
                    if proc is None:
                        self._early[msg["exited"]] = msg["rc"]
                if proc is not None:
                    proc._ended(msg["rc"])
            elif "name" in msg:
                with self._answered:
                    self._answers[msg["name"]] = msg
                    self._answered.notify_all()
        self.ready.set()  # it ended: nobody waits for it any more
        with self._answered:
            self._answered.notify_all()

    def fork(self, name: str, spec: str, env: dict[str, str], log_path: Path) -> ForkedProc | None:
        """A forked role, or None (the server is gone or failed: start a fresh interpreter instead)."""
        if not self.ready.wait(READY_WAIT_S) or not self.alive():
            self._tell_gone()
            return None
        order = {"name": name, "spec": spec, "env": env, "log": str(log_path)}
        with self._answered:
            self._answers.pop(name, None)
            try:
                self.proc.stdin.write((json.dumps(order) + "\n").encode())
                self.proc.stdin.flush()
            except OSError:  # its end of the pipe is closed: it is gone
                self._tell_gone()
                return None
            deadline = time.monotonic() + 10
            while name not in self._answers and self.alive() and time.monotonic() < deadline:
                self._answered.wait(0.1)
            answer = self._answers.pop(name, None)
            if answer is None and not self.alive():  # it ended meanwhile (its output may end before it exits)
                self._tell_gone()
                return None
            if answer is None or "pid" not in answer:
                log.warning("the fork server did not start %s (%s): a fresh interpreter does", name,
                            answer.get("error") if answer else "no answer")
                return None
            proc = ForkedProc(self, answer["pid"])
            self._forked[proc.pid] = proc
            early = self._early.pop(proc.pid, None)
        if early is not None:
            proc._ended(early)
        return proc

    def _tell_gone(self) -> None:
        """Once: why roles now start as fresh interpreters (a server that failed its imports says why in its log)."""
        if self._told_gone:
            return
        self._told_gone = True
        rc = self.proc.poll()
        if not self.imported and rc is not None:
            log.warning("the fork server exited (status %s) before its imports were done: roles start as fresh "
                        "interpreters, each importing torch itself; its log says why: %s", rc, self.log_path)
        elif not self.imported:
            log.warning("the fork server's imports took over %.0f s: roles start as fresh interpreters; its log: %s",
                        READY_WAIT_S, self.log_path)
        else:
            log.warning("the fork server is gone (status %s): roles start as fresh interpreters from now on", rc)

    def close(self) -> None:
        """EOF ends the server (after its forked roles were stopped; any still running go on alone)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
