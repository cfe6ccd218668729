"""The requests waiting for an instance, per role: the Router's queue, chosen by the `schedule` setting (QUEUES).

Every queue keeps, per role, a deque of request ids (`by_role`); an id stays in it until dispatch meets it, so an
entry whose request ended or moved on is skipped then (Router.dispatch_queued). `fifo` serves in arrival order
(a retry goes to the front: it waited its turn once). `slo` serves by urgency (disagg/common/urgency.py): it sorts a
role's queue before dispatch (which asks only when something could take a request), when the order may have changed
(QueueOrder), and under overload names a queued request of lower priority to shed for a new one (`shed_for`).
"""

from __future__ import annotations

import collections
import math

from disagg.orchestrator.requests import NAMES
from disagg.settings.choices import Schedule


class FifoQueue:
    """Arrival order; a retry at the front."""

    def __init__(self, roles, requests: dict, deadlines, config):
        self.by_role: dict[str, collections.deque[str]] = {r: collections.deque() for r in roles}
        self.requests = requests
        self.deadlines = deadlines
        self.config = config

    def push(self, req, role: str, now: float, front: bool = False, fresh: bool = True) -> None:
        """`req` waits in `role` (fresh: never queued in that role before, so no older entry of it is left)."""
        (self.by_role[role].appendleft if front else self.by_role[role].append)(req.id)

    def ordered(self, role: str, now: float) -> collections.deque[str]:
        """`role`'s queue, in the order dispatch serves it."""
        return self.by_role[role]

    def ended(self, req) -> None:
        """`req`, queued, ended (its id stays in the queue until dispatch meets it)."""

    def arriving(self, params) -> None:
        """A request with these parameters is being admitted."""

    def shed_for(self, params):
        """Under overload (a full queue), the queued request to shed for a new one; None: none."""
        return None

    def waiting(self, role: str) -> int:
        return sum(1 for rid in self.by_role[role] if rid in self.requests)


class SloQueue(FifoQueue):
    """Urgency order (priority with aging, deadlines, arrival); sheds lower priorities under overload."""

    def __init__(self, roles, requests: dict, deadlines, config):
        super().__init__(roles, requests, deadlines, config)
        #: per role, whether its queue is known to be in urgency order already
        self.order = QueueOrder()
        #: the lowest priority of any request admitted so far (shed_for: none queued is lower)
        self.lowest_priority = math.inf

    def push(self, req, role: str, now: float, front: bool = False, fresh: bool = True) -> None:
        super().push(req, role, now, front, fresh)
        if role not in self.order.known:
            return
        if front or not fresh or not self.order.holds(role, now):
            self.order.forget(role)
        else:
            self.order.appended(role, self.deadlines.urgency(req, now), req, now, self.config.schedule.aging_s)

    def ordered(self, role: str, now: float) -> collections.deque[str]:
        """Sorted by urgency, unless known to be in that order already (QueueOrder: sorting it would change nothing).
        Dispatch asks only where some instance of the role could take a request (Router.dispatch_queued)."""
        queue = self.by_role[role]
        if len(queue) < 2 or self.order.holds(role, now):
            return queue
        ranked = [(self.deadlines.urgency(req, now), req) for rid in queue if (req := self.requests.get(rid)) is not None]
        ranked.sort(key=_first)  # stable: equal urgencies keep their order
        queue.clear()
        queue.extend(req.id for _, req in ranked)
        self.order.sorted(role, [(key, req) for key, req in ranked if req.stage == role and req.state == "queued"],
                          now, self.config.schedule.aging_s)
        return queue

    def ended(self, req) -> None:
        self.order.forget(req.stage)  # the queue's order may change

    def arriving(self, params) -> None:
        self.lowest_priority = min(self.lowest_priority, params.priority or 0)

    def shed_for(self, params):
        """The lowest priority, the latest of those, if lower than the new request's."""
        priority = params.priority or 0
        if priority <= self.lowest_priority:  # none queued is lower: no need to look through 4,096 of them
            return None
        worst = None
        for queue in self.by_role.values():
            for rid in queue:
                req = self.requests.get(rid)
                if req is None or req.state != "queued":
                    continue
                key = (req.params.priority or 0, -req.submitted_at)
                if key[0] < priority and (worst is None or key < worst[0]):
                    worst = (key, req)
        return worst[1] if worst else None


def _first(pair: tuple):
    return pair[0]


def _next_boost(queued_at: float, now: float, aging_s: float) -> float:
    """A time before which a request queued at `queued_at` keeps the aging boost it has at `now` (a little early,
    so float rounding never makes it late)."""
    at = queued_at + ((now - queued_at) // aging_s + 1) * aging_s
    return at - 1e-6 - 1e-9 * abs(at)


class QueueOrder:
    """What SloQueue.ordered knows of each role's queue under schedule slo, so that it sorts only when the order may
    have changed (a sort of 4,096 waiting requests after every message is what made the control plane slow).

    Known, for a role: its live entries (requests queued in that role) are in urgency order at every time before
    `until`, and the last of them has urgency `last`. This holds while none of them has a deadline: their slack
    is then infinite, so priority, aging and arrival alone order them, and aging changes their keys only at
    times known in advance. A request added at the back keeps it when it is no more urgent than the last (a
    stable sort would leave it there); anything else (a request with a deadline, one put at the front, one
    queued in the role again, one that ended while queued) forgets it, and the next ordered() sorts as
    before. A stale entry (a request no longer queued there) may sit out of order: dispatch skips it, and where
    it sits changes no decision."""

    def __init__(self):
        #: role -> (until, last), for each role whose queue's order is known
        self.known: dict[str, tuple[float, tuple]] = {}

    def holds(self, role: str, now: float) -> bool:
        known = self.known.get(role)
        return known is not None and now < known[0]

    def forget(self, role: str) -> None:
        self.known.pop(role, None)

    def sorted(self, role: str, ranked: list[tuple[tuple, object]], now: float, aging_s: float) -> None:
        """The queue was just sorted: `ranked` holds its live entries, in order, with their urgency."""
        until = math.inf
        for _, req in ranked:
            if req.slo_deadline is not None:
                self.forget(role)
                return
            until = min(until, _next_boost(req.marks.get(NAMES[role].queued, now), now, aging_s))
        if ranked:
            self.known[role] = (until, ranked[-1][0])
        else:
            self.forget(role)

    def appended(self, role: str, key: tuple, req, now: float, aging_s: float) -> None:
        """`req`, of urgency `key`, was just added at the back of `role`'s queue (known to be in order at `now`)."""
        until, last = self.known[role]
        if req.slo_deadline is not None or key < last:
            self.forget(role)
        else:
            self.known[role] = (min(until, _next_boost(now, now, aging_s)), key)


#: the `schedule` setting -> its queue
QUEUES = {Schedule.FIFO: FifoQueue, Schedule.SLO: SloQueue}


def make_queue(config, roles, requests: dict, deadlines) -> FifoQueue:
    return QUEUES[Schedule(config.schedule.order)](roles, requests, deadlines, config)
