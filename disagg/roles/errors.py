"""The errors a role's compute raises, by who is at fault (torch-free): StageRunner.execute (compute.py) reports
each by its type, never by its name or text.

    RequestError (and subclasses)   the request: invalid_input, with the field at fault; not retried
    GroupBroken                     the instance (its ranks lost each other): it reports itself Dead and exits
    compute.Cancelled               its client gave it up: cancelled
    transport's TransferError, a transient PoolFull    a peer or a moment: retried elsewhere
    anything else                   the model: generation_failed, with a traceback in the log
"""

from __future__ import annotations


class RequestError(ValueError):
    """The request asks what this model cannot do (an input it cannot take, a format, a size): it fails with
    the reason, as a client error. The instance is not at fault: it is not counted as failing, and its log
    gets one line, not a traceback. `param`: the request field at fault, when one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class GroupBroken(RuntimeError):
    """A collective of a parallel instance's ranks failed (disagg/roles/parallel.py): a rank died or hung. The
    instance cannot serve; its work goes elsewhere."""
