"""Errors the way OpenAI clients expect them: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from transport.messages import NOT_READY

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """A request the gateway answers with an error status and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def from_outcome_error(error: str) -> ApiError:
    """The HTTP error for a request the deployment refused or could not finish."""
    if error.startswith("refused: "):
        reason = error[len("refused: "):]
        if reason.startswith("overloaded"):
            return ApiError(429, reason, code="overloaded", headers={"Retry-After": "1"})
        if reason.startswith(NOT_READY):  # a role has no instance: none joined yet, or all were stopped
            return ApiError(503, reason, code="not_ready", headers={"Retry-After": "5"})
        if reason.startswith(("draining", "shutting down")):
            return ApiError(503, reason, code="unavailable", headers={"Retry-After": "5"})
        if " is over this deployment's maximum" in reason:  # "width 8192 is over ..."
            return ApiError(400, reason, param=reason.split(" ", 1)[0], code="invalid_value")
        if reason.startswith("duplicate request_id"):
            return ApiError(409, reason, param="X-Request-Id", code="duplicate_request_id")
        return ApiError(400, reason, code="invalid_request")
    if "RequestTooLarge" in error or "FormatError" in error:  # the request, not the deployment, is at fault
        return ApiError(400, error, code="invalid_value")
    if "InputError: " in error:  # an input the model cannot take: "encoder encoder-0 failed: InputError: mask: ..."
        reason = error[error.index("InputError: ") + len("InputError: "):]
        field = reason.split(":", 1)[0]
        return ApiError(400, reason, param=field if field in ("image", "mask", "strength") else None, code="invalid_value")
    if error.startswith("cannot reach the orchestrator"):
        return ApiError(503, error, code="orchestrator_unreachable", headers={"Retry-After": "5"})
    if "the deployment is stopping" in error:
        return ApiError(503, error, code="unavailable", headers={"Retry-After": "5"})
    # failed after its retries: resending it as is would fail again
    return ApiError(500, error, code="generation_failed", headers={"x-should-retry": "false"})
