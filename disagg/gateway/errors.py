"""Errors the way OpenAI clients expect them: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from disagg.transport.wire.codes import ErrorCode

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


#: ErrorCode -> (HTTP status, the OpenAI error's `code`, headers); a code not here is a 500
HTTP = {
    ErrorCode.OVERLOADED: (429, "overloaded", {"Retry-After": "1"}),
    ErrorCode.DEADLINE: (429, "deadline_unmeetable", {"Retry-After": "1"}),
    ErrorCode.NOT_READY: (503, "not_ready", {"Retry-After": "5"}),
    ErrorCode.UNAVAILABLE: (503, "unavailable", {"Retry-After": "5"}),
    ErrorCode.UNREACHABLE: (503, "orchestrator_unreachable", {"Retry-After": "5"}),
    ErrorCode.OVER_LIMIT: (400, "invalid_value", {}),
    ErrorCode.INVALID_INPUT: (400, "invalid_value", {}),
    ErrorCode.DUPLICATE_REQUEST_ID: (409, "duplicate_request_id", {}),
    ErrorCode.INVALID_REQUEST: (400, "invalid_request", {}),
    # someone else cancelled it (DELETE of a video job; an HTTP caller's hang-up cancels only a run nobody else
    # of its key waits on): not a generation that failed
    ErrorCode.CANCELLED: (409, "cancelled", {"x-should-retry": "false"}),
}
#: the request's field as the HTTP API names it
HTTP_PARAM = {"request_id": "X-Request-Id"}


#: an absolute path of two or more parts (not inside a URL or a relative path): what without_paths shortens
_ABS_PATH = re.compile(r"(?<![\w.~:/-])/(?:[^\s/'\"`:,;()\[\]{}<>]+/)+[^\s/'\"`:,;()\[\]{}<>]*")


def without_paths(text: str) -> str:
    """`text` with each absolute server path shortened to its last part ("/srv/loras/a.safetensors" ->
    "a.safetensors"): the deployment's messages (a LoRA that cannot be read, a checkpoint's folder) name files on
    the server, which are none of an HTTP client's business."""
    return _ABS_PATH.sub(lambda m: m.group(0).rstrip("/").rsplit("/", 1)[-1], text)


def from_outcome(outcome) -> ApiError:
    """The HTTP error for a request the deployment refused or could not finish, from its code (no text parsed),
    with no server paths in its message."""
    message = without_paths(outcome.error or "failed")
    message = message.removeprefix("refused: ")
    status, code, headers = HTTP.get(outcome.code, (500, "generation_failed", {"x-should-retry": "false"}))
    if outcome.code == ErrorCode.INVALID_INPUT and ": " in message:  # "encoder encoder-0 failed: InputError: mask: ..."
        message = message.split("Error: ", 1)[-1]
    return ApiError(status, message, param=HTTP_PARAM.get(outcome.param, outcome.param), code=code, headers=dict(headers))
