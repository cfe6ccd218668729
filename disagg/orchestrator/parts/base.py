"""What the Router composes beside its state machine (disagg/orchestrator/router.py): parts with state of their own
(previews, rebalance, recovery, and the placement steps) that hear the request events they need through one narrow
interface, `Part`, and reach the Router only through the `Core` they are built with.

A new part is a class of its own: it overrides the events it needs, names the messages it handles (`messages`), and
is listed where its kind is (PARTS below, or placement's STEPS). The Router's state machine does not change.
"""

from __future__ import annotations

from typing import Protocol


class Core(Protocol):
    """What a part may use of the Router: its settings and state (read), and these few steps."""

    config: object
    registry: object
    requests: dict
    deadlines: object
    stats: object
    recovery: object
    previews: object
    warnings: object
    stopping: bool
    draining: bool

    def finish_run(self, inst, request_id: str, attempt: int): ...

    def instances_changed(self) -> None:
        """An instance's state changed (what depends on which instances serve is computed again)."""

    def recovering(self, now: float) -> bool:
        """Whether roles are still telling a restarted orchestrator what they hold."""


class Part:
    """A part of the Router. Every event is a no-op here; a part overrides those it needs."""

    #: message type -> the name of this part's method that handles it, called as (identity or sender, msg,
    #: frames, now, out) like the Router's own handlers
    messages: dict[type, str] = {}

    def submitted(self, req, now: float) -> None:
        """A request was admitted."""

    def staged(self, inst, req, msg, now: float) -> None:
        """`inst` staged `req`'s output of its stage (Staged), which the Router accepted."""

    def done(self, inst, req, msg, now: float) -> None:
        """`inst` finished `req` (Done), which the Router accepted."""

    def claims(self, inst, msg, frames, now: float, out: list) -> bool:
        """A Done or Failed the Router got: True when it ends a run of this part's own (the Router stops there)."""
        return False

    def ended(self, req, state: str, now: float) -> None:
        """`req` ended (done, failed, cancelled, invalid, ...)."""

    def tick(self, now: float, out: list) -> None:
        """The Router's periodic tick."""

    def status(self, now: float, report) -> None:
        """Fill this part's section of the StatusReport being built."""


class Listeners:
    """Per event, the parts' methods that handle it: only those a part overrides, so an event no part hears costs
    nothing (the Router calls these on every message)."""

    EVENTS = ("submitted", "staged", "done", "claims", "ended", "tick", "status")

    def __init__(self, parts: list[Part]):
        for event in self.EVENTS:
            setattr(self, event, [getattr(p, event) for p in parts
                                  if getattr(type(p), event) is not getattr(Part, event)])
