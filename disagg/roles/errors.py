"""Errors a request, not the instance, is at fault for (torch-free)."""

from __future__ import annotations


class RequestError(ValueError):
    """The request asks what this model cannot do (an input it cannot take, a format, a size): it fails with
    the reason, as a client error. The instance is not at fault: it is not counted as failing, and its log
    gets one line, not a traceback. `param`: the request field at fault, when one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
