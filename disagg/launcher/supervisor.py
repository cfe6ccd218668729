"""Starts, watches and stops the deployment's processes (only the launcher starts processes)."""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from disagg.transport.environment import DISAGG_DIST_INIT, DISAGG_LAUNCHER_PID, DISAGG_RESTARTS
from disagg.transport.wire.messages import BOOT_ERROR_EXIT, MOVE_EXIT

log = logging.getLogger("disagg.launcher")

STOP_GRACE_S = 5.0


@dataclass
class RestartPolicy:
    """Growing delays between restarts, and at most `max_restarts` within `window_s`. A process that ran
    `healthy_s` before it died is not in a crash loop: it restarts at once, its history forgotten."""

    initial_delay_s: float = 0.5
    max_delay_s: float = 10.0
    max_restarts: int = 5
    window_s: float = 120.0
    healthy_s: float = 10.0


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
    restarts: int = 0
    restart_times: collections.deque = field(default_factory=collections.deque)
    restart_at: float | None = None
    gave_up: bool = False
    #: its device serves another instance now (a rebalance order taken after it exited): never restarted
    retired: bool = False
    started_at: float = 0.0
    #: a role: a restart may take over a spare interpreter (see Supervisor.spares) instead of a new one
    spare_ok: bool = False
    #: a role that starts as another role's device moves to it (rebalance): forked when it may be (the fork server
    #: imported everything at launch), else a spare interpreter becomes it when one waits, else a fresh one
    take_spare: bool = False
    #: a role without a GPU: the fork server (disagg/launcher/forks.py) may start it, when there is one
    fork_ok: bool = False
    #: the ranks of one parallel instance share a group: when one dies, the others are stopped, and all
    #: start again together, meeting at a fresh rendezvous (DISAGG_DIST_INIT)
    group: str = ""
    #: stopped because another rank of its group died: its own death is not a new failure of the group
    stopped_with_group: bool = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def boot_error(self) -> bool:
        return self.returncode == BOOT_ERROR_EXIT

    @property
    def moved(self) -> bool:
        """It exited so that its device serves another role (Shutdown.move)."""
        return self.returncode == MOVE_EXIT

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def open_log(path: Path):
    """A child's log file, appended to, readable by the owner only."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")


class Supervisor:
    """Spawns children in their own process groups, with their own env and log file; reaps them
    and, once `supervise` runs, restarts the ones that die."""

    def __init__(self, run_dir: Path, policy: RestartPolicy | None = None):
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        # the owner's only: logs hold request ids and errors, and may hold prompts
        self.logs.mkdir(parents=True, exist_ok=True, mode=0o700)
        for folder in (run_dir, self.logs):
            os.chmod(folder, 0o700)
        self.children: dict[str, Child] = {}
        self.policy = policy or RestartPolicy()
        self.events: queue.Queue[str] = queue.Queue()
        self.lock = threading.RLock()
        self.stopping = False
        self._thread: threading.Thread | None = None
        #: spare interpreters that imported torch and diffusers already and wait (on stdin) to become a
        #: role: a role that dies is replaced in about a second instead of the ~4 s those imports take
        self.spares: list[subprocess.Popen] = []
        self.spares_wanted = 0
        self.spare_argv: list[str] = []
        self.spare_env: dict[str, str] = {}
        #: forks the CPU roles from one process that imported torch and diffusers (start_fork_server)
        self.fork_server = None
        #: parallel instances: group -> (generation, members started in it)
        self._groups: dict[str, tuple[int, set[str]]] = {}

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, cpus: list[int] | None = None,
              spare_ok: bool = False, group: str = "", fork_ok: bool = False, take_spare: bool = False) -> Child:
        child = Child(name, argv, {**os.environ, **(env or {})}, self.logs / f"{name}.log", cpus or [], spare_ok=spare_ok,
                      group=group, fork_ok=fork_ok, take_spare=take_spare)
        self._start(child)
        self.children[name] = child
        return child

    def start_fork_server(self, model: str, env: dict[str, str]) -> None:
        """From now on roles that may be forked (`fork_ok`) are, from a server importing `model`'s needs now."""
        from disagg.launcher.forks import ForkServer

        self.fork_server = ForkServer(self.python("disagg.roles", "--fork-server", model), {**os.environ, **env},
                                      self.logs / "fork-server.log")

    def keep_spares(self, count: int, argv: list[str], env: dict[str, str]) -> None:
        """From now on keep `count` spare interpreters (`argv` waits on stdin to become a role)."""
        self.spares_wanted, self.spare_argv, self.spare_env = count, argv, {**os.environ, **env}

    def _top_up_spares(self) -> None:
        self.spares = [p for p in self.spares if p.poll() is None]
        while len(self.spares) < self.spares_wanted:
            with open_log(self.logs / "spares.log") as logf:
                proc = subprocess.Popen(self.spare_argv, env=self.spare_env, stdin=subprocess.PIPE, stdout=logf,
                                        stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
            self.spares.append(proc)
            log.info("started a spare interpreter (pid %d)", proc.pid)

    def _take_spare(self, child: Child) -> bool:
        """Turn a waiting spare into `child` (its argv's last item is the role's spec); False if none."""
        while self.spares:
            proc = self.spares.pop(0)
            if proc.poll() is not None:
                continue
            order = {"spec": child.argv[-1], "env": child.env, "log": str(child.log_path)}
            try:
                proc.stdin.write((json.dumps(order) + "\n").encode())
                proc.stdin.close()
            except OSError:
                continue
            child.proc = proc
            return True
        return False

    def _rendezvous(self, child: Child) -> str:
        """The torch.distributed init_method of `child`'s group now: a fresh file each time the group starts
        again (a member that starts a second time opens the group's next generation)."""
        gen, started = self._groups.get(child.group, (0, set()))
        if child.name in started:
            gen, started = gen + 1, set()
        started.add(child.name)
        self._groups[child.group] = (gen, started)
        folder = self.run_dir / "dist"
        folder.mkdir(exist_ok=True)
        for old in folder.glob(f"{child.group}.*"):  # an older generation's rendezvous
            if old.name != f"{child.group}.{gen}":
                old.unlink(missing_ok=True)
        return f"file://{folder / f'{child.group}.{gen}'}"

    def _start(self, child: Child) -> bool:
        """Start (again) `child`; True if a spare interpreter became it."""
        child.env[DISAGG_RESTARTS] = str(child.restarts)
        child.env[DISAGG_LAUNCHER_PID] = str(os.getpid())  # so it notices our death even before it looks
        if child.group:
            child.env[DISAGG_DIST_INIT] = self._rendezvous(child)
        child.returncode = None
        child.started_at = time.monotonic()
        # a moved device's new role is forked where it may be: the fork server has every import done (a spare may not yet)
        forks_first = child.take_spare and child.fork_ok and self.fork_server is not None
        if child.spare_ok and (child.restarts or child.take_spare) and not forks_first and self._take_spare(child):
            self._pin(child)
            log.info("%s took over a spare interpreter (pid %d)", child.name, child.proc.pid)
            return True
        if child.fork_ok and self.fork_server is not None:
            proc = self.fork_server.fork(child.name, child.argv[-1], child.env, child.log_path)
            if proc is not None:
                child.proc = proc
                self._pin(child)
                log.info("started %s (pid %d, forked)", child.name, proc.pid)
                return False
        with open_log(child.log_path) as logf:
            child.proc = subprocess.Popen(
                child.argv,
                env=child.env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: a terminal's Ctrl-C reaches only us
                close_fds=True,
            )
        self._pin(child)
        log.info("started %s (pid %d)", child.name, child.proc.pid)
        return False

    def _pin(self, child: Child) -> None:
        if child.cpus:
            try:
                psutil.Process(child.proc.pid).cpu_affinity(child.cpus)
            except (psutil.Error, AttributeError, ValueError) as exc:
                log.warning("cannot pin %s to CPUs %s: %s", child.name, child.cpus, exc)

    # --- restarts -----------------------------------------------------------------------------

    def supervise(self, now: float | None = None) -> None:
        """Restart dead children with growing delays; give up on boot errors and restart storms."""
        now = time.monotonic() if now is None else now
        with self.lock:
            if self.stopping:
                return
            for child in self.reap_children():
                if child.stopped_with_group:  # we stopped it: it starts again with its group, nothing more
                    child.stopped_with_group = False
                    if not child.gave_up:
                        child.restart_at = now
                    continue
                self._schedule(child, now)
                if child.group:  # one rank down: the whole instance is (its ranks run in lockstep)
                    self._stop_group(child)
            for child in self.children.values():
                if child.restart_at is not None and now >= child.restart_at:
                    child.restart_at = None
                    child.restarts += 1
                    child.restart_times.append(now)
                    spare = self._start(child)
                    self.events.put(f"{child.name} restarted (pid {child.pid}, restart {child.restarts}"
                                    f"{', from a spare interpreter' if spare else ''})")
            self._top_up_spares()  # after the restarts: a spare taken now is replaced in the background

    def retire(self, child: Child) -> None:
        """Never restart `child` (exited) again: its device serves another instance from now on. Call it holding
        the lock."""
        child.retired, child.restart_at = True, None

    def _stop_group(self, dead: Child) -> None:
        for other in self.children.values():
            if other.group == dead.group and other is not dead and other.proc is not None and other.proc.poll() is None:
                self.events.put(f"{other.name} stops with {dead.name}: the ranks of {dead.group} run together")
                other.stopped_with_group = True
                self._kill_group(other)

    def _schedule(self, child: Child, now: float) -> None:
        if child.group and any(o.gave_up for o in self.children.values() if o.group == child.group and o is not child):
            child.gave_up = True  # the group cannot meet without the member given up on
            self.events.put(f"{child.name} is not restarted: another rank of {child.group} was given up on")
            return
        if child.retired:
            return
        if child.returncode == 0:  # asked to stop (disagg stop, Shutdown): not a failure
            self.events.put(f"{child.name} exited")
            return
        if child.moved:  # exited to change role: its device waits for the orchestrator's Rerole
            self.events.put(f"{child.name} exited to change role; its device waits for its new role")
            return
        if child.boot_error:
            child.gave_up = True
            self.events.put(f"{child.name} failed to start (status {child.returncode}); not restarting it:\n{child.log_tail(5)}")
            return
        p = self.policy
        if now - child.started_at >= p.healthy_s:  # it ran fine for a while: killed, not crash-looping
            child.restart_times.clear()
            child.restart_at = now
            self.events.put(f"{child.name} (pid {child.pid}) exited with status {child.returncode}; restarting it")
            return
        while child.restart_times and now - child.restart_times[0] > p.window_s:
            child.restart_times.popleft()
        if len(child.restart_times) >= p.max_restarts:
            child.gave_up = True
            self.events.put(f"{child.name} died {p.max_restarts + 1} times within {p.window_s:g} s; giving up on it")
            return
        delay = min(p.max_delay_s, p.initial_delay_s * 2 ** len(child.restart_times))
        child.restart_at = now + delay
        self.events.put(f"{child.name} (pid {child.pid}) exited with status {child.returncode}; restarting in {delay:g} s")

    def start_supervising(self, interval_s: float = 0.1) -> None:
        def loop():
            while not self.stopping:
                try:
                    self.supervise()
                except Exception:  # noqa: BLE001 - one bad turn must not end all restarts
                    log.exception("supervisor turn failed")
                    self.events.put("error: the supervisor failed a turn (see the launcher's log); going on")
                time.sleep(interval_s)

        self._thread = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._thread.start()

    def stop_supervising(self) -> None:
        with self.lock:
            self.stopping = True
        if self._thread is not None:
            self._thread.join(timeout=2)

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

    def _end_spares(self) -> None:
        for proc in self.spares:
            try:
                proc.stdin.close()  # a spare told nothing exits
            except OSError:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=5)
        self.spares = []

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every child's process group, then SIGKILL what is left after `grace_s`."""
        self.stop_supervising()
        self._end_spares()
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
        if self.fork_server is not None:
            self.fork_server.close()

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
