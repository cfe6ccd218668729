"""Counters, the status snapshot the orchestrator answers `disagg status` with, and where requests are (RequestQuery)."""

from __future__ import annotations

import collections
import os

from disagg.orchestrator.requests import ROLES, STAGES
from disagg.transport.wire.messages import (
    GatewayStatus,
    PairEngine,
    RequestCounts,
    RequestState,
    RequestStates,
    StageTime,
    StatusReport,
    TransferCount,
)

THROUGHPUT_WINDOW_S = 10.0
#: the timings a request's Result carries per stage, as phase_role
STAGE_PHASES = ("queue", "compute", "fetch")
#: a gateway not heard from for this long is no longer listed in status
GATEWAY_SILENCE_S = 5.0
#: the producer-consumer pairs status lists, the ones that handed over most recently (a large deployment's pairs
#: would grow with every instance of one role times every one of the next)
MAX_PAIRS = 1024
#: ended requests' timings, and handoffs, gathered before they are added up (Stats.record, Stats.transferred)
FOLD_AT = 1024
#: a timing's name -> (role, phase), or () for one that is not a stage's phase (Stats.record)
_STAGE_PHASE: dict[str, tuple] = {}


class Stats:
    """Requests ended since start, and recent completions for a throughput figure."""

    def __init__(self):
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.invalid = 0
        #: (role, phase) -> [requests, seconds]: every client's requests, for /metrics (read as stage_times)
        self._stage_times: dict[tuple[str, str], list] = collections.defaultdict(lambda: [0, 0.0])
        #: the timings of ended requests not yet added to the stage times: added when they are read, or FOLD_AT
        #: of them at once (the same sums in the same order; a request's ending costs an append)
        self._unfolded: list[dict[str, float]] = []
        #: (producer role, consumer role, engine) -> [handoffs, bytes] (read as transfers)
        self._transfers: dict[tuple[str, str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
        #: (producer id, consumer id) -> [engine, handoffs, producer host, consumer host]: the MAX_PAIRS that handed
        #: over last, the least recent first (read as pairs)
        self._pairs: dict[tuple[str, str], list] = {}
        #: handoffs not yet added to those two, as (producer, consumer, engine, bytes), like _unfolded
        self._handoffs: list[tuple] = []
        self._finish_times: collections.deque[float] = collections.deque()

    def record(self, state: str, now: float, timings: dict[str, float] | None = None) -> None:
        """A request ended in `state`, with its Result's `timings` (an ended request's: no longer written to)."""
        if timings:
            self._unfolded.append(timings)
            if len(self._unfolded) >= FOLD_AT:
                self._fold()
        if state == "done":
            self.completed += 1
            self._finish_times.append(now)
        elif state == "cancelled":
            self.cancelled += 1
        elif state == "invalid":
            self.invalid += 1
        else:
            self.failed += 1

    @property
    def stage_times(self) -> dict[tuple[str, str], list]:
        self._fold()
        return self._stage_times

    def _fold(self) -> None:
        unfolded, self._unfolded = self._unfolded, []
        stage_times = self._stage_times
        for timings in unfolded:
            for key, seconds in timings.items():
                where = _STAGE_PHASE.get(key)
                if where is None:
                    phase, _, role = key.partition("_")
                    where = (role, phase) if phase in STAGE_PHASES and role else ()
                    if len(_STAGE_PHASE) < 1024:  # the router's own names: a few dozen
                        _STAGE_PHASE[key] = where
                if where:
                    total = stage_times[where]
                    total[0] += 1
                    total[1] += seconds

    def transferred(self, producer, consumer, engine: str, nbytes: int) -> None:
        """One handoff from instance `producer` to instance `consumer` (an instance's id, role and host are those of
        its registration: they are read when the handoffs are added up)."""
        self._handoffs.append((producer, consumer, engine, nbytes))
        if len(self._handoffs) >= FOLD_AT:
            self._add_handoffs()

    @property
    def transfers(self) -> dict[tuple[str, str, str], list[int]]:
        self._add_handoffs()
        return self._transfers

    @property
    def pairs(self) -> dict[tuple[str, str], list]:
        self._add_handoffs()
        return self._pairs

    def _add_handoffs(self) -> None:
        handoffs, self._handoffs = self._handoffs, []
        transfers, pairs = self._transfers, self._pairs
        for producer, consumer, engine, nbytes in handoffs:
            edge = transfers[(producer.role, consumer.role, engine)]
            edge[0] += 1
            edge[1] += nbytes
            key = (producer.id, consumer.id)
            pair = pairs.pop(key, None)
            if pair is None:
                pair = [engine, 0, producer.host, consumer.host]
                if len(pairs) >= MAX_PAIRS:
                    del pairs[next(iter(pairs))]
            pairs[key] = pair  # (last: the most recent)
            pair[0] = engine
            pair[1] += 1

    def throughput(self, now: float, since: float) -> float:
        while self._finish_times and now - self._finish_times[0] > THROUGHPUT_WINDOW_S:
            self._finish_times.popleft()
        window = min(THROUGHPUT_WINDOW_S, max(now - since, 1e-9))
        return round(len(self._finish_times) / window, 3)


def snapshot(router, now: float) -> StatusReport:
    """What `disagg status` shows, from a Router's state."""
    instances = [i for role in ROLES for i in router.registry.of_role(role)]  # by role, then id (of_role is cached)
    return StatusReport(
        orchestrator={
            "pid": os.getpid(),
            "id": router.id,
            "deployment_id": router.config.deployment_id,
            "endpoint": router.endpoint,
            "lane": router.lane,
            "restarts": router.restarts,
            "uptime_s": round(now - router.started_at, 3),
            #: stage boundaries a stage's instance forwarded the next Run across itself (disagg/orchestrator/forwards.py)
            "forwarded": router.forwarded_hops,
            "state": "draining" if (router.draining or router.stopping) else "ready",
            "host_id": router.config.host_id,
            "model": router.model.name if router.model is not None else "",
            #: what the model can make, as its first stage reports it (0: no limit, max_frames 0: images only)
            **{key: value for key, value in router.limits.items()},
            #: roles with no instance that serves or will, and for how long (a join may still be coming)
            **{f"unserved_{role}_s": round(now - since, 3) for role, since in router.unserved_since.items()},
        },
        instances=[i.status(now) for i in instances],
        queues={
            role: router.queue.waiting(role)
            for role in router.queues
            if role in STAGES or router.config.colocated
        },
        requests=RequestCounts(
            in_flight=len(router.requests), completed=router.stats.completed, failed=router.stats.failed,
            cancelled=router.stats.cancelled, invalid=router.stats.invalid,
        ),
        throughput_rps=router.stats.throughput(now, router.started_at),
        gateways=[GatewayStatus(url=beat.url, pid=beat.pid, restarts=beat.restarts, last_seen_s=round(now - seen, 3))
                  for beat, seen in router.gateways.values() if now - seen <= GATEWAY_SILENCE_S],
        stage_times=[StageTime(role=r, phase=ph, count=n, sum_s=round(t, 6))
                     for (r, ph), (n, t) in sorted(router.stats.stage_times.items())],
        transfers=[TransferCount(source=a, target=b, engine=e, count=n, bytes=nbytes)
                   for (a, b, e), (n, nbytes) in sorted(router.stats.transfers.items())],
        warnings=list(router.warnings),
        loras=sorted(router.lora_catalog.names())[:4096], any_lora=router.lora_catalog.any_name,
        pairs=[PairEngine(source=a, target=b, engine=e, count=n, source_host=ha, target_host=hb)
               for (a, b), (e, n, ha, hb) in sorted(router.stats.pairs.items())],
        schedule=router.config.schedule.order, queue_slack=queue_slack(router, now), slo=router.deadlines.counts.report(),
    )


def queue_slack(router, now: float) -> dict[str, float]:
    """Per role, the least slack of the requests waiting in its queue that have a deadline."""
    out = {}
    for role, queue in router.queues.items():
        slacks = [router.deadlines.slack(req, now) for rid in queue
                  if (req := router.requests.get(rid)) is not None and req.slo_deadline is not None]
        if slacks:
            out[role] = round(min(slacks), 3)
    return out


def request_states(router, request_ids: list[str], now: float) -> RequestStates:
    """Where each of these requests is (RequestQuery): queued or running, in which stage, at which step."""
    states = {}
    for rid in request_ids:
        req = router.requests.get(rid)
        if req is None:
            states[rid] = RequestState(state="unknown")
            continue
        step, steps = 0, 0
        inst = router.registry.get(req.assigned) if req.assigned else None
        if inst is not None and rid in inst.steps:
            step, steps = inst.steps[rid]
        left = router.deadlines.predicted_left(req, now) if router.deadlines.predictor.per_unit else None
        states[rid] = RequestState(state="running" if req.state == "running" else "queued", stage=req.stage,
                                   step=step, steps=steps, finish_in_s=None if left is None else round(left, 3),
                                   slack_s=None if req.slo_deadline is None else
                                   round(router.deadlines.slack(req, now), 3))
    return RequestStates(states=states)
