"""Parallel layouts of an instance (torch-free: the launcher checks them, roles report them)."""

from __future__ import annotations

from settings.schema import PARALLEL_KINDS as KINDS  # the kinds one instance may span devices with, in mesh order


def describe_layout(layout: dict[str, int]) -> str:
    """'cfg 2 x ulysses 2' (kinds of degree 1 left out); '' for one device."""
    return " x ".join(f"{k} {layout[k]}" for k in KINDS if layout.get(k, 1) > 1)


def world_of(layout: dict[str, int]) -> int:
    n = 1
    for k in KINDS:
        n *= layout.get(k, 1)
    return n
