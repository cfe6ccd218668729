"""Readiness that tells a slow boot from a stuck one: the launcher gives up on an instance only when it made no
progress for `timeouts.ready` seconds (a stall), however long its boot takes while it progresses.

Progress is what the instance reports in its heartbeats (disagg/roles/boot.py: its phase, detail, bytes and a count that
grows while it downloads, loads or compiles). Before it registers (its interpreter importing torch and the
adapters) the CPU time of its process counts instead, and for an instance over several ranks, its followers' CPU
time too (they report nothing themselves).

`Startup` holds a deployment's startup waits (a mixin of disagg/launcher/deployment.py's Deployment): until its
orchestrator answers, then until every instance it started is ready.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from disagg.client import Unreachable
from disagg.transport.wire.messages import StatusReport

#: how often the launcher asks the orchestrator while it waits
POLL_S = 0.2

#: CPU seconds an unregistered process must burn since the last progress for it to count as progress again
#: (an importing interpreter burns a whole core; one blocked for good, almost nothing)
CPU_PROGRESS_S = 0.05


@dataclass
class Watched:
    mark: object = None
    since: float = 0.0
    cpu: float = 0.0
    what: str = "starting (not registered yet)"


@dataclass
class StallWatch:
    """Per instance: when it last made progress. `clock`: time.monotonic, or a test's."""

    timeout_s: float
    clock: Callable[[], float] = time.monotonic
    watched: dict[str, Watched] = field(default_factory=dict)

    def see(self, name: str, mark: object, what: str, cpu_s: float = 0.0) -> None:
        """One look at instance `name`: `mark` (what it reports; a change is progress), `what` it does, in words,
        and the CPU seconds of its processes that report nothing (growth is progress)."""
        now = self.clock()
        w = self.watched.get(name)
        if w is None:
            self.watched[name] = Watched(mark, now, cpu_s, what)
            return
        if mark != w.mark or cpu_s >= w.cpu + CPU_PROGRESS_S:
            w.mark, w.since, w.cpu = mark, now, cpu_s
        w.what = what

    def stalled(self, names) -> list[tuple[str, float, str]]:
        """(name, seconds without progress, what it does) of each of `names` stalled past the timeout."""
        now = self.clock()
        out = []
        for name in sorted(names):
            w = self.watched.get(name)
            if w is not None and now - w.since > self.timeout_s:
                out.append((name, now - w.since, w.what))
        return out


def describe(instance) -> str:
    """What a registered instance's boot does, in words: 'loading (last: 3.20 GB in memory)'."""
    boot = instance.boot
    phase = boot.phase or instance.state
    last = [boot.detail] if boot.detail else []
    if boot.bytes and boot.phase == "loading":
        last.append(f"{boot.bytes / 1e9:.2f} GB in memory")
    return f"{phase} (last: {'; '.join(last)})" if last else phase


def boot_mark(instance) -> tuple:
    """What of a registered instance's report changes when its boot progresses."""
    return (instance.state, instance.boot)


def cpu_seconds(pids) -> float:
    """User + system CPU seconds of the processes `pids` (those gone count 0)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except (psutil.Error, OSError):
            pass
    return total


def stall_error(stalled: list[tuple[str, float, str]], timeout_s: float, logs: dict[str, str]) -> str:
    """The launch's error: each stalled instance with its phase, and the setting that would help."""
    parts = [f"{name} made no progress for {idle:.0f} s while {what}" + (f" (log {logs[name]})" if name in logs else "")
             for name, idle, what in stalled]
    return (f"{'; '.join(parts)}. An instance may go {timeout_s:g} s without progress (downloading, loading, "
            f"compiling) before the launch gives up: raise --ready-timeout (DISAGG_TIMEOUTS_READY) if it is only slow")


class BootError(RuntimeError):
    """A process of the deployment failed before it was ready."""


class StoppedDuringStartup(RuntimeError):
    """`disagg stop` (or a Shutdown) ended the deployment before it was ready."""


