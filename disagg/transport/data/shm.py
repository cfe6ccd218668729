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


def remove_segments(prefix: str, only_dead: bool = False) -> list[str]:
    """Unlink every segment whose name starts with `prefix` (left by killed processes); with
    `only_dead`, only those whose owner (the pid that ends a pool's name) has exited."""
    removed = []
    for name in list_segments(prefix):
        pid = name.rsplit("-", 1)[-1]
        if only_dead and (not pid.isdigit() or pid_alive(int(pid))):
            continue
        try:
            os.unlink(shm_path(name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has exited; it only waits for its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False
