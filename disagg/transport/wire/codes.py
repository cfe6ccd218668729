"""Why a request was refused or failed, as a machine code: `Rejected.code`, `Failed.code` and `Result.code`.

The text beside it (`reason`, `error`) is for people; programs look at the code. Clients raise one exception
class per family (disagg/client/errors.py); the gateway maps each code to an HTTP status and to the OpenAI error's
`code` (disagg/gateway/errors.py), and parses no text.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    # --- refused at Submit: nothing ran; the same request may succeed later (retryable) ---------------------
    #: a role's queue is full (max_queue)
    OVERLOADED = "overloaded"
    #: a role has had no instance for join_wait (none joined yet, or every one stopped)
    NOT_READY = "not_ready"
    #: the deployment is draining or stopping
    UNAVAILABLE = "unavailable"
    #: `admission: slo`: its deadline (slo_ms) cannot be met even if it ran at once, by the measured stage times
    DEADLINE = "deadline_unmeetable"
    # --- the request is at fault: sending it again as it is fails again -------------------------------------
    #: larger than what the deployment's model makes (`param`: width, height or num_frames)
    OVER_LIMIT = "over_limit"
    #: an X-Request-Id / request_id already in flight with other parameters
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    #: an input or format the model cannot take, or tensors too large for a pool (`param`: the field)
    INVALID_INPUT = "invalid_input"
    #: any other message the orchestrator will not take (bad message, another orchestrator's id, no such host)
    INVALID_REQUEST = "invalid_request"
    # --- failed while it ran -----------------------------------------------------------------------------
    #: timeouts.request (or the Submit's own) ran out
    TIMEOUT = "timeout"
    #: cancelled by its client
    CANCELLED = "cancelled"
    #: a stage failed, and again on every new attempt (max_retries), or no engine can move its tensors
    GENERATION_FAILED = "generation_failed"
    # --- roles, at Register -------------------------------------------------------------------------------
    #: a role of another deployment (its launcher's run id)
    FOREIGN_DEPLOYMENT = "foreign_deployment"
    #: a role serving another model than the deployment's
    FOREIGN_MODEL = "foreign_model"
    #: a role the orchestrator does not know (or declared dead): it registers again
    NOT_REGISTERED = "not_registered"
    # --- set by clients, never sent -----------------------------------------------------------------------
    #: no orchestrator answered (or it went silent with the request in flight)
    UNREACHABLE = "unreachable"


#: codes under which the same request may succeed if sent again later
RETRY_LATER = frozenset({ErrorCode.OVERLOADED, ErrorCode.DEADLINE, ErrorCode.NOT_READY, ErrorCode.UNAVAILABLE, ErrorCode.UNREACHABLE})
#: codes that blame the request, not the deployment
CLIENT_FAULT = frozenset({ErrorCode.OVER_LIMIT, ErrorCode.DUPLICATE_REQUEST_ID, ErrorCode.INVALID_INPUT,
                          ErrorCode.INVALID_REQUEST})
