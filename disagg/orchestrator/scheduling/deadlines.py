"""Deadlines and priorities (`schedule: slo`, `admission: slo`): how long a request's stages will take, the
slack its deadline leaves, its urgency, and the met/missed counts. The queue that orders by urgency is
disagg/orchestrator/scheduling/queues.py; placement by it, disagg/orchestrator/scheduling/placement.py; admission by it,
disagg/orchestrator/scheduling/admission.py.

Predictions come from measured device times (each Staged / Done report's `device_s`, else `compute_s`), per
role and per shape (width, height, frames, images per prompt); a denoiser's per step. A shape not measured
yet is scaled from the role's mean seconds per pixel-frame; a role not measured at all predicts nothing, and
then nothing is refused.
"""

from __future__ import annotations

import math

from disagg.common import urgency
from disagg.common.averages import ewma
from disagg.orchestrator.requests import NAMES, micro
from disagg.transport.wire.messages import SLACK_BUCKETS_S, SloCount


def shape(p) -> tuple:
    return (p.width, p.height, p.num_frames, p.num_images_per_prompt)


def _units(p) -> float:
    """A request's size in pixel-frames (the model's defaults, unknown here, count as 1024^2 x 1)."""
    return (p.width or 1024) * (p.height or 1024) * max(p.num_frames or 1, 1) * p.num_images_per_prompt


#: the roles whose time is per denoising step
_PER_STEP_ROLES = ("denoiser", "monolith")


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
        #: as by_shape, in H200-seconds (each measurement x its device's speed, disagg/settings/devices.py), kept
        #: once a device of a known class other than the H200 reported: `rebalance` plans devices of several
        #: classes from them
        self.at_speed_1: dict[tuple, float] = {}
        self.scaled = False

    def _per_step(self, role: str, p) -> bool:
        return role in _PER_STEP_ROLES and bool(_steps(p))

    def record(self, role: str, p, seconds: float, speed: float = 1.0) -> None:
        """`seconds` measured on a device of `speed` (an H200's 1; 1 where unknown)."""
        if seconds <= 0:
            return
        steps = p.num_inference_steps  # (_per_step and _steps inline: three stages of every request come here)
        per_step = bool(steps) and role in _PER_STEP_ROLES
        value = seconds / steps if per_step else seconds
        key = (role, shape(p), per_step)
        self.by_shape[key] = ewma(self.by_shape.get(key), value)
        self.per_unit[role] = ewma(self.per_unit.get(role), value / _units(p))
        if speed != 1.0 or self.scaled:
            self.scaled = True
            self.at_speed_1[key] = ewma(self.at_speed_1.get(key), value * speed)

    def predict(self, role: str, p, measured_only: bool = False, at_speed_1: bool = False) -> float | None:
        """Seconds `role` should take request `p` alone; None before any measurement of that role (with
        `measured_only`, of that role at `p`'s shape: no estimate scaled from other shapes). `at_speed_1`: in
        H200-seconds, from measurements at `p`'s shape only (by_shape's where no device of another speed reported)."""
        per_step = self._per_step(role, p)
        if at_speed_1 and self.scaled:
            value = self.at_speed_1.get((role, shape(p), per_step))
            return None if value is None else value * _steps(p) if per_step else value
        value = self.by_shape.get((role, shape(p), per_step))
        if value is None and at_speed_1:
            return None
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



class Deadlines:
    """Time left and slack of the Router's requests, from the stage times the roles measured (`predictor`), and the
    deadlines met and missed (`counts`). Reads the Router's registry and requests; changes neither."""

    def __init__(self, config, registry, requests: dict):
        self.config = config
        self.registry = registry
        self.requests = requests
        self.predictor = StagePredictor()
        self.counts = SloCounts()

    def stage_left(self, req, role: str, now: float) -> float:
        """Seconds `role`'s stage still needs for the request: all of it unless it runs there now; then what its
        steps done (heartbeats) or its time there so far leave (0 for what is not measured yet)."""
        seconds = self.predictor.predict(role, req.params) or 0.0
        if role == req.stage and req.state == "running":
            inst = self.registry.get(req.assigned) if req.assigned else None
            done = inst.steps.get(req.id) if inst is not None else None
            if done and done[1]:
                return seconds * max(1 - done[0] / done[1], 0.0)
            return max(seconds - (now - req.marks.get(NAMES[role].run, now)), 0.0)
        return seconds

    def predicted_left(self, req, now: float) -> float:
        """Seconds the request still needs, from its current stage on (0 for what is not measured yet)."""
        return sum(self.stage_left(req, role, now) for role in stages_from(req.stage, self.config.colocated))

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
        """The request's place in its role's queue (disagg/common/urgency.py `key`): effective priority (aging by
        the time waited in this queue), then those that can still meet their deadline, least slack first, then
        those without one, then the late ones; then arrival."""
        waited = now - req.marks.get(NAMES[req.stage].queued, now)
        return urgency.key(req.params.priority, waited, self.config.schedule.aging_s, self.slack(req, now),
                           req.submitted_at)

    def unmeetable(self, params, first_stage: str) -> str:
        """Why a request with these parameters cannot meet its deadline even if it ran at once (its stages'
        predicted times exceed slo_ms); "" when it can, has no deadline, or nothing is measured yet."""
        if params.slo_ms is None:
            return ""
        roles = stages_from(first_stage, self.config.colocated)
        parts = {role: self.predictor.predict(role, params) for role in roles}
        if any(v is None for v in parts.values()):
            return ""
        need_ms = 1000 * sum(parts.values())
        if need_ms <= params.slo_ms:
            return ""
        detail = ", ".join(f"{role} {1000 * s:.0f} ms" for role, s in parts.items())
        return (f"deadline unmeetable: slo_ms {params.slo_ms:g} is less than the {need_ms:.0f} ms this request "
                f"takes alone ({detail}, measured)")

    def ended(self, req, state: str, now: float) -> None:
        """Count a request with a deadline that ended (met or missed; a cancelled or invalid one counts for neither)."""
        if req.slo_deadline is None or state in ("cancelled", "invalid"):
            return
        slack = req.slo_deadline - now
        self.counts.record(req.params.priority or 0, micro(slack), state == "done" and slack >= 0)
