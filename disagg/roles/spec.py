"""What the launcher tells one role process: its settings.process.RoleSettings, as JSON on its command line."""

from __future__ import annotations

from disagg.settings.process import RoleSettings as WorkerSpec
from disagg.settings.process import decode


def spec_from_json(data: str) -> WorkerSpec:
    """A role's settings; an unknown or mistyped key raises msgspec.ValidationError."""
    return decode(data, WorkerSpec)
