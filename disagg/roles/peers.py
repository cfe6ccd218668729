"""A role's peer lane: where the instance before it in the pipeline sends it a stage's Run (a Forward) once its
output is staged, instead of the orchestrator (disagg/orchestrator/forwards.py says when and why).

A Unix SOCK_SEQPACKET listener beside the orchestrator's lane, in the same private folder (disagg/transport/wire/lane.py:
one packet, one message), `peer-PID-INSTANCE.sock`; each connection's first packet names who connects. Outgoing lanes are
opened on first use and kept per address. Executor threads send (a compute that ends on one forwards from it), so
sending is under a lock; the loop thread accepts and reads.
"""

from __future__ import annotations

import logging
import os
import re
import threading

import zmq

from disagg.transport.data.shm import pid_alive
from disagg.transport.wire.lane import Lane, LaneClosed, LaneError, LaneListener, connect, lane_folder
from disagg.transport.wire.messages import (
    ErrorCode,
    Failed,
    Forward,
    MessageError,
    PeerMessage,
    Withdraw,
    decode,
    encode,
)

_PEER_FILE = re.compile(r"^peer-(\d+)-.*\.sock$")


def peer_lane_path(instance_id: str, pid: int | None = None) -> str:
    """Where this process's instance `instance_id` takes Forwards (an instance id holds no '/')."""
    return os.path.join(lane_folder(), f"peer-{os.getpid() if pid is None else pid}-{instance_id}.sock")


def remove_dead_peer_lanes(folder: str) -> list[str]:
    """The peer lane files in `folder` whose process has exited (a killed role leaves its file): removed."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        m = _PEER_FILE.match(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            removed.append(name)
        except OSError:
            pass
    return removed


class Peers:
    """The listener, the lanes other roles opened to it, and the lanes it opened to theirs."""

    def __init__(self, instance_id: str, log: logging.Logger):
        self.instance_id = instance_id
        self.log = log
        self.path = peer_lane_path(instance_id)
        remove_dead_peer_lanes(os.path.dirname(self.path))
        self.listener = LaneListener(self.path)
        #: fd -> [lane, introduced] of the lanes others opened to ours
        self.inbound: dict[int, list] = {}
        #: address -> lane we opened to another role's
        self.outbound: dict[str, Lane] = {}
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self.listener.fileno()

    def accept(self) -> list[int]:
        """New lanes from other roles: their fds, to poll."""
        fds = []
        for lane in self.listener.accept():
            self.inbound[lane.fd] = [lane, False]
            fds.append(lane.fd)
        return fds

    def recv(self, fd: int) -> list[list[bytes]] | None:
        """The messages waiting on lane `fd` (its introduction taken off); None once it closed (stop polling it)."""
        entry = self.inbound[fd]
        try:
            packets = entry[0].recv()
        except LaneClosed:
            del self.inbound[fd]
            return None
        out = []
        for frames in packets:
            if isinstance(frames, LaneError):
                self.log.warning("dropped a bad packet on the peer lane: %s", frames)
            elif not entry[1]:
                entry[1] = True  # [b"peer", instance id]
            else:
                out.append(frames)
        return out

    def send(self, forward: Forward) -> bool:
        """Send `forward` to its instance's peer lane; False if it cannot be reached (or the message is too big)."""
        frames = [encode(forward)]
        with self._lock:
            lane = self.outbound.get(forward.lane)
            if lane is None or lane.closed:
                lane = connect(forward.lane, [b"peer", self.instance_id.encode()])
                if lane is None:
                    self.outbound.pop(forward.lane, None)
                    return False
                self.outbound[forward.lane] = lane
            if lane.send(frames):
                return True
            if lane.closed:  # its instance is gone (a restart binds another path): forget the lane
                self.outbound.pop(forward.lane, None)
            return False

    def close(self) -> None:
        for entry in self.inbound.values():
            entry[0].close()
        with self._lock:
            for lane in self.outbound.values():
                lane.close()
        self.listener.close()


class PeerLink:
    """Methods of Worker (disagg/roles/worker.py): the peer lane's side of its loop, Withdraw, and Forwards sent on."""

    def forward_run(self, fwd: Forward) -> None:
        """Send a Forward on (StageRunner.forward), after the Staged that tells of it: from the loop thread at the end
        of its turn (`send_forwards`), from a compute thread at once. One that cannot be sent on (its instance's
        peer lane is gone or full) goes to the orchestrator, which sends its Run there itself."""
        if threading.get_ident() == self._loop_ident:
            self.pending_forwards.append(fwd)
        elif not self.peers.send(fwd):
            self.report(fwd)

    def send_forwards(self) -> None:
        """The Forwards of this turn's computes, after its reports left."""
        pending, self.pending_forwards = self.pending_forwards, []
        for fwd in pending:
            if not self.peers.send(fwd):
                self.send(fwd)
        self.flush()  # those that go to the orchestrator

    def drain_peers(self, events: dict) -> None:
        """New peer lanes, and the Forwards on those that have some."""
        peers = self.peers
        if peers.fileno() in events:
            for fd in peers.accept():
                self.poller.register(fd, zmq.POLLIN)
        for fd in [fd for fd in peers.inbound if fd in events]:
            messages = peers.recv(fd)
            if messages is None:
                self.poller.unregister(fd)
                continue
            for frames in messages:
                self.handle_peer(frames)

    def handle_peer(self, frames: list) -> None:
        """A Forward from the instance before this one: run it if it is for this registration
        (disagg/orchestrator/forwards.py)."""
        try:
            fwd = decode(frames[0], PeerMessage) if len(frames) == 1 else None
        except MessageError as exc:
            self.log.warning("dropped a bad message on the peer lane: %s", exc)
            return
        if fwd is None:
            self.log.warning("dropped a message of %d frames on the peer lane", len(frames))
            return
        if (fwd.instance_id, fwd.orchestrator_id, fwd.session) != (self.spec.instance_id, self.orchestrator_id,
                                                                   self.session):
            self.log.info("request %s attempt %d: forwarded Run not run: it was for %s's registration %d with "
                          "orchestrator %s", fwd.run.request_id, fwd.run.attempt, fwd.instance_id, fwd.session,
                          fwd.orchestrator_id or "?")
            return
        self.handle_run(fwd.run, [])

    def handle_withdraw(self, msg: Withdraw, frames) -> None:
        """The orchestrator takes back a forwarded Run: stopped if it runs here (its report says cancelled), else
        never run, and said so now; either way one report answers."""
        if self.runner.withdraw(msg.request_id, msg.attempt):
            self.log.info("request %s attempt %d withdrawn; stopping it at its next step", msg.request_id, msg.attempt)
            return
        self.send(Failed(request_id=msg.request_id, attempt=msg.attempt, error="withdrawn by the orchestrator",
                         code=ErrorCode.CANCELLED))
