"""The default run folders ($TMPDIR/disagg/RUN_ID: a deployment's logs and run files): old ones go when a launch
starts."""

from __future__ import annotations

import time
from pathlib import Path

#: default run folders ($TMPDIR/disagg/RUN_ID) kept: older ones go when a launch starts
KEEP_RUNS = 20
#: ...but never one whose logs were written this recently (a deployment still running)
RUN_IDLE_S = 3600.0


def prune_runs(parent: Path, keep: int = KEEP_RUNS) -> list[Path]:
    """Remove all but the `keep` newest run folders under `parent` (their logs), leaving any written to within
    RUN_IDLE_S; the folders removed."""
    import re
    import shutil

    def last_write(run: Path) -> float:
        return max([run.stat().st_mtime, *(f.stat().st_mtime for f in (run / "logs").glob("*"))], default=0.0)

    try:
        runs = sorted(((last_write(d), d) for d in parent.iterdir() if d.is_dir() and re.fullmatch(r"[0-9a-f]{8}", d.name)),
                      reverse=True)
    except OSError:
        return []
    removed = []
    for when, run in runs[keep:]:
        if time.time() - when > RUN_IDLE_S:
            shutil.rmtree(run, ignore_errors=True)
            removed.append(run)
    return removed
