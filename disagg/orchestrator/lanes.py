"""The orchestrator's side of the same-host fast lane (disagg/transport/wire/lane.py): a lane accepted, introduced by
its first packet, its packets handled as if they came on the ZeroMQ sockets, dropped; and a role whose lane closed
watched until its process exited (dead at once: kill -9, a crash). A mixin of OrchestratorServer
(disagg/orchestrator/server.py), whose __init__ sets the state these methods use."""

from __future__ import annotations

import select
import time

from disagg.transport.data.shm import pid_alive
from disagg.transport.wire.lane import WELCOME, LaneClosed, LaneError

#: after a role's lane closed, how long its pid is watched for its exit (a dying process closes its
#: sockets a moment before it has exited)
EXIT_WATCH_S = 1.0


class LaneServing:
    """Methods of OrchestratorServer; see disagg/orchestrator/server.py for the state they use."""

    def serve_lane(self, fd: int) -> None:
        if self.lane_listener is not None and fd == self.lane_listener.fileno():
            for lane in self.lane_listener.accept():
                self._new_lanes[lane.fd] = lane
                self.poller.register(lane.fd, select.EPOLLIN)
            return
        lane = self._new_lanes.get(fd) or (self._lanes[fd][0] if fd in self._lanes else None)
        if lane is None:
            return
        try:
            packets = lane.recv()
        except LaneClosed:
            entry = self._lanes.get(fd)
            self.drop_lane(fd)
            if entry is not None and not entry[1]:  # a role's lane: did its process die?
                inst = self.router.registry.get(entry[2].decode())
                if inst is not None and inst.state != "dead":
                    self._exits[inst.id] = (inst.pid, time.monotonic() + EXIT_WATCH_S)
                    self.watch_exits(time.monotonic())
            return
        for frames in packets:
            if isinstance(frames, LaneError):
                self._drop("lane", str(frames))
                continue
            if fd in self._new_lanes:
                self.introduce_lane(fd, frames)
                continue
            entry = self._lanes.get(fd)
            if entry is None:  # refused at its introduction, or dropped meanwhile: the rest goes unread
                return
            _, is_client, identity = entry
            if is_client:
                self.handle_frontend_frames([identity, *frames])
            else:  # as if on its ZeroMQ socket: DEPLOYMENT/INSTANCE
                self.handle_backend_frames([self._route.get(identity, identity), *frames])

    def introduce_lane(self, fd: int, hello: list[bytes]) -> None:
        """A lane's first packet: [b"role", instance id, orchestrator id] or
        [b"client", its ZeroMQ identity, orchestrator id]."""
        lane = self._new_lanes.pop(fd)
        kind, rest = hello[0], hello[1:]
        if kind == b"role" and len(rest) == 2 and rest[1] == self.router.id.encode():
            inst = self.router.registry.get(rest[0].decode("ascii", "replace"))
            if inst is not None and inst.state != "dead":
                identity, is_client = inst.id.encode(), False
            else:
                identity = None
        elif kind == b"client" and len(rest) == 2 and rest[1] == self.router.id.encode() and 0 < len(rest[0]) <= 255:
            # its ZeroMQ identity: what is too big for the lane still reaches it there
            identity, is_client = rest[0], True
        else:
            identity = None
        if identity is None:  # not ours, or an instance we do not know: it talks over ZeroMQ
            self.poller.unregister(fd)
            lane.close()
            return
        old = self._lane_to.get((is_client, identity))
        if old is not None and not old.closed:  # a role that connected again (re-registered)
            self.drop_lane(old.fd)
        self._lanes[fd] = (lane, is_client, identity)
        self._lane_to[(is_client, identity)] = lane
        if not is_client:
            inst.lane = True
        lane.send([WELCOME])  # the peer switches to the lane only now, so nothing it sends is lost

    def watch_exits(self, now: float) -> None:
        """A role whose lane closed and whose process has exited is dead at once (kill -9, a crash)."""
        for iid, (pid, until) in list(self._exits.items()):
            if not pid_alive(pid):
                del self._exits[iid]
                self.send(self.router.instance_exited(iid, pid, now))
            elif now > until:
                del self._exits[iid]  # alive: it only closed its lane (it reconnects)

    def drop_lane(self, fd: int) -> None:
        lane = self._new_lanes.pop(fd, None)
        entry = self._lanes.pop(fd, None)
        if entry is not None:
            lane = entry[0]
            if self._lane_to.get((entry[1], entry[2])) is lane:
                del self._lane_to[(entry[1], entry[2])]
                inst = None if entry[1] else self.router.registry.get(entry[2].decode())
                if inst is not None:
                    inst.lane = False
        try:
            self.poller.unregister(fd)
        except (KeyError, OSError):  # not (or no longer) registered
            pass
        if lane is not None:
            lane.close()
