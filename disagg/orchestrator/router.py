"""The orchestrator's brain: a plain object fed messages and the time, returning messages to send.

No sockets and no clock of its own, so every scenario runs in a test in microseconds.
"""

from __future__ import annotations

import collections
import logging
import random
import uuid

import msgspec

from disagg.orchestrator.forwards import Forwards
from disagg.orchestrator.handoff import InlineNeeds
from disagg.orchestrator.instances import InstanceLifecycle
from disagg.orchestrator.outbox import Out, RouterConfig, to_client, to_instance
from disagg.orchestrator.parts.base import Listeners
from disagg.orchestrator.parts.previews import Previews
from disagg.orchestrator.parts.rebalance import Rebalance
from disagg.orchestrator.parts.recovery import Recovery
from disagg.orchestrator.registry import Registry
from disagg.orchestrator.reports import StageReports
from disagg.orchestrator.requests import MONOLITH, ROLES, Request, over_limits
from disagg.orchestrator.scheduling.admission import Admission
from disagg.orchestrator.scheduling.deadlines import Deadlines
from disagg.orchestrator.scheduling.dispatch import make_policy
from disagg.orchestrator.scheduling.loras import LoraCatalog
from disagg.orchestrator.scheduling.placement import Placement
from disagg.orchestrator.scheduling.queues import make_queue
from disagg.orchestrator.stats import Stats, request_states, snapshot
from disagg.orchestrator.steps import RequestSteps
from disagg.transport.wire.messages import (
    Cancel,
    Dead,
    Done,
    ErrorCode,
    Failed,
    Fetched,
    Forward,
    GatewayBeat,
    Heartbeat,
    Register,
    Rejected,
    RequestQuery,
    Staged,
    StatusQuery,
    StatusReport,
    Stop,
    StopHost,
    Submit,
)

log = logging.getLogger("disagg.orchestrator")

