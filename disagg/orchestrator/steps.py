"""The Router's request state machine steps: a run's report closing its slot, a source released, a request
failed, ended or given a new attempt, its Result sent. A mixin of Router (disagg/orchestrator/router.py): it works on
the Router's requests, registry and queues."""

from __future__ import annotations

import logging

from disagg.orchestrator.outbox import Out, to_client, to_instance
from disagg.orchestrator.registry import Instance
from disagg.orchestrator.requests import Request
from disagg.transport.messages import ErrorCode, Release, Result

log = logging.getLogger("disagg.orchestrator")


class RequestSteps:
    """Methods of Router; see disagg/orchestrator/router.py for the state they use."""

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

    def is_source(self, request_id: str, instance_id: str, offset: int) -> bool:
        """Whether that staged output is what its request reads next."""
        req = self.requests.get(request_id)
        slot = req.source.slot if req is not None and req.source is not None else None
        return slot is not None and slot.instance_id == instance_id and slot.offset == offset

    def release_source(self, req: Request, out: list[Out]) -> None:
        if req.source is None:
            return
        slot = req.source.slot
        producer = self.registry.get(slot.instance_id)
        if producer is not None and producer.staged.pop(slot.offset, None) is not None:
            out.append(to_instance(producer.id, Release(request_id=req.id, offset=slot.offset)))
        req.source, req.source_frames = None, []

    def fail(self, req: Request, error: str, now: float, out: list[Out], stopping: bool = False,
             state: str = "failed", code: ErrorCode = ErrorCode.GENERATION_FAILED, param: str | None = None) -> None:
        log.log(logging.INFO if state == "invalid" else logging.WARNING, "request %s failed: %s", req.id, error)
        req.timings["total"] = round(now - req.submitted_at, 6)
        result = Result(request_id=req.id, ok=False, error=error, seed=req.params.seed, attempts=req.attempt,
                        timings=req.timings, stopping=stopping, code=code, param=param)
        self.end(req, state, now)
        self.send_result(req, result, (), out)

    def end(self, req: Request, state: str, now: float) -> None:
        if req.state == "queued":  # its id stays in the queue until dispatch meets it: the queue's order may change
            self.queue_order.forget(req.stage)
        req.state = state
        self.note_slo_end(req, state, now)
        del self.requests[req.id]
        self.recovery.ended_request(req.id)
        self.stats.record(state, now, req.timings)

    def retry(self, req: Request, cause: str, now: float, out: list[Out]) -> None:
        """A new attempt from the last stage whose input still exists, else from the encoder."""
        if req.attempt > self.config.max_retries:
            self.release_source(req, out)
            self.fail(req, f"gave up after {req.attempt} attempts; last: {cause}", now, out)
            return
        req.attempt += 1
        log.info("request %s: attempt %d (%s)", req.id, req.attempt, cause)
        producer = self.registry.get(req.source.slot.instance_id) if req.source else None
        stage = req.stage if producer is not None and producer.state != "dead" else self.first_stage
        if stage == self.first_stage:
            self.release_source(req, out)
        self.enqueue(req, stage, now, front=True)
