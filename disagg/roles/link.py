"""A role's link to the orchestrator: its DEALER socket, the same-host fast lane (disagg/transport/wire/lane.py) once
the orchestrator welcomes it there, and the DEALER of each compute thread. A mixin of Worker
(disagg/roles/worker.py), on whose loop thread all but `_thread_dealer` run."""

from __future__ import annotations

import threading

import zmq

from disagg.transport.wire.auth import apply_client_curve
from disagg.transport.wire.bundle import Outbox
from disagg.transport.wire.lane import LaneClosed, LaneError, LaneLink
from disagg.transport.wire.messages import MAX_FRAMES_BYTES


class Link:
    """Methods of Worker; see disagg/roles/worker.py for the state they use."""

    def send(self, msg, frames=()) -> None:
        """Queue a message for the orchestrator; it leaves at the end of this loop turn (flush)."""
        self.outbox.add(None, msg, frames)

    def flush(self) -> None:
        self.outbox.flush(lambda _dest, frames: self.send_frames(frames))
        if self.pending_forwards:  # after the Staged that tells of them (disagg/roles/peers.py)
            self.send_forwards()

    def open_lane(self, path: str) -> None:
        """Take the orchestrator's fast lane when it is on this host (its socket file is here)."""
        self.close_lane()
        if not path or not self.spec.lane:
            return
        self.lane = LaneLink.open(path, [b"role", self.spec.instance_id.encode(), self.orchestrator_id.encode()])
        if self.lane is None:
            self.log.info("no fast lane to the orchestrator here; control messages take ZeroMQ")
        elif self.poller is not None:
            self.poller.register(self.lane.fd, zmq.POLLIN)

    def close_lane(self) -> None:
        if self.lane is not None:
            if self.poller is not None:
                try:
                    self.poller.unregister(self.lane.fd)
                except (KeyError, ValueError):
                    pass
            self.lane.close()
            self.lane = None

    def drain_lane(self) -> None:
        welcomed = self.lane.welcomed
        try:
            packets = self.lane.recv()
        except LaneClosed:
            self.log.info("the orchestrator closed the fast lane; control messages take ZeroMQ")
            self.close_lane()
            # it may have died: a heartbeat now tells (a successor answers "not registered", and we register)
            self.heartbeat()
            return
        if self.lane.welcomed and not welcomed:
            self.log.info("control messages take the fast lane")
        for frames in packets:
            if isinstance(frames, LaneError):
                self.log.warning("dropped a bad packet from the orchestrator: %s", frames)
                continue
            self.handle_frames(frames)

    def connect(self) -> None:
        """A fresh DEALER to the orchestrator (again after it went silent), then Register."""
        if self.sock is not None:
            self.outbox = Outbox()  # what was meant for the silent orchestrator goes with its socket
            self.close_lane()
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.spec.identity.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAMES_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, 10_000)
        apply_client_curve(self.sock, self.curve)
        self.sock.connect(self.spec.endpoint)
        self.register()

    def send_frames(self, frames: list) -> None:
        if self.lane is not None:
            if self.lane.send(frames):
                return
            if self.lane.closed:
                self.log.warning("the fast lane to the orchestrator broke; control messages take ZeroMQ")
                self.close_lane()
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self.log.warning("orchestrator not accepting messages; a report was dropped")

    def _thread_dealer(self) -> zmq.Socket:
        """This thread's own DEALER to the orchestrator, as INSTANCE#THREAD (it maps that to INSTANCE)."""
        sock = getattr(self._local, "dealer", None)
        if sock is None:
            sock = self._local.dealer = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"{self.spec.identity}#{threading.current_thread().name}".encode())
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            apply_client_curve(sock, self.curve)
            sock.connect(self.spec.endpoint)
            with self._dealers_lock:
                self._dealers.append(sock)
        return sock
