"""The moving average every measured time is kept as (stage, step, load and restore times, in the orchestrator
and the roles alike): one weight, written once."""

from __future__ import annotations

#: the newest measurement's weight
NEW_WEIGHT = 0.2


def ewma(old: float | None, new: float) -> float:
    """`old` moved towards `new` by NEW_WEIGHT; `new` itself when there is no `old` yet (None)."""
    return new if old is None else (1 - NEW_WEIGHT) * old + NEW_WEIGHT * new
