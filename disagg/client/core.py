"""The state of a client's requests, without I/O: what was submitted, resumed after an orchestrator restart,
cancelled and answered. The blocking client (disagg/client/sync.py) and the asyncio one (disagg/client/aio.py) feed it what
they receive and the time, and send what it returns, so the two cannot drift apart.

    book = RequestBook(endpoint)
    msg = book.submit(rid, params, timeout_s, now)        # a Submit to send, or None (already pending: joins it)
    ended, to_send = book.on_reply(reply, frames, now)    # Outcomes that ended; messages to send (resubmits)
    ended, to_send = book.tick(now)                       # every turn: requests lost to silence; a probe
    book.on_disconnect()                                  # the connection dropped: probe soon
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.transport.wire.messages import (
    ErrorCode,
    GenerationParams,
    MessageError,
    Partial,
    Rejected,
    Result,
    StatusQuery,
    StatusReport,
    Submit,
)

#: while requests are pending and nothing arrives, ask for status this often (who answers: a restart changes it)...
PROBE_INTERVAL_S = 2.0
#: ...and this often once the connection to the orchestrator dropped, until one answers (it restarted:
#: the pending requests then go to it again under the same ids, Submit.resume)
SUSPECT_PROBE_S = 0.2
#: ...and give the pending requests up when nothing at all arrived for this long
ORCHESTRATOR_SILENCE_S = 15.0


@dataclass
class Outcome:
    """How one submitted request ended, with its images."""

    request_id: str
    params: GenerationParams
    ok: bool
    error: str | None = None
    images: list[bytes] = field(default_factory=list)
    image_format: str = "png"
    seed: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    latency_s: float = 0.0
    attempts: int = 1
    #: the parameters the model ran with, its defaults filled in (Result.resolved)
    resolved: dict = field(default_factory=dict)
    #: why it did not succeed, for programs (disagg/transport/wire/codes.py), and the request field at fault
    code: ErrorCode | None = None
    param: str | None = None

    def raise_for_error(self) -> "Outcome":
        """This outcome if it succeeded; else raise the exception of its code's family (disagg/client/errors.py)."""
        if not self.ok:
            from disagg.client.errors import error_for

            raise error_for(self.error or "failed", self.code, self.param)
        return self


def outcome_of(rid: str, params: GenerationParams, reply, frames: list, latency_s: float) -> Outcome:
    """The Outcome of a request from the orchestrator's answer to it: a Result, or a Rejected at Submit."""
    if isinstance(reply, Result):
        return Outcome(rid, params, reply.ok, reply.error, list(frames), reply.image_format, reply.seed, reply.timings,
                       latency_s, reply.attempts, dict(reply.resolved), reply.code, reply.param)
    return Outcome(rid, params, False, f"refused: {reply.reason}", latency_s=latency_s, code=reply.code,
                   param=reply.param)


@dataclass
class Pending:
    params: GenerationParams
    sent_at: float
    timeout_s: float | None = None


class RequestBook:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.pending: dict[str, Pending] = {}
        #: the orchestrator that holds our requests ("" until its first StatusReport)
        self.orchestrator_id = ""
        self.last_heard = 0.0
        self.last_probe = 0.0
        #: the connection dropped: probe often until an orchestrator answers
        self.suspect = False
        #: the deployment said it is stopping or draining: send it nothing more
        self.stopping = ""

    # --- what the caller does ---------------------------------------------------------------------------

    def submit(self, rid: str, params: GenerationParams, timeout_s: float | None, now: float):
        """The Submit to send; None when `rid` is pending already with these parameters (the caller waits for
        that run); an ended Outcome when it is pending with other ones (as the orchestrator would refuse it)."""
        known = self.pending.get(rid)
        if known is not None:
            if known.params == params:
                return None
            return Outcome(rid, params, False, "refused: duplicate request_id with other parameters",
                           code=ErrorCode.DUPLICATE_REQUEST_ID, param="request_id")
        if not self.pending:  # silence counts from here: an idle client hears nothing, and that is fine
            self.last_heard = now
        self.pending[rid] = Pending(params, now, timeout_s)
        return Submit(request_id=rid, params=params, timeout_s=timeout_s)

    def give_up(self, rid: str, why: str, code: ErrorCode, now: float) -> Outcome | None:
        """End a pending request here (cancelled by its caller, or never sent): its Outcome, None if not pending."""
        entry = self.pending.pop(rid, None)
        if entry is None:
            return None
        return Outcome(rid, entry.params, False, why, latency_s=now - entry.sent_at, code=code)

    def lose_all(self, why: str, code: ErrorCode, now: float) -> list[Outcome]:
        return [o for rid in list(self.pending) if (o := self.give_up(rid, why, code, now)) is not None]

    # --- what the caller heard --------------------------------------------------------------------------

    def on_disconnect(self) -> None:
        self.suspect = True

    def on_reply(self, reply, frames: list, now: float) -> tuple[list[Outcome], list]:
        """A reply from the orchestrator: the Outcomes it ended, and what to send (resubmits to a successor)."""
        self.last_heard = now
        if isinstance(reply, MessageError):
            return [], []
        if isinstance(reply, StatusReport):
            self.suspect = False
            oid = str(reply.orchestrator.get("id", ""))
            resend = []
            if self.orchestrator_id and oid != self.orchestrator_id:
                # a successor: it knows our requests only from us (and what the roles still hold)
                resend = [Submit(request_id=rid, params=p.params, timeout_s=p.timeout_s, resume=True,
                                 age_s=round(max(now - p.sent_at, 0.0), 6))
                          for rid, p in self.pending.items()]
            self.orchestrator_id = oid
            return [], resend
        if isinstance(reply, Partial):  # a live preview: the request goes on (the shells hand it to their caller)
            return [], []
        rid = getattr(reply, "request_id", None)
        if isinstance(reply, Rejected) and rid is None:
            # the orchestrator could not read what we sent at all (e.g. a version without a field we sent):
            # nothing pending will be answered, so each ends with its reason
            return self.lose_all(f"refused by the orchestrator: {reply.reason}", reply.code, now), []
        entry = self.pending.pop(rid, None) if rid else None
        if entry is None or not isinstance(reply, (Result, Rejected)):
            return [], []
        if (isinstance(reply, Result) and reply.stopping) or (
                isinstance(reply, Rejected) and reply.code == ErrorCode.UNAVAILABLE):
            self.stopping = reply.reason.split(":")[0] if isinstance(reply, Rejected) else "stopping"
        return [outcome_of(rid, entry.params, reply, frames, now - entry.sent_at)], []

    def tick(self, now: float) -> tuple[list[Outcome], list]:
        """Nothing heard lately: requests lost to an orchestrator silent too long, or a StatusQuery to ask who
        answers now (after a dropped connection, or a quiet second with requests in flight)."""
        if not self.pending:
            return [], []
        if now - self.last_heard > ORCHESTRATOR_SILENCE_S:
            return self.lose_all(f"the orchestrator at {self.endpoint} stopped answering; request lost",
                                 ErrorCode.UNREACHABLE, now), []
        every = SUSPECT_PROBE_S if self.suspect else PROBE_INTERVAL_S
        if now - self.last_probe > every and (self.suspect or now - self.last_heard > PROBE_INTERVAL_S):
            self.last_probe = now
            return [], [StatusQuery()]
        return [], []
