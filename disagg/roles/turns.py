"""`schedule: slo` inside a denoiser: which of the requests it holds uses the device next, step by step.

Every held request has a `Ticket`: its priority, the time by which its stage should end (`Run.stage_deadline_s`,
from the orchestrator's predictions) and its steps. A request holds the turn for its whole compute except at
its step boundaries: there `Turns.step` hands the turn to the most urgent waiting request, if one is more
urgent, and waits to get it back. Its latents stay where they are (the pipeline call's own locals), so
yielding costs nothing but the switch.

Urgency, most urgent first: the one order of disagg/common/urgency.py (`order`), the same the orchestrator's queues
use, with the requests sharing one device: effective priority (aging by the time waited without stepping), then,
within one priority, earliest deadline first over those that can all still meet theirs run back to back from now
(the longest set aside where one would miss: Moore-Hodgson), then those without a deadline, then the ones set aside,
least slack first.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from disagg.common.averages import ewma
from disagg.common.urgency import order
from disagg.settings.fields import default

_arrivals = itertools.count()


@dataclass
class Ticket:
    """One held request, as the step scheduler sees it."""

    request_id: str
    priority: int = 0
    #: time.monotonic() by which its stage should end; None: no deadline
    deadline: float | None = None
    steps: int = 0
    #: a key for step times: requests of one key step alike (shape); its measured step time is kept per key
    shape: object = None
    done: int = 0
    seq: int = field(default_factory=lambda: next(_arrivals))
    #: since when it has waited for the turn (None: it holds it, or has not asked yet)
    waiting_since: float | None = None
    #: seconds it held the turn, and when it last took it
    held_s: float = 0.0
    _took: float = 0.0
    #: called whenever it wakes while waiting: raises to stop waiting (its client cancelled it; Turns.wake)
    check: object = None

    def left_s(self, step_s: float) -> float:
        """Seconds it still needs on the device at `step_s` a step."""
        return max(self.steps - self.done, 0) * step_s


class Turns:
    """An instance's device, handed from request to request at step boundaries by urgency."""

    def __init__(self, aging_s: float = default("schedule.aging_s"), clock=time.monotonic):
        self.aging_s = aging_s
        self.clock = clock
        self._cond = threading.Condition()
        self._holder: Ticket | None = None
        self._waiting: list[Ticket] = []
        #: shape -> moving average of one step's seconds (slack needs the time a request still takes)
        self.step_s: dict[object, float] = {}
        #: turns handed over at a step boundary (a request yielded to a more urgent one): heartbeats may show it
        self.switches = 0

    def _step_s(self, t: Ticket) -> float:
        if t.done:
            return t.held_s / t.done
        return self.step_s.get(t.shape, 0.0)

    def _left_s(self, t: Ticket) -> float:
        return t.left_s(self._step_s(t))

    def order(self, tickets: list[Ticket], now: float) -> list[Ticket]:
        """`tickets` most urgent first (module docstring)."""
        return order(tickets, now, self.aging_s, left_s=self._left_s)

    def _best(self, now: float, holder: Ticket | None = None) -> Ticket | None:
        """The most urgent of those waiting (and `holder`, which would keep the turn)."""
        tickets = self._waiting + ([holder] if holder is not None else [])
        return self.order(tickets, now)[0] if tickets else None

    def acquire(self, t: Ticket) -> None:
        """Wait until `t` is the most urgent of those waiting and the device is free; then it holds the turn."""
        with self._cond:
            if self._holder is None and not self._waiting:  # the device is free and nobody waits: no order to make
                self._holder = t
                t._took = self.clock()
                return
            t.waiting_since = self.clock()
            self._waiting.append(t)
            try:
                while self._holder is not None or self._best(self.clock()) is not t:
                    self._cond.wait()
                    if t.check is not None:
                        t.check()
            except BaseException:
                self._waiting.remove(t)
                self._cond.notify_all()
                raise
            self._waiting.remove(t)
            t.waiting_since = None
            self._holder = t
            t._took = self.clock()

    def wake(self) -> None:
        """Every waiting request checks whether it should stop waiting (one was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    def release(self, t: Ticket) -> None:
        with self._cond:
            if self._holder is t:
                t.held_s += self.clock() - t._took
                if t.done == 0 and t.steps == 1 and t.shape is not None:  # a compute without steps (an encode, a decode)
                    self.step_s[t.shape] = ewma(self.step_s.get(t.shape), t.held_s)
                self._holder = None
                self._cond.notify_all()

    def step(self, t: Ticket) -> None:
        """`t` (holding the turn) finished a step: hand the turn to a more urgent request, if one waits."""
        with self._cond:
            now = self.clock()
            t.done += 1
            if t.done and self._holder is t:
                self.step_s[t.shape] = ewma(self.step_s.get(t.shape), (t.held_s + now - t._took) / t.done)
            if not self._waiting or self._holder is not t or self._best(now, t) is t:
                return
            self.switches += 1
        self.release(t)
        self.acquire(t)

    def hold(self, t: Ticket):
        """A context manager: the turn for a whole compute (its steps may hand it over meanwhile)."""
        return _Held(self, t)


class _Held:
    def __init__(self, turns: Turns, t: Ticket):
        self.turns, self.t = turns, t

    def __enter__(self):
        self.turns.acquire(self.t)
        return self.t

    def __exit__(self, *exc):
        self.turns.release(self.t)
        return False
