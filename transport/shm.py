"""Names and clean-up of shared-memory segments (torch-free, for the launcher)."""

from __future__ import annotations

import os

SHM_DIR = "/dev/shm"
SHM_PREFIX = "disagg-"


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def list_segments(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def remove_segments(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with `prefix` (left by killed processes)."""
    removed = []
    for name in list_segments(prefix):
        try:
            os.unlink(shm_path(name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed
