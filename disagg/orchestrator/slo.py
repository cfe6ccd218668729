"""Deadlines and priorities (`schedule: slo`, `admission: slo`): how long a request's stages will take, the
slack its deadline leaves, the order of a role's queue, and the met/missed counts.

Predictions come from measured device times (each Staged / Done report's `device_s`, else `compute_s`), per
role and per shape (width, height, frames, images per prompt); a denoiser's per step. A shape not measured
yet is scaled from the role's mean seconds per pixel-frame; a role not measured at all predicts nothing, and
then nothing is refused.
"""

from __future__ import annotations

import math

from disagg.orchestrator.outbox import to_client
from disagg.settings.choices import Admission, Schedule
from disagg.transport.averages import ewma
from disagg.transport.messages import SLACK_BUCKETS_S, ErrorCode, Rejected, SloCount


def shape(p) -> tuple:
    return (p.width, p.height, p.num_frames, p.num_images_per_prompt)


def _units(p) -> float:
    """A request's size in pixel-frames (the model's defaults, unknown here, count as 1024^2 x 1)."""
    return (p.width or 1024) * (p.height or 1024) * max(p.num_frames or 1, 1) * p.num_images_per_prompt


def _steps(p) -> int:
    return p.num_inference_steps or 0


class StagePredictor:
    """Seconds each stage takes one request alone, learnt from what the roles measured."""

    def __init__(self):
        #: (role, shape) -> seconds (a denoiser's: per step when the request names its steps)
        self.by_shape: dict[tuple, float] = {}
        #: role -> seconds per pixel-frame (per step for the denoiser), over every shape
        self.per_unit: dict[str, float] = {}
        #: role -> the last steps a request used when it named none (the model's default)
        self.default_steps: dict[str, int] = {}

    def _per_step(self, role: str, p) -> bool:
        return role in ("denoiser", "monolith") and bool(_steps(p))

    def record(self, role: str, p, seconds: float) -> None:
        if seconds <= 0:
            return
        per_step = self._per_step(role, p)
        value = seconds / _steps(p) if per_step else seconds
        key = (role, shape(p), per_step)
        self.by_shape[key] = ewma(self.by_shape.get(key), value)
        self.per_unit[role] = ewma(self.per_unit.get(role), value / _units(p))

    def predict(self, role: str, p, measured_only: bool = False) -> float | None:
        """Seconds `role` should take request `p` alone; None before any measurement of that role (with
        `measured_only`, of that role at `p`'s shape: no estimate scaled from other shapes)."""
        per_step = self._per_step(role, p)
        value = self.by_shape.get((role, shape(p), per_step))
        if value is None and measured_only:
            return None
        if value is None:
            unit = self.per_unit.get(role)
            if unit is None:
                return None
            value = unit * _units(p)
        return value * _steps(p) if per_step else value


def stages_from(role: str, colocated: bool) -> tuple[str, ...]:
    """The stages a request in `role` still goes through, `role` included."""
    if colocated or role == "monolith":
        return ("monolith",)
    order = ("encoder", "denoiser", "decoder")
    return order[order.index(role):]


class SloCounts:
    """Requests with a deadline that ended, per priority: met or missed, and their slack at finish."""

    def __init__(self):
        self.by_priority: dict[int, SloCount] = {}

    def record(self, priority: int, slack_s: float, met: bool) -> None:
        c = self.by_priority.get(priority)
        if c is None:
            c = self.by_priority[priority] = SloCount(priority=priority, buckets=[0] * len(SLACK_BUCKETS_S))
        if met:
            c.met += 1
        else:
            c.missed += 1
        c.slack_s += slack_s
        for i, bound in enumerate(SLACK_BUCKETS_S):
            if slack_s <= bound:
                c.buckets[i] += 1

    def report(self) -> list[SloCount]:
        return [self.by_priority[k] for k in sorted(self.by_priority)]


def _first(pair: tuple):
    return pair[0]


