"""The Router's handlers of a stage's reports: Staged, Fetched (or folded into Staged / Done), Done, Failed. A mixin of
Router (disagg/orchestrator/router.py), beside its request steps (steps.py), instance lifecycle (instances.py) and
forwards (forwards.py): they close the stage's run, record it, and move its request on (the next stage's queue, its
Result, a retry)."""

from __future__ import annotations

from disagg.orchestrator.outbox import to_instance
from disagg.orchestrator.requests import NAMES, micro, next_stage
from disagg.transport.wire.messages import (
    Done,
    ErrorCode,
    Failed,
    Fetched,
    Release,
    Result,
    Source,
    Staged,
    cache_report,
)


class StageReports:
    """Methods of Router; see disagg/orchestrator/router.py for the state they use."""

    def handle_staged(self, sender, msg: Staged, frames, now, out) -> None:
        if msg.fetch_s is not None:  # a role with short computes reports its pull in its report (no Fetched)
            self.fetched(sender, msg.request_id, msg.attempt, msg.fetch_s, now, out)
        inst = self.registry.by_id[sender]  # (handle_instance found it)
        inst.staged[msg.slot.offset] = msg.slot.nbytes
        inst.largest_output = max(inst.largest_output, msg.slot.nbytes)
        req = self.finish_run(inst, msg.request_id, msg.attempt)
        if req is None:
            if self.is_source(msg.request_id, inst.id, msg.slot.offset):
                return  # a late copy of the report a resumed request already reads from (disagg/orchestrator/parts/recovery.py)
            if not self.recovery.keep_output(inst, msg, frames, now):
                out.append(to_instance(inst.id, Release(request_id=msg.request_id, offset=msg.slot.offset)))
                inst.staged.pop(msg.slot.offset, None)
            return
        self.release_source(req, out)  # its input, in case the Fetched was lost (an orchestrator restart)
        role = inst.role
        self.reported(inst, req, msg, NAMES[role].staged, now)
        for staged in self.listeners.staged:
            staged(inst, req, msg, now)
        if msg.steps_computed is not None:  # a step cache's: the Result's resolved parameters report them
            req.cache_steps = cache_report(msg)
        req.source = Source(slot=msg.slot, pool=inst.pool, engine="")
        req.source_frames = list(frames)
        if req.reserved and self.forwarded(req, inst, msg, now, out):
            return  # it sent the next stage's Run on itself (disagg/orchestrator/forwards.py)
        self.enqueue(req, next_stage(role), now)

    def handle_fetched(self, sender, msg: Fetched, frames, now, out) -> None:
        self.fetched(sender, msg.request_id, msg.attempt, msg.fetch_s, now, out)

    def fetched(self, sender: str, request_id: str, attempt: int, fetch_s: float | None, now, out) -> None:
        """`sender` pulled the input of `request_id`'s `attempt` in `fetch_s` (a Fetched, or folded into a report)."""
        req = self.requests.get(request_id)
        if req is None or req.attempt != attempt or req.assigned != sender:
            return
        inst = self.registry.by_id[sender]
        names = NAMES[inst.role]
        req.timings[names.fetch] = fetch_s
        # learnt from inputs that did fit: one that cannot must not block the instance for good
        inst.largest_input = max(inst.largest_input, req.source.slot.nbytes if req.source else 0)
        # the whole hop: producer's Staged in, Run out, pull, consumer's Fetched in
        staged_at = req.marks.get(names.previous_staged) if names.previous_staged else None
        if staged_at is not None:
            req.timings[names.handoff] = micro(now - staged_at)
        self.release_source(req, out)

    def handle_done(self, sender, msg: Done, frames, now, out) -> None:
        inst = self.registry.by_id[sender]
        if self.claimed(inst, msg, frames, now, out):
            return
        if msg.fetch_s is not None:  # a role with short computes reports its pull in its report (no Fetched)
            self.fetched(sender, msg.request_id, msg.attempt, msg.fetch_s, now, out)
        req = self.finish_run(inst, msg.request_id, msg.attempt)
        if req is None:
            self.recovery.keep_output(inst, msg, frames, now)  # its client may send it again (a restart)
            return
        self.release_source(req, out)
        self.reported(inst, req, msg, "done", now)
        for done in self.listeners.done:
            done(inst, req, msg, now)
        req.timings["total"] = micro(now - req.submitted_at)
        result = Result(
            request_id=req.id,
            ok=True,
            image_format=msg.image_format,
            num_images=msg.num_images,
            seed=req.params.seed,
            attempts=req.attempt,
            timings=req.timings,
            resolved={**msg.resolved, **req.cache_steps},
        )
        self.end(req, "done", now, out)
        self.send_result(req, result, frames, out)

    def handle_failed(self, sender, msg: Failed, frames, now, out) -> None:
        inst = self.registry.by_id[sender]
        if self.claimed(inst, msg, frames, now, out):
            return
        req = self.finish_run(inst, msg.request_id, msg.attempt)
        if req is None:
            return
        cause = f"{inst.role} {inst.id} failed: {msg.error}"
        if msg.code == ErrorCode.INVALID_INPUT:  # the request's fault: a client error, not the instance's failure
            self.release_source(req, out)
            self.fail(req, cause, now, out, state="invalid", code=msg.code, param=msg.param)
            return
        inst.failed += 1
        if msg.retryable:
            self.retry(req, cause, now, out, source_lost=msg.source_lost)
        else:
            self.release_source(req, out)
            self.fail(req, cause, now, out)

    def claimed(self, inst, msg: Done | Failed, frames, now, out) -> bool:
        """Whether a part ran what `msg` ends (a preview's decode) and took it."""
        for claims in self.listeners.claims:
            if claims(inst, msg, frames, now, out):
                return True
        return False
