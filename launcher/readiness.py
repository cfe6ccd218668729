"""Readiness that tells a slow boot from a stuck one: the launcher gives up on an instance only when it made no
progress for `ready_timeout` seconds (a stall), however long its boot takes while it progresses.

Progress is what the instance reports in its heartbeats (roles/boot.py: its phase, detail, bytes and a count that
grows while it downloads, loads or compiles). Before it registers (its interpreter importing torch and the
adapters) the CPU time of its process counts instead, and for an instance over several ranks, its followers' CPU
time too (they report nothing themselves).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

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
    phase = instance.phase or instance.state
    last = [instance.phase_detail] if instance.phase_detail else []
    if instance.boot_bytes and instance.phase == "loading":
        last.append(f"{instance.boot_bytes / 1e9:.2f} GB in memory")
    return f"{phase} (last: {'; '.join(last)})" if last else phase


def boot_mark(instance) -> tuple:
    """What of a registered instance's report changes when its boot progresses."""
    return (instance.state, instance.phase, instance.phase_detail, instance.boot_bytes, instance.boot_progress)


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
            f"compiling) before the launch gives up: raise --ready-timeout (DISAGG_READY_TIMEOUT) if it is only slow")
