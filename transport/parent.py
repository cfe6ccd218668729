"""Whether the launcher that started this process is still there.

The launcher puts its pid in DISAGG_LAUNCHER_PID for every process it starts. A process that compared
os.getppid() with the parent it saw at start would miss a launcher killed before it looked (its parent
is then already init or a subreaper); comparing with the pid the launcher wrote cannot miss it.
"""

from __future__ import annotations

import os

LAUNCHER_PID_ENV = "DISAGG_LAUNCHER_PID"


class LauncherWatch:
    def __init__(self) -> None:
        given = os.environ.get(LAUNCHER_PID_ENV, "")
        #: the launcher's pid; without the variable (started by hand), the parent at start
        self.pid = int(given) if given.isdigit() else os.getppid()

    def gone(self) -> bool:
        return os.getppid() != self.pid