class Startup:
    """The waits of a deployment's startup (a mixin of disagg/launcher/deployment.py's Deployment, whose config,
    supervisor, placements, endpoint, client(), follow(), orchestrator_id and interrupted they use): until the
    orchestrator answers, then until every instance is ready, giving up only on one that stopped progressing."""

    def _check_children(self) -> None:
        for child in self.supervisor.reap_children():
            if child.name == "orchestrator" and child.returncode == 0:
                raise StoppedDuringStartup("the deployment was stopped before it was ready")
            why = "failed to start" if child.boot_error else f"exited with status {child.returncode}"
            raise BootError(f"{child.name} {why} before the deployment was ready; last log lines "
                            f"({child.log_path}):\n{child.log_tail()}")

    def _wait_reachable(self) -> None:
        """Until the orchestrator we started answers: one of another deployment may answer on the
        same port (ours then fails to bind, and _check_children says so)."""
        deadline = time.monotonic() + 30
        mine = self.supervisor.children["orchestrator"].pid
        with self.client() as client:
            while True:
                self._check_children()
                if self.interrupted:
                    raise KeyboardInterrupt
                try:
                    report = client.status(timeout_s=0.5)
                except Unreachable:
                    report = None
                if report is not None and report.orchestrator.get("pid") == mine:
                    self.follow(report)
                    return
                if time.monotonic() > deadline:
                    raise BootError(f"the orchestrator did not answer at {self.endpoint} within 30 s")
                time.sleep(0.05 if report is None else 0.2)

    def wait_ready(self, on_status=None, any_orchestrator: bool = False) -> StatusReport:
        """Until every instance this launcher started is ready (or a standby). `any_orchestrator`: a join
        host, whose orchestrator runs elsewhere and may restart meanwhile."""
        expected = {p.instance_id for p in self.placements}
        watch = StallWatch(self.config.timeouts.ready)
        with self.client() as client:
            while True:
                self._check_children()
                if self.interrupted:
                    raise KeyboardInterrupt
                try:
                    report = client.status(timeout_s=5)
                except Unreachable:
                    self._check_children()  # stopped or dead: say so in one line
                    raise BootError(f"the orchestrator at {self.endpoint} stopped answering during startup") from None
                if any_orchestrator:
                    self.follow(report)
                elif report.orchestrator.get("id") != self.orchestrator_id:
                    self._check_children()
                    raise BootError(f"another orchestrator ({report.orchestrator.get('pid')}) answers at {self.endpoint}")
                if on_status:
                    on_status(report)
                # only the instances this launcher started (their pids), whatever else registered
                pids = {name: c.pid for name, c in self.supervisor.children.items()}
                mine = {i.id: i for i in report.instances if i.id in expected and pids.get(i.id) == i.pid}
                ready = {name for name, i in mine.items() if i.state in ("ready", "standby")}
                listens = self._gateway_listens()
                if expected <= ready and listens:
                    return report
                waiting = expected - ready
                self._watch_boots(watch, waiting, mine)
                gateway = self.supervisor.children.get("gateway")
                if not listens and gateway is not None:  # it imports, then binds: its CPU time is its progress
                    waiting.add("gateway")
                    watch.see("gateway", None, f"starting (not listening on port {self.config.http.port} yet)",
                              cpu_seconds([gateway.pid]))
                stalled = watch.stalled(waiting)
                if stalled:
                    logs = {name: str(self.supervisor.children[name].log_path) for name, _, _ in stalled
                            if name in self.supervisor.children}
                    raise BootError(stall_error(stalled, self.config.timeouts.ready, logs))
                time.sleep(POLL_S)

    def _watch_boots(self, watch: StallWatch, waiting: set[str], registered: dict) -> None:
        """One look at each instance not ready yet: what it reports (registered), else its process's CPU time; and
        its follower ranks' CPU time (an instance over several ranks)."""
        followers: dict[str, list[int]] = {}
        for name, child in self.supervisor.children.items():
            if child.group and name != child.group:
                followers.setdefault(child.group, []).append(child.pid)
        for name in waiting:
            child = self.supervisor.children.get(name)
            inst = registered.get(name)
            pids = followers.get(name, []) + ([child.pid] if inst is None and child is not None else [])
            cpu = cpu_seconds(pids)
            if inst is None:
                watch.see(name, None, "starting (its process has not registered yet)", cpu)
            else:
                watch.see(name, boot_mark(inst), describe(inst), cpu)

    def _gateway_listens(self) -> bool:
        h = self.config.http
        if not h.port:
            return True
        try:
            socket.create_connection((h.host if h.host not in ("0.0.0.0", "::") else "127.0.0.1", h.port), timeout=0.5).close()
            return True
        except OSError:
            return False
