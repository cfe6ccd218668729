"""An instance's busy time split among the requests it works on at once (StageRunner's utilization: disagg/roles/compute.py)."""

from __future__ import annotations

import threading
import time


class BusyMeter:
    """Splits an instance's busy time among the requests it works on at once.

    A virtual clock advances by dt / n while n requests are in progress; a request's share is how
    far it advanced between its start and end. The shares sum to the time the instance had any work,
    so utilization stays a fraction even with several requests in flight on one device."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._lock = threading.Lock()
        self._active = 0
        self._last = clock()
        self._virtual = 0.0

    def _advance(self) -> float:
        now = self._clock()
        if self._active:
            self._virtual += (now - self._last) / self._active
        self._last = now
        return self._virtual

    def enter(self) -> float:
        with self._lock:
            start = self._advance()
            self._active += 1
            return start

    def leave(self, start: float) -> float:
        with self._lock:
            share = self._advance() - start
            self._active -= 1
            return share