class Router(InstanceLifecycle, RequestSteps, StageReports, Forwards):
    """The request and instance state machine (this file, steps.py, reports.py, instances.py, forwards.py), composed with its parts: the queue
    the `schedule` setting chooses (queues.py) with admission beside it (admission.py), the placement chain ending in
    the dispatch policy (placement.py, dispatch.py), and the parts that hear its events (parts.py): previews,
    rebalance, recovery. Time comes as `now`; randomness (`rng`, `seed`) and its own id (`new_id`) are injected."""

    def __init__(self, config: RouterConfig | None = None, now: float = 0.0, rng: random.Random | None = None,
                 seed: int = 0, new_id=lambda: uuid.uuid4().hex[:12]):
        self.config = config or RouterConfig()
        #: draws the seed of a request that names none (a retry of any stage then reproduces the same image)
        self.rng = rng or random.Random()
        #: each part's own generator starts from it (rng_for)
        self.seed = seed
        self.registry = Registry()
        self.policy = make_policy(self.config.dispatch)
        self.policy.index = self.registry.free  # picks look at ready instances with a free slot only
        self.first_stage = MONOLITH if self.config.colocated else "encoder"
        self.pipeline_roles = (MONOLITH,) if self.config.colocated else ("encoder", "denoiser", "decoder")
        #: role -> since when it has had no instance that serves or will (see note_served)
        self.unserved_since: dict[str, float] = {role: now for role in self.pipeline_roles}
        #: the model every instance must serve (foreign_model)
        self.model = self.config.model_identity
        self.requests: dict[str, Request] = {}
        #: (instance id, request id) -> attempt of each instance reserved for a request's next stage, until its
        #: producer's Staged comes or it is withdrawn (disagg/orchestrator/forwards.py)
        self.reservations: dict[tuple[str, str], int] = {}
        #: stage boundaries crossed by a Forward since start (status: orchestrator.forwarded)
        self.forwarded_hops = 0
        self.stats = Stats()
        self.started_at = now
        self.id = new_id()  # a restarted orchestrator is a different one
        self.restarts = 0
        self.stopping = False
        self.draining = False
        self._drain_client: bytes | None = None
        self.endpoint = ""  # shown in status; set by the server that owns the sockets
        self.lane = ""  # the same-host fast lane's path, likewise; told to roles in Registered
        self._warned_pairs: set[tuple[str, str]] = set()
        #: (instance id, engine, reason) of each unavailable engine warned about (instances.warn_unavailable_engines)
        self._warned_engines: set[tuple[str, str, str]] = set()
        #: what status shows an operator (StatusReport.warnings)
        self.warnings: collections.deque[str] = collections.deque(maxlen=16)
        #: whether a producer's output must travel inline (disagg/orchestrator/handoff.py)
        self.needs_inline = InlineNeeds(self.registry, self.config.transfer)
        #: what the model can make (max_width, max_height, max_frames; 0 = no limit), as the instances
        #: of the first stage report it: larger requests are refused at Submit
        self.limits: dict[str, int] = {}
        #: some limit is set (over 0): a Submit is checked against them
        self.limited = False
        #: client identity -> (its last GatewayBeat, when): the HTTP gateways `status` lists
        self.gateways: dict[bytes, tuple[GatewayBeat, float]] = {}
        loras = self.config.loras
        #: the adapters requests may name (disagg/orchestrator/scheduling/loras.py)
        self.lora_catalog = LoraCatalog(loras.dir, loras.adapters, any_name=self.config.sim,
                                        max_per_request=loras.max_per_request)
        #: stage times, slack and urgency, deadlines met and missed (disagg/orchestrator/scheduling/deadlines.py)
        self.deadlines = Deadlines(self.config, self.registry, self.requests)
        #: the requests waiting per role, in the order the `schedule` setting chooses (disagg/orchestrator/scheduling/queues.py)
        self.queue = make_queue(self.config, ROLES, self.requests, self.deadlines)
        self.queues = self.queue.by_role
        self.admission = Admission(self.config, self.queue, self.deadlines, self.first_stage, self.fail)
        #: which instance takes a queued request (disagg/orchestrator/scheduling/placement.py)
        self.placement = Placement(self, self.policy)
        #: what roles hold for requests not known here (yet): how a restarted orchestrator resumes them
        self.recovery = Recovery(self)
        self.rebalance = Rebalance(self)  # pools that size themselves (disagg/orchestrator/parts/rebalance.py)
        self.previews = Previews(self)  # live previews' decodes (disagg/orchestrator/parts/previews.py)
        #: every part that hears the events (disagg/orchestrator/parts/base.py)
        self.parts = [*self.placement.parts, self.recovery, self.rebalance, self.previews]
        self.listeners = Listeners(self.parts)
        self._handlers = {
            Submit: self.handle_submit,
            StatusQuery: self.handle_status_query,
            Stop: self.handle_stop,
            StopHost: self.handle_stop_host,
            Cancel: self.handle_cancel,
            RequestQuery: self.handle_request_query,
            GatewayBeat: self.handle_gateway_beat,
            Register: self.handle_register,
            Heartbeat: self.handle_heartbeat,
            Staged: self.handle_staged,
            Fetched: self.handle_fetched,
            Done: self.handle_done,
            Failed: self.handle_failed,
            Dead: self.handle_dead,
            Forward: self.handle_forward,
        }
        for part in self.parts:
            self._handlers.update({kind: getattr(part, name) for kind, name in part.messages.items()})

    # --- what parts use (disagg/orchestrator/parts/base.py Core) ---------------------------------------

    def rng_for(self, name: str) -> random.Random:
        """A part's own generator (its draws do not depend on the others')."""
        return random.Random(self.seed)

    def instances_changed(self) -> None:
        self.needs_inline.clear()

    def recovering(self, now: float) -> bool:
        return self.recovery.recovering(now)

    # --- entry points -----------------------------------------------------------------------

    def restarted(self, restarts: int, now: float) -> None:
        """This orchestrator replaces one that died: its requests come back from clients and roles."""
        self.restarts = restarts
        if restarts:
            self.recovery.begin(now)

    def handle_client(self, identity: bytes, msg, frames: list[bytes], now: float) -> list[Out]:
        out: list[Out] = []
        self._handlers[type(msg)](identity, msg, frames, now, out)
        self.dispatch_queued(now, out)
        return out

    def handle_instance(self, sender: str, msg, frames: list[bytes], now: float) -> list[Out]:
        out: list[Out] = []
        if type(msg) is not Register:
            inst = self.registry.by_id.get(sender)
            if inst is None and self.recovery.keep_early(sender, msg, frames, now):
                return []  # a report that overtook its role's Register (after a restart): replayed after it
            if inst is None:
                log.warning("message %s from unregistered instance %r dropped", type(msg).__name__, sender)
                return [to_instance(sender, Rejected(reason="not registered: send Register first", code=ErrorCode.NOT_REGISTERED))]
            inst.last_seen = now
            if inst.state == "dead":
                # it was given up on; its work went elsewhere. It must register again. A report it sent
                # meanwhile is handled once it has (an output it staged is released then, not lost)
                self.recovery.keep_early(sender, msg, frames, now, pid=inst.pid)
                return [to_instance(sender, Rejected(reason="declared dead: register again", code=ErrorCode.NOT_REGISTERED))]
            if self.reservations and self.park_early(sender, msg, frames):
                return []  # a reserved instance's report that overtook its producer's Staged: handled after it
        self._handlers[type(msg)](sender, msg, frames, now, out)
        self.dispatch_queued(now, out)
        return out

    def tick(self, now: float) -> list[Out]:
        out: list[Out] = []
        self.expire_instances(now, out)
        self.expire_requests(now, out)
        self.drop_silent_gateways(now, out)
        self.note_served(now)
        self.fail_unserved(now, out)
        self.shutdown_drained(out, now)
        for tick in self.listeners.tick:
            tick(now, out)
        self.dispatch_queued(now, out)
        if self.draining and not self.requests and not self.stopping:
            log.info("drained; stopping")
            self.stop_all(out, now)
        return out

    # --- client messages --------------------------------------------------------------------

    def handle_submit(self, identity, msg: Submit, frames, now, out) -> None:
        if self.stopping or self.draining:
            why = "draining: finishing in-flight work, then stopping" if self.draining else "shutting down"
            out.append(to_client(identity, Rejected(request_id=msg.request_id, reason=why, code=ErrorCode.UNAVAILABLE)))
            return
        known = self.requests.get(msg.request_id)
        if known is not None:
            # the same request again (resubmitted after a restart, or by another gateway): it joins the run
            same = msg.params if msg.params.seed is not None else msgspec.structs.replace(msg.params, seed=known.params.seed)
            if same != known.params:
                out.append(to_client(identity, Rejected(request_id=msg.request_id, param="request_id",
                                                        reason="duplicate request_id with other parameters",
                                                        code=ErrorCode.DUPLICATE_REQUEST_ID)))
            elif identity not in known.clients:
                known.clients.append(identity)
            return
        why = self.not_ready(now)
        if why:
            out.append(to_client(identity, Rejected(request_id=msg.request_id, reason=why, code=ErrorCode.NOT_READY)))
            return
        if not self.admission.admit(identity, msg, now, out):  # a full queue, or a deadline it cannot meet
            return
        too_big = over_limits(self.limits, msg.params) if self.limited else None
        if too_big:
            field, why = too_big
            out.append(to_client(identity, Rejected(request_id=msg.request_id, reason=why, param=field,
                                                    code=ErrorCode.OVER_LIMIT)))
            return
        sources, why = self.lora_catalog.resolve(msg.params.loras)
        if why:
            out.append(to_client(identity, Rejected(request_id=msg.request_id, reason=why, param="loras",
                                                    code=ErrorCode.INVALID_REQUEST)))
            return
        params = msg.params
        if params.seed is None:
            # fixed here, so a retry of any stage reproduces the same image
            params = msgspec.structs.replace(params, seed=self.rng.randrange(2**31))
        timeout = msg.timeout_s or self.config.timeouts.request
        req = Request(id=msg.request_id, params=params, clients=[identity], submitted_at=now, deadline=now + timeout,
                      lora_sources=sources, slo_deadline=now - msg.age_s + params.slo_ms / 1000 if params.slo_ms else None)
        self.requests[req.id] = req
        for submitted in self.listeners.submitted:
            submitted(req, now)
        if self.recovery.recovering(now):  # roles are still telling what they hold: place it once they did
            req.state = "parked"
            self.recovery.parked.append(req.id)
            return
        self.recovery.place(req, now, out)

    def handle_status_query(self, identity, msg, frames, now, out) -> None:
        out.append(to_client(identity, self.snapshot(now)))

    def handle_gateway_beat(self, identity, msg: GatewayBeat, frames, now, out) -> None:
        self.gateways[identity] = (msg, now)

    def handle_request_query(self, identity, msg: RequestQuery, frames, now, out) -> None:
        out.append(to_client(identity, request_states(self, msg.request_ids, now)))

    def handle_cancel(self, identity, msg: Cancel, frames, now, out) -> None:
        """The client that sent a request gives it up: it ends now, without a Result. Its role, if it
        runs it, is told to stop; the slot comes back when the role reports (finish_run)."""
        req = self.requests.get(msg.request_id)
        if req is None or identity not in req.clients:
            return  # finished already, or not this client's: nothing to do
        if len(req.clients) > 1:  # others still wait for it
            req.clients.remove(identity)
            return
        if req.state == "running" and req.assigned:
            out.append(to_instance(req.assigned, Cancel(request_id=req.id, attempt=req.attempt)))
        self.release_source(req, out)
        log.info("request %s cancelled by its client (%s %s)", req.id, req.state, req.stage)
        self.end(req, "cancelled", now, out)

    # --- stats ------------------------------------------------------------------------------

    def snapshot(self, now: float) -> StatusReport:
        report = snapshot(self, now)
        for status in self.listeners.status:
            status(now, report)
        return report
