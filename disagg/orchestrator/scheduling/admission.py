"""Admission, beside the queue: whether a Submit may wait in the queues at all. A full queue refuses it, or (a
queue that sheds, `schedule: slo`) sheds a queued request of lower priority for it; `admission: slo` also refuses a
deadline it cannot meet even if it ran at once (CHECKS)."""

from __future__ import annotations

from disagg.orchestrator.outbox import to_client
from disagg.settings.choices import Admission as AdmissionMode
from disagg.transport.wire.messages import ErrorCode, Rejected


def deadline_check(admission, params) -> tuple[str, str]:
    """admission slo: (why, field) when the request's deadline is unmeetable."""
    why = admission.deadlines.unmeetable(params, admission.first_stage)
    return (why, "slo_ms") if why else ("", "")


#: the `admission` setting -> the checks a request passes after the queue's room
CHECKS = {AdmissionMode.OFF: (), AdmissionMode.SLO: (deadline_check,)}


class Admission:
    def __init__(self, config, queue, deadlines, first_stage: str, fail):
        self.config = config
        self.queue = queue
        self.deadlines = deadlines
        self.first_stage = first_stage
        #: the Router's `fail` (a shed request ends with its Result)
        self.fail = fail
        self.checks = CHECKS[AdmissionMode(config.admission)]

    def admit(self, identity, msg, now: float, out) -> bool:
        """False: refused, and told so."""
        limit = self.config.max_queue
        self.queue.arriving(msg.params)
        for role, queue in self.queue.by_role.items():
            if len(queue) < limit:
                continue
            shed = self.queue.shed_for(msg.params)
            if shed is not None:
                self.fail(shed, f"shed: the {role} queue is full (max_queue {limit}) and a request of priority "
                          f"{msg.params.priority} came; retry later", now, out, code=ErrorCode.OVERLOADED)
                continue
            reason = f"overloaded: the {role} queue holds {len(queue)} requests (max_queue {limit}); retry later"
            out.append(to_client(identity, Rejected(request_id=msg.request_id, reason=reason,
                                                    code=ErrorCode.OVERLOADED)))
            return False
        for check in self.checks:
            why, field = check(self, msg.params)
            if why:
                out.append(to_client(identity, Rejected(request_id=msg.request_id, reason=why, param=field,
                                                        code=ErrorCode.DEADLINE)))
                return False
        return True
