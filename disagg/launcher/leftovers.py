"""What a deployment killed whole leaves behind, and its removal by the next launch on the machine.

A launcher that exits cleans its run's shared-memory pools (/dev/shm/disagg-RUNID-*) and its orchestrator's lane
socket. One killed with every process of its deployment at once (the OOM killer, a container's kill) cannot. So
each launcher keeps a record of its run, `$TMPDIR/disagg-UID/runs/RUNID.lock`, holding an exclusive flock on it for
its whole life: the kernel lets go of the lock when the launcher dies, however it dies. A later launch takes the
lock of every record whose launcher is gone (a lock held means a live deployment: never touched) and removes that
run's segments whose owner (the pid that ends a pool's name) has exited, and its lane socket file when it is still
the one that orchestrator made (same inode) and nothing listens on it. The record goes once nothing of it is left.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile

from disagg.transport.data.shm import SHM_PREFIX, list_segments, pid_alive, remove_segments, shm_path
from disagg.transport.wire.lane import lane_in_use


def runs_folder() -> str:
    """Where run records live: beside the lanes, in this user's private folder under the temp dir."""
    return os.path.join(tempfile.gettempdir(), f"disagg-{os.getuid()}", "runs")


class RunRecord:
    """This launcher's record of its run, locked for as long as it lives."""

    def __init__(self, run_id: str, folder: str | None = None):
        self.run_id = run_id
        self.folder = folder or runs_folder()
        self.path = os.path.join(self.folder, f"{run_id}.lock")
        self.fd: int | None = None
        #: its host: where /tmp is shared between hosts (a cluster's network home, namespace test hosts), a launch on
        #: another host neither removes its segments (they are in that host's /dev/shm) nor its record
        self.data: dict = {"run_id": run_id, "launcher_pid": os.getpid(), "lane": "", "lane_inode": None,
                           "host": socket.gethostname()}

    def claim(self) -> None:
        """Write the record and lock it. Written under another name and renamed once locked, so another launch
        never finds it unlocked."""
        # the user's private folder first, as the lanes beside it need it (they refuse one others may write into):
        # os.makedirs gives the folders above the one it makes the default mode, open to all
        os.makedirs(os.path.dirname(self.folder), mode=0o700, exist_ok=True)
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{self.run_id}.")
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.fd = fd
        self._write()
        os.rename(tmp, self.path)

    def update(self, **fields) -> None:
        self.data.update(fields)
        if self.fd is not None:
            self._write()

    def _write(self) -> None:
        blob = json.dumps(self.data).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, blob, 0)

    def release(self) -> None:
        """The run ended and cleaned up after itself: its record goes."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def _segment_bytes(name: str) -> int:
    try:
        return os.stat(shm_path(name)).st_size
    except OSError:
        return 0


def remove_leftovers(folder: str | None = None, mine: str = "", pending: list | None = None) -> list[str]:
    """Remove what deployments that are gone left behind (module docstring); what was removed, in words. Runs
    whose launcher is gone but some of whose processes still run (their segments stay) are added to `pending`."""
    folder = folder or runs_folder()
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".lock") and not n.startswith("."))
    except FileNotFoundError:
        return []
    said = []
    for name in names:
        run_id = name[: -len(".lock")]
        if run_id == mine:
            continue
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its launcher lives: a live deployment, never touched
            try:
                data = json.loads(os.pread(fd, 65536, 0) or b"{}")
            except ValueError:
                data = {}
            if data.get("host", socket.gethostname()) != socket.gethostname():
                continue  # another host's run: its segments are not here
            prefix = f"{SHM_PREFIX}{run_id}-"
            sizes = {n: _segment_bytes(n) for n in list_segments(prefix)}
            removed = remove_segments(prefix, only_dead=True)
            if not any(_owned(n) for n in list_segments(prefix)):  # what no process owns (a simulated device's file)
                removed += remove_segments(prefix)
            lane = _remove_lane(data)
            if removed or lane:
                what = [f"{len(removed)} shared-memory segment(s) ({sum(sizes[n] for n in removed) / 2**20:.1f} MiB)"] if removed else []
                what += [f"the lane socket {lane}"] if lane else []
                said.append(f"removed {' and '.join(what)} left by deployment {run_id} (launcher pid "
                            f"{data.get('launcher_pid', '?')}, gone without cleaning up)")
            if list_segments(prefix):  # an owner still runs: a later launch (or clean --wait) looks again
                if pending is not None:
                    pending.append(run_id)
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:  # another launch removed it meanwhile
                    pass
        finally:
            os.close(fd)
    return said


def _owned(name: str) -> bool:
    """Whether the segment's owner (the pid that ends a pool's name) runs."""
    pid = name.rsplit("-", 1)[-1]
    return pid.isdigit() and pid_alive(int(pid))


def _remove_lane(data: dict) -> str:
    """The run's lane socket file, if it is still the one its orchestrator made and nothing listens on it."""
    path, inode = data.get("lane") or "", data.get("lane_inode")
    if not path or not inode:
        return ""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    if [st.st_dev, st.st_ino] != list(inode) or lane_in_use(path):
        return ""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return ""
    return path
