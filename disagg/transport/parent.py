"""Whether the launcher that started this process is still there.

The launcher puts its pid in DISAGG_LAUNCHER_PID for every process it starts. A process that compared
os.getppid() with the parent it saw at start would miss a launcher killed before it looked (its parent
is then already init or a subreaper); comparing with the pid the launcher wrote cannot miss it.
"""

from __future__ import annotations

import os

from disagg.transport.environment import DISAGG_FORK_SERVER_PID, DISAGG_LAUNCHER_PID


class LauncherWatch:
    def __init__(self) -> None:
        given = os.environ.get(DISAGG_LAUNCHER_PID, "")
        #: the launcher's pid; without the variable (started by hand), the parent at start
        self.pid = int(given) if given.isdigit() else os.getppid()
        # a role forked by the launcher's fork server (disagg/roles/forks.py) has that server as its parent: the server
        # ends as soon as the launcher does (EOF on its stdin), so the role's parent changes then too
        server = os.environ.get(DISAGG_FORK_SERVER_PID, "")
        self.parents = {self.pid, int(server)} if server.isdigit() else {self.pid}

    def gone(self) -> bool:
        """Our parent is no longer the launcher (nor its fork server) and the launcher's pid is gone too (a
        fork server that died alone leaves its roles to init, and they go on serving their launcher)."""
        if os.getppid() in self.parents:
            return False
        if len(self.parents) == 1:  # started by the launcher itself: a new parent means it is gone
            return True
        from disagg.transport.data.shm import pid_alive

        return not pid_alive(self.pid)
