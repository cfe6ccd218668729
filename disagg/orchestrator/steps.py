"""The Router's request state machine steps: a request queued, placed (the placement chain chooses the instance,
disagg/orchestrator/scheduling/placement.py) and assigned, a run's report closing its slot and recorded (its timings,
its stage time), a source released, a request failed, ended or given a new attempt, its Result sent. A mixin of Router
(disagg/orchestrator/router.py): it works on the Router's requests, registry and queue, and tells its parts
(disagg/orchestrator/parts/base.py) what ended."""

from __future__ import annotations

import logging

import msgspec

from disagg.orchestrator.outbox import Out, to_client, to_instance
from disagg.orchestrator.registry import Instance
from disagg.orchestrator.requests import NAMES, ROLES, Request, micro
from disagg.orchestrator.scheduling.dispatch import AFFINITY_ROLES
from disagg.orchestrator.scheduling.loras import note_assigned
from disagg.orchestrator.scheduling.placement import DEFER, Placing
from disagg.settings.choices import Transfer
from disagg.transport.data.selection import choose_engine
from disagg.transport.wire.messages import ErrorCode, Release, Result, Run, Source

log = logging.getLogger("disagg.orchestrator")

#: requests that wait for their instance (DEFER) at most at once per role (the queue behind them moves on)
MAX_DEFERRED = 256


