"""Parallel layouts of an instance (torch-free: the launcher checks them, roles report them)."""

from __future__ import annotations

from disagg.settings.schema import PARALLEL_KINDS as KINDS  # noqa: F401 - the kinds of parallelism, in mesh order
from disagg.settings.schema import world_of  # noqa: F401 - roles and the launcher import it from here


def describe_layout(layout: dict[str, int]) -> str:
    """'cfg 2 x ulysses 2' (kinds of degree 1 left out); '' for one device."""
    return " x ".join(f"{k} {layout[k]}" for k in KINDS if layout.get(k, 1) > 1)
