"""The exceptions the clients raise for a request or command that did not succeed: one class per family of
transport.codes.ErrorCode, so a caller tells "try again later" from "fix the request" from "it failed"."""

from __future__ import annotations

from disagg.transport.wire.codes import CLIENT_FAULT, RETRY_LATER, ErrorCode


class RequestFailed(RuntimeError):
    """Did not succeed; `code` (an ErrorCode, or None for an old peer), `param` (the field at fault, if one)."""

    def __init__(self, message: str, code: ErrorCode | None = None, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


class RetryLater(RequestFailed):
    """Nothing ran, and the same request may succeed later: overloaded, not ready, draining, unreachable."""


class BadRequest(RequestFailed):
    """The request is at fault: over the model's limits, an input it cannot take, a reused request id."""


class GenerationFailed(RequestFailed):
    """It ran and failed (after its retries), timed out or was cancelled."""


def error_for(message: str, code: ErrorCode | None, param: str | None = None) -> RequestFailed:
    cls = RetryLater if code in RETRY_LATER else BadRequest if code in CLIENT_FAULT else GenerationFailed
    return cls(message, code, param)