def _next_boost(queued_at: float, now: float, aging_s: float) -> float:
    """A time before which a request queued at `queued_at` keeps the aging boost it has at `now` (a little early,
    so float rounding never makes it late)."""
    at = queued_at + ((now - queued_at) // aging_s + 1) * aging_s
    return at - 1e-6 - 1e-9 * abs(at)


class QueueOrder:
    """What order_queue knows of each role's queue under schedule slo, so that it sorts only when the order may
    have changed (a sort of 4,096 waiting requests after every message is what made the control plane slow).

    Known, for a role: its live entries (requests queued in that role) are in urgency order at every time before
    `until`, and the last of them has urgency `last`. This holds while none of them has a deadline: their slack
    is then infinite, so priority, aging and arrival alone order them, and aging changes their keys only at
    times known in advance. A request added at the back keeps it when it is no more urgent than the last (a
    stable sort would leave it there); anything else (a request with a deadline, one put at the front, one
    queued in the role again, one that ended while queued) forgets it, and the next order_queue sorts as
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
            until = min(until, _next_boost(req.marks.get(f"queued_{role}", now), now, aging_s))
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


class Slo:
    """Methods of Router (a mixin); see disagg/orchestrator/router.py for the state they use."""

    def stage_left(self, req, role: str, now: float) -> float:
        """Seconds `role`'s stage still needs for the request: all of it unless it runs there now; then what its
        steps done (heartbeats) or its time there so far leave (0 for what is not measured yet)."""
        seconds = self.predictor.predict(role, req.params) or 0.0
        if role == req.stage and req.state == "running":
            inst = self.registry.get(req.assigned) if req.assigned else None
            done = inst.steps.get(req.id) if inst is not None else None
            if done and done[1]:
                return seconds * max(1 - done[0] / done[1], 0.0)
            return max(seconds - (now - req.marks.get(f"run_{role}", now)), 0.0)
        return seconds

    def predicted_left(self, req, now: float) -> float:
        """Seconds the request still needs, from its current stage on (0 for what is not measured yet)."""
        return sum(self.stage_left(req, role, now) for role in stages_from(req.stage, self.config.colocated))

    def slo_pick(self, req, candidates: list, now: float) -> list:
        """schedule slo, a request with a deadline: of the instances that could take it now, those where it
        should get the device soonest. An instance's requests step by urgency (disagg/roles/turns.py), so the request
        waits for what the more urgent ones it would join still need, and for one step of a less urgent one
        (the device is handed over at step boundaries). Ties are left to the dispatch policy."""
        role = req.stage
        mine = self.urgency(req, now)
        best, chosen = math.inf, []
        for inst in candidates:
            if not inst.dispatchable:
                continue
            ahead, step = 0.0, 0.0
            for rid in inst.running:
                other = self.requests.get(rid)
                if other is None:
                    continue
                left = self.stage_left(other, role, now)
                if self.urgency(other, now) < mine:
                    ahead += left
                else:
                    steps = other.params.num_inference_steps or 1
                    step = max(step, min(left, (self.predictor.predict(role, other.params) or 0.0) / steps))
            wait = ahead + step
            if wait < best - 1e-6:
                best, chosen = wait, [inst]
            elif wait <= best + 1e-6:
                chosen.append(inst)
        return chosen

    def slack(self, req, now: float) -> float:
        """Deadline - now - predicted time left; infinite without a deadline."""
        if req.slo_deadline is None:
            return math.inf
        return req.slo_deadline - now - self.predicted_left(req, now)

    def stage_deadline(self, req, role: str, now: float) -> float | None:
        """Seconds from now by which `role`'s stage should end: the deadline less the later stages' time."""
        if req.slo_deadline is None:
            return None
        later = stages_from(role, self.config.colocated)[1:]
        return req.slo_deadline - now - sum(self.predictor.predict(r, req.params) or 0.0 for r in later)

    def urgency(self, req, now: float) -> tuple:
        """A queue's order under schedule slo, most urgent first: priority (plus one per schedule_aging_s
        waited in this queue), then those that can still meet their deadline, then least slack, then arrival."""
        waited = now - req.marks.get(f"queued_{req.stage}", now)
        boost = int(waited // self.config.schedule_aging_s)
        slack = self.slack(req, now)
        # one predicted to miss its deadline anyway goes after those that can still meet theirs (least slack
        # first would otherwise serve the late ones first, and make the others late too)
        return (-((req.params.priority or 0) + boost), slack < 0, slack, req.submitted_at)

    def order_queue(self, role: str, now: float) -> None:
        """Sort a role's queue by urgency (schedule slo), when something could take a request now, unless it is
        known to be in that order already (QueueOrder: sorting it would change nothing)."""
        queue = self.queues[role]
        if len(queue) < 2 or self.queue_order.holds(role, now) or not self.registry.free.any_room(role):
            return
        ranked = [(self.urgency(req, now), req) for rid in queue if (req := self.requests.get(rid)) is not None]
        ranked.sort(key=_first)  # stable: equal urgencies keep their order
        queue.clear()
        queue.extend(req.id for _, req in ranked)
        self.queue_order.sorted(role, [(key, req) for key, req in ranked if req.stage == role and req.state == "queued"],
                                now, self.config.schedule_aging_s)

    def note_enqueued(self, req, role: str, now: float, front: bool, fresh: bool) -> None:
        """`req` was just put in `role`'s queue (at its front, or at its back; fresh: never queued in that role
        before, so no older entry of it is left in the queue): whether the queue is still in urgency order."""
        if front or not fresh or not self.queue_order.holds(role, now):
            self.queue_order.forget(role)
        else:
            self.queue_order.appended(role, self.urgency(req, now), req, now, self.config.schedule_aging_s)

    def unmeetable(self, params, now: float) -> str:
        """admission slo: why a request with these parameters cannot meet its deadline even if it ran at once
        (its stages' predicted times exceed slo_ms); "" when it can, or nothing is measured yet."""
        if self.config.admission != Admission.SLO or params.slo_ms is None:
            return ""
        roles = stages_from(self.first_stage, self.config.colocated)
        parts = {role: self.predictor.predict(role, params) for role in roles}
        if any(v is None for v in parts.values()):
            return ""
        need_ms = 1000 * sum(parts.values())
        if need_ms <= params.slo_ms:
            return ""
        detail = ", ".join(f"{role} {1000 * s:.0f} ms" for role, s in parts.items())
        return (f"deadline unmeetable: slo_ms {params.slo_ms:g} is less than the {need_ms:.0f} ms this request "
                f"takes alone ({detail}, measured)")

    def shed_for(self, params) -> object | None:
        """Under overload (a full queue), the queued request to shed for a new one of higher priority: the
        lowest priority, the latest of those; None when none is lower."""
        priority = params.priority or 0
        if priority <= self.lowest_priority:  # none queued is lower: no need to look through 4,096 of them
            return None
        worst = None
        for role, queue in self.queues.items():
            for rid in queue:
                req = self.requests.get(rid)
                if req is None or req.state != "queued":
                    continue
                key = (req.params.priority or 0, -req.submitted_at)
                if key[0] < priority and (worst is None or key < worst[0]):
                    worst = (key, req)
        return worst[1] if worst else None

    def admit(self, identity, msg, now: float, out) -> bool:
        """Submit's admission: a full queue refuses it (or, under schedule slo, sheds a queued request of lower
        priority for it); admission slo refuses a deadline it cannot meet. False: refused, and told so."""
        limit = self.config.max_queue
        self.lowest_priority = min(self.lowest_priority, msg.params.priority or 0)  # of any request admitted so far
        for role, queue in self.queues.items():
            if len(queue) < limit:
                continue
            shed = self.shed_for(msg.params) if self.config.schedule == Schedule.SLO else None
            if shed is not None:
                self.fail(shed, f"shed: the {role} queue is full (max_queue {limit}) and a request of priority "
                          f"{msg.params.priority} came; retry later", now, out, code=ErrorCode.OVERLOADED)
                continue
            reason = f"overloaded: the {role} queue holds {len(queue)} requests (max_queue {limit}); retry later"
            out.append(to_client(identity, Rejected(request_id=msg.request_id, reason=reason,
                                                    code=ErrorCode.OVERLOADED)))
            return False
        why = self.unmeetable(msg.params, now)
        if why:
            out.append(to_client(identity, Rejected(request_id=msg.request_id, reason=why, param="slo_ms",
                                                    code=ErrorCode.DEADLINE)))
            return False
        return True

    def note_slo_end(self, req, state: str, now: float) -> None:
        if req.slo_deadline is None or state in ("cancelled", "invalid"):
            return
        slack = req.slo_deadline - now
        self.slo_counts.record(req.params.priority or 0, round(slack, 6), state == "done" and slack >= 0)