class RequestSteps:
    """Methods of Router; see disagg/orchestrator/router.py for the state they use."""

    def dispatch_queued(self, now: float, out: list[Out]) -> None:
        """Place what waits in each role's queue, in the queue's order, until none can take the next."""
        queues = self.queues
        if not any(queues.values()):  # (asked after every message: most find nothing waiting)
            return
        requests, free = self.requests, self.registry.free
        any_room, buckets = free.any_room, free.buckets
        for role in ROLES:
            queue = queues[role]
            if not queue:
                continue
            # where no instance could take a request, the chain would say None for the head: skip it (and the
            # sort), only dropping the entries at the head that ended or moved on. The index of instances with a
            # free slot says so at once (under load a role's queue often holds one request while every instance is
            # busy); with one waiting, the chain finds out about pool room as fast as any_room would
            if not (any_room(role) if len(queue) > 1 else buckets.get(role)):
                self.drop_gone_heads(queue, role)
                continue
            if len(queue) > 1:  # (one waiting is in order)
                queue = self.queue.ordered(role, now)
            candidates = self.registry.of_role(role)
            chain, adapter_chain = self.placement.chains[role], self.placement.adapter_chains[role]
            #: requests a placement step has wait (DEFER); the requests behind them are placed meanwhile, and
            #: they go back to the queue's front in order
            deferred: list[str] = []
            while queue:
                req = requests.get(queue[0])
                if req is None or req.state != "queued" or req.stage != role:  # (an ended one is not queued)
                    queue.popleft()  # ended or moved on while waiting
                    continue
                source = req.source
                producer = self.registry.by_id.get(source.slot.instance_id) if source is not None and self.config.host_aware else None
                inst = (adapter_chain if req.params.loras else chain)(Placing(req, role, candidates, candidates,
                                                    producer.host if producer is not None else None,
                                                    source.slot.nbytes if source is not None else 0, now))
                if inst is None:
                    break
                if inst is DEFER:
                    deferred.append(queue.popleft())
                    if len(deferred) >= MAX_DEFERRED:
                        break
                    continue
                queue.popleft()
                self.assign(req, inst, now, out)
                if queue and not (any_room(role) if len(queue) > 1 else buckets.get(role)):
                    self.drop_gone_heads(queue, role)  # (the one it took may have been the last with room)
                    break
            if deferred:
                queue.extendleft(reversed(deferred))

    def drop_gone_heads(self, queue, role: str) -> None:
        """Drop the entries at the head of `role`'s queue whose requests ended or moved on while waiting."""
        requests = self.requests
        while queue:
            req = requests.get(queue[0])
            if req is not None and req.state == "queued" and req.stage == role:
                return
            queue.popleft()

    def enqueue(self, req: Request, role: str, now: float, front: bool = False) -> None:
        """`req` waits for an instance of `role` (at the front: a retry already waited its turn once)."""
        req.stage, req.state, req.assigned = role, "queued", None
        mark = NAMES[role].queued
        fresh = mark not in req.marks
        req.marks[mark] = now
        self.queue.push(req, role, now, front, fresh)

    def assign(self, req: Request, inst: Instance, now: float, out: list[Out]) -> None:
        source, frames = None, []
        if req.source is not None:
            producer = self.registry.by_id.get(req.source.slot.instance_id)
            engine, warning = self.engine_for(producer, inst)
            if engine == Transfer.INLINE and not req.source_frames:
                self.release_source(req, out)
                self.fail(req, f"no transfer engine can move tensors from {producer.id} to {inst.id}: {warning}", now, out)
                return
            if warning and (producer.id, inst.id) not in self._warned_pairs:
                self._warned_pairs.add((producer.id, inst.id))
                log.warning("%s", warning)
                self.warnings.append(warning)
            inst.engine = engine
            self.stats.transferred(producer, inst, engine, req.source.slot.nbytes)
            source = msgspec.structs.replace(req.source, engine=engine)
            frames = req.source_frames if engine == Transfer.INLINE else []
        inst.alone = req.id if not inst.running else None  # a request that runs alone measures solo_s
        self.take_slot(inst, req, now)
        self.began(req, inst, now)
        if req.params.loras and not req.lora_sources:  # resumed by a restarted orchestrator
            req.lora_sources = self.lora_catalog.resolve(req.params.loras)[0]
        if req.params.loras and inst.role in AFFINITY_ROLES:
            note_assigned(inst, [r.name for r in req.params.loras])
        run = self.run_for(req, inst.role, source, now, inline_output=self.needs_inline(inst))
        if inst.peer_lane:  # the next stages' instances reserved, where they may be (disagg/orchestrator/forwards.py)
            run = self.with_forwards(req, inst, run, now)
        out.append(to_instance(inst.id, run, frames))

    def engine_for(self, producer: Instance, inst: Instance) -> tuple[str, str]:
        """The engine (and warning) for `producer`'s outputs to `inst`, chosen once per pair of registrations."""
        chosen = inst.engines_from.get(producer.id)
        if chosen is None or chosen[0] != producer.session:
            chosen = inst.engines_from[producer.id] = (producer.session, *choose_engine(
                self.config.transfer, producer.pool, inst.pool))
        return chosen[1], chosen[2]

    def take_slot(self, inst: Instance, req: Request, now: float) -> None:
        """A compute slot of `inst` taken for `req`'s attempt (finish_run gives it back)."""
        if not inst.running:
            inst.progress_at = now  # an idle instance's progress clock starts with its work
        inst.free_slots -= 1
        inst.running[req.id] = req.attempt

    def run_for(self, req: Request, role: str, source: Source | None, now: float, inline_output: bool = False) -> Run:
        """The Run of `req`'s stage of `role`, reading `source`."""
        return Run(request_id=req.id, attempt=req.attempt, params=req.params_for(role), source=source,
                   inline_output=inline_output, lora_sources=req.lora_sources,
                   stage_deadline_s=self.deadlines.stage_deadline(req, role, now) if req.slo_deadline is not None else None,
                   carry=req.cache_steps if role == "decoder" else {})

    def began(self, req: Request, inst: Instance, now: float, queued: float | None = None) -> None:
        """`req`'s stage runs on `inst` from now (its slot taken already). `queued`: it never waited in a queue,
        reserved ahead at that time (a forwarded Run)."""
        req.stage, req.state, req.assigned = inst.role, "running", inst.id
        names = NAMES[inst.role]
        marks = req.marks
        if queued is not None:
            marks[names.queued] = queued
        else:
            queued = marks.get(names.queued)
        marks[names.run] = now
        if queued is not None:  # (Request.span, written out: it runs for every stage)
            req.timings[names.queue] = micro(now - queued)

    def send_result(self, req: Request, result: Result, frames, out: list[Out]) -> None:
        for client in req.clients:
            out.append(to_client(client, result, frames))

    def finish_run(self, inst: Instance, request_id: str, attempt: int) -> Request | None:
        """Free the compute slot a report closes; the request if the report is current."""
        if inst.running.get(request_id) == attempt:
            del inst.running[request_id]
            inst.free_slots = min(inst.capacity, inst.free_slots + 1)
        req = self.requests.get(request_id)
        if req is None or req.ended or req.attempt != attempt or req.assigned != inst.id:
            return None
        return req

    def reported(self, inst, req: Request, msg, end: str, now: float) -> None:
        """A current report (Staged, Done) of `inst`'s stage of `req`, its mark `end`: the request's timings, the
        instance's stage time and the role's predictor."""
        names = NAMES[inst.role]
        inst.completed += 1
        marks, timings = req.marks, req.timings
        marks[end] = now
        started = marks.get(names.run)
        if started is not None:  # (Request.span, written out)
            timings[names.stage] = micro(now - started)
        timings[names.compute] = msg.compute_s
        if msg.lora_s:
            timings[names.lora] = msg.lora_s
        inst.record_stage_time(msg.compute_s + timings.get(names.fetch, 0.0), msg.device_s, req.id)
        self.deadlines.predictor.record(inst.role, req.params, msg.device_s if msg.device_s is not None else msg.compute_s,
                                        inst.speed)

    def is_source(self, request_id: str, instance_id: str, offset: int) -> bool:
        """Whether that staged output is what its request reads next."""
        req = self.requests.get(request_id)
        slot = req.source.slot if req is not None and req.source is not None else None
        return slot is not None and slot.instance_id == instance_id and slot.offset == offset

    def release_source(self, req: Request, out: list[Out]) -> None:
        if req.source is None:
            return
        slot = req.source.slot
        producer = self.registry.by_id.get(slot.instance_id)
        if producer is not None and producer.staged.pop(slot.offset, None) is not None:
            out.append(to_instance(producer.id, Release(request_id=req.id, offset=slot.offset)))
        req.source, req.source_frames = None, []

    def fail(self, req: Request, error: str, now: float, out: list[Out], stopping: bool = False,
             state: str = "failed", code: ErrorCode = ErrorCode.GENERATION_FAILED, param: str | None = None) -> None:
        log.log(logging.INFO if state == "invalid" else logging.WARNING, "request %s failed: %s", req.id, error)
        req.timings["total"] = micro(now - req.submitted_at)
        result = Result(request_id=req.id, ok=False, error=error, seed=req.params.seed, attempts=req.attempt,
                        timings=req.timings, stopping=stopping, code=code, param=param)
        self.end(req, state, now, out)
        self.send_result(req, result, (), out)

    def end(self, req: Request, state: str, now: float, out: list[Out]) -> None:
        if req.state == "queued":  # its id stays in the queue until dispatch meets it
            self.queue.ended(req)
        req.state = state
        self.deadlines.ended(req, state, now)
        del self.requests[req.id]
        for ended in self.listeners.ended:
            ended(req, state, now)
        self.stats.record(state, now, req.timings)
        if req.reserved:  # its forwards are taken back (disagg/orchestrator/forwards.py)
            self.withdraw(req, out, now=now)

    def expire_requests(self, now: float, out: list[Out]) -> None:
        """Requests past their deadline (timeouts.request, or the Submit's own) fail now, as timed out."""
        for req in [r for r in self.requests.values() if now > r.deadline]:
            limit = req.deadline - req.submitted_at
            self.release_source(req, out)
            # a compute slot held for it stays taken until its instance reports back or dies
            self.fail(req, f"timed out after {limit:.1f} s in stage {req.stage} ({req.state})", now, out,
                      code=ErrorCode.TIMEOUT)

    def retry(self, req: Request, cause: str, now: float, out: list[Out], source_lost: bool = False) -> None:
        """A new attempt from the last stage whose input still exists, else from the encoder. `source_lost`: its
        input could not be read (Failed.source_lost): its producer may be gone before its heartbeats stop, and an
        attempt reading it again would fail alike, so it starts over."""
        if req.attempt > self.config.max_retries:
            self.release_source(req, out)
            self.fail(req, f"gave up after {req.attempt} attempts; last: {cause}", now, out)
            return
        req.attempt += 1
        log.info("request %s: attempt %d (%s)", req.id, req.attempt, cause)
        if req.reserved:  # what was reserved for the last attempt is taken back (disagg/orchestrator/forwards.py)
            self.withdraw(req, out, now=now)
        producer = self.registry.get(req.source.slot.instance_id) if req.source else None
        stage = req.stage if producer is not None and producer.state != "dead" and not source_lost else self.first_stage
        if stage == self.first_stage:
            self.release_source(req, out)
        self.enqueue(req, stage, now, front=True)
