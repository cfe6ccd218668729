"""The orchestrator's IO shell: two ROUTER sockets and the fast lane's listener (disagg/transport/wire/lane.py),
one poll loop; the Router does the thinking. Replies gathered in a turn leave at its end, one
message (or Bundle) per peer."""

from __future__ import annotations

import logging
import select
import signal
import time
from pathlib import Path

import zmq

from disagg.orchestrator.inbox import CLIENT_BUNDLE_MAX, ClientInbox
from disagg.orchestrator.lanes import LaneServing
from disagg.orchestrator.router import Out, Router
from disagg.transport.parent import LauncherWatch
from disagg.transport.wire.auth import secure_server
from disagg.transport.wire.bundle import Outbox, decode_frames
from disagg.transport.wire.lane import Lane, LaneListener, lane_path
from disagg.transport.wire.messages import (
    MAX_FRAMES_BYTES,
    MAX_MESSAGE_BYTES,
    Alive,
    ClientMessage,
    ErrorCode,
    MessageError,
    Register,
    Rejected,
    Release,
    RoleMessage,
    Stop,
    encode,
)

log = logging.getLogger("disagg.orchestrator")


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


TICK_S = 0.05
#: how long a Stop waits for the Shutdown messages to leave before the sockets close
STOP_LINGER_MS = 500
#: role socket identities whose parse is remembered (past it, the memory starts again)
MAX_ROUTES = 4096


# busy polling (settings busy_poll.seconds, busy_poll.max_in_flight): while few requests are in flight, a turn that
# handled messages is followed by polling without sleeping: the reply to what it just sent often comes within
# it, and a loop that never slept answers with warm caches instead of paying a wake-up (BENCHMARKS.md, control
# plane). Under load the loop is busy anyway and the CPU is better left to the roles.
def busy_polls(before: int, after: int, most: int) -> bool:
    """Whether a turn that handled messages opens a busy-poll window: with `before` requests in flight at its start
    and `after` at its end, some request was in flight (a reply is coming: a role's report, or after a Result the
    closed-loop client's next Submit) and at most `most` are now. A turn of an idle deployment (heartbeats) does
    not: the heartbeats of 1,000 instances, spread over the second, would otherwise keep the loop spinning."""
    return 0 < max(before, after) and after <= most


def _is_release(out: Out) -> bool:
    return type(out.msg) is Release


class OrchestratorServer(LaneServing):
    """Owns the sockets and the loop; every decision is the Router's."""

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 5555, keys_dir: str = "",
                 lane: bool = True):
        self.router = router
        self.ctx = zmq.Context()
        self.frontend = self.ctx.socket(zmq.ROUTER)
        self.backend = self.ctx.socket(zmq.ROUTER)
        # clients send only control messages; roles also send images and inline tensors
        self.frontend.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.backend.setsockopt(zmq.MAXMSGSIZE, MAX_FRAMES_BYTES)
        # a restarted role reconnects under its old identity and must take it over
        self.backend.setsockopt(zmq.ROUTER_HANDOVER, 1)
        for sock in (self.frontend, self.backend):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Curve before bind: only peers holding the deployment's client key get through the handshake
        self.auth = secure_server(self.ctx, [self.frontend, self.backend], Path(keys_dir)) if keys_dir else None
        if not keys_dir and not _loopback(host):
            log.warning("binding %s without --keys: anyone who can reach it can submit, register a role, and stop the "
                        "deployment", host)
        self.frontend.bind(f"tcp://{host}:{port}")
        self.backend.bind(f"tcp://{host}:{port + 1}")
        self.endpoint = f"tcp://{host}:{port}"
        router.endpoint = self.endpoint
        # the same-host fast lane (disagg/transport/wire/lane.py): roles and clients here connect after their handshake
        self.lane_listener = None
        if lane:
            try:
                self.lane_listener = LaneListener(lane_path(port))
            except OSError as exc:  # a path too long for a Unix socket, a folder that is not ours
                log.warning("no fast lane (%s); control messages take ZeroMQ", exc)
        router.lane = self.lane_listener.path if self.lane_listener else ""
        #: fd -> lane not yet introduced (its first packet says who it is)
        self._new_lanes: dict[int, Lane] = {}
        #: fd -> (lane, True for a client / False for a role, identity)
        self._lanes: dict[int, tuple[Lane, bool, bytes]] = {}
        #: (is client, identity) -> lane, for sending
        self._lane_to: dict[tuple[bool, bytes], Lane] = {}
        #: instance id (bytes) -> the ZeroMQ identity of its socket (DEPLOYMENT/INSTANCE), learnt from its Register
        self._route: dict[bytes, bytes] = {}
        self._known_senders: set[str] = set()
        #: a role socket's identity -> (its route, deployment, instance id), parsed once
        self._routes: dict[bytes, tuple[str, str, str]] = {}
        #: instance id -> its destination in the outbox, (False, the id as bytes)
        self._destinations: dict[str, tuple[bool, bytes]] = {}
        #: instance id -> (pid, watch until): roles whose lane closed, watched until their process exited
        self._exits: dict[str, tuple[int, float]] = {}
        self._stop_requested = False
        #: the launcher went away (killed): the process stops, and cleans what it can on its way out
        self.orphaned = False
        self._dropped = 0
        #: replies gathered during a loop turn: each peer gets one ZeroMQ message per turn
        self.outbox = Outbox()
        #: the heartbeats' answers (Alive), sent together at the next tick (send)
        self._alives: list[Out] = []
        #: clients' messages waiting to be handled, within a budget per turn (disagg/orchestrator/inbox.py)
        self.inbox = ClientInbox()
        #: the ZeroMQ sockets the next turn looks at whatever their fds say (run): both at the first
        self._zmq_due: set[zmq.Socket] = {self.frontend, self.backend}

    def request_stop(self, *_args) -> None:
        self._stop_requested = True

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        # one epoll over the lanes, the lane listener and the ZeroMQ sockets' signal fds (ZMQ_FD): a turn is one
        # system call, where zmq_poll asked each ZeroMQ socket for its state every turn (its commands, a getpid).
        # A ZeroMQ socket's fd only says "look" (ZMQ_EVENTS says what waits), and a send on the socket may take the
        # signal of a message that came meanwhile, so a socket is also looked at after a turn that sent on it or
        # left messages unread (`_zmq_due`), and at every tick.
        self.poller = poller = select.epoll()
        self._zmq_fds = {sock.getsockopt(zmq.FD): sock for sock in (self.frontend, self.backend)}
        for fd in self._zmq_fds:
            poller.register(fd, select.EPOLLIN)
        if self.lane_listener is not None:
            poller.register(self.lane_listener.fileno(), select.EPOLLIN)
        log.info("orchestrator listening on %s (roles on port +1)", self.endpoint)
        next_tick = time.monotonic()
        launcher = LauncherWatch()
        busy_poll, busy_max = self.router.config.busy_poll.seconds, self.router.config.busy_poll.max_in_flight
        busy_until = 0.0
        while not self._stop_requested:
            events = ()
            while not events and time.perf_counter() < busy_until:
                events = poller.poll(0)
            if not events:  # clients' messages still waiting, or a ZeroMQ socket to look at: look, but do not sleep
                events = poller.poll(0 if self.inbox or self._zmq_due else TICK_S)
            turn_start, before = time.perf_counter(), len(self.router.requests)
            self.serve_clients()  # a new turn: what clients sent past the last turns' budgets first
            due, self._zmq_due = self._zmq_due, set()
            for fd, _ in events:
                sock = self._zmq_fds.get(fd)
                if sock is None:  # a lane, or the lane listener
                    self.serve_lane(fd)
                else:
                    due.add(sock)
            if self.backend in due and self.backend.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self.drain_inbox(self.backend, self.handle_backend_frames)
            if self.frontend in due:
                if self.inbox.full:
                    self._zmq_due.add(self.frontend)  # read once the inbox has room
                elif self.frontend.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self.drain_inbox(self.frontend, self.handle_frontend_frames)
            now = time.monotonic()
            if now >= next_tick:
                self._zmq_due.update(self._zmq_fds.values())  # the next turn looks at both, whatever their fds said
                self.watch_exits(now)
                self.send(self.router.tick(now))
                self.send_alives()
                next_tick = now + TICK_S
                if launcher.gone():  # the launcher was killed: do not linger as an orphan
                    log.warning("launcher is gone; stopping the roles and exiting")
                    self.orphaned = True
                    self.send(self.router.handle_client(b"", Stop(), [], now))
            self.flush()
            if events and busy_poll and busy_polls(before, len(self.router.requests), busy_max):
                busy_until = turn_start + busy_poll
            if self.router.stopping:
                break
        if self.router.stopping:
            time.sleep(STOP_LINGER_MS / 1000)
        self.close()

    def drain_inbox(self, sock: zmq.Socket, handler) -> None:
        # bounded, so one busy socket cannot starve the other or the tick
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handler(frames)
        self._zmq_due.add(sock)  # more may wait: read on in the next turn, whatever its fd says

    def handle_frontend_frames(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self._drop("frontend", "message without a payload frame")
            return
        identity = frames[0]
        try:
            items = decode_frames(frames[1:], ClientMessage, max_messages=CLIENT_BUNDLE_MAX)
        except MessageError as exc:
            items = [(exc, [])]
        for msg, rest in items:
            if isinstance(msg, MessageError):
                self._drop("frontend", str(msg))
                self.send([Out(identity, None, Rejected(reason=f"bad message: {msg}", code=ErrorCode.INVALID_REQUEST))])
                continue
            now = self.inbox.spend(identity, msg)
            if now:  # within this turn's budget, nothing of the clients' waiting: at once
                self.send(self.router.handle_client(identity, msg, rest, time.monotonic()))
            elif now is False:  # handled in a later turn (serve_clients)
                refused = self.inbox.add(identity, msg, rest)
                if refused is not None:
                    self.send([Out(identity, None, refused)])

    def serve_clients(self) -> None:
        """A new turn's budget (disagg/orchestrator/inbox.py), spent first on what clients sent past the earlier turns',
        in the order each client sent it."""
        self.inbox.new_turn()
        for identity, msg, rest in self.inbox.take():
            self.inbox.turn_total += 1
            self.send(self.router.handle_client(identity, msg, rest, time.monotonic()))

    def handle_backend_frames(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self._drop("backend", "message without a payload frame")
            return
        try:
            # a role's socket is DEPLOYMENT/INSTANCE, and its compute threads' are DEPLOYMENT/INSTANCE#THREAD:
            # roles of two deployments never share a ZeroMQ identity, so one cannot take over another's route
            parsed = self._routes.get(frames[0])
            if parsed is None:
                route = frames[0].decode("ascii").split("#", 1)[0]
                if len(self._routes) >= MAX_ROUTES:
                    self._routes.clear()
                parsed = self._routes[frames[0]] = (route, *route.rpartition("/")[::2])
            route, deployment, sender = parsed
            items = decode_frames(frames[1:], RoleMessage)
        except (MessageError, UnicodeDecodeError) as exc:
            self._drop("backend", str(exc))
            return
        ours = self.router.config.deployment_id
        if ours and deployment != ours:
            self._drop("backend", f"a message from {sender!r} of deployment {deployment!r} (this orchestrator serves {ours!r})")
            reply = Rejected(reason=f"another deployment: this orchestrator serves deployment {ours!r}, not {deployment!r}",
                             code=ErrorCode.FOREIGN_DEPLOYMENT)
            try:
                self.backend.send_multipart([frames[0], encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._zmq_due.add(self.backend)  # (a send may take the signal of a message that came meanwhile)
            return
        for msg, rest in items:
            if isinstance(msg, MessageError):
                self._drop("backend", str(msg))
                continue
            if isinstance(msg, Register) or sender not in self._known_senders:
                # also before it registers: a successor's "not registered" must reach a role at once
                self._known_senders.add(sender)
                self._route[sender.encode()] = route.encode()
            self.send(self.router.handle_instance(sender, msg, rest, time.monotonic()))

    def _drop(self, where: str, why: str) -> None:
        self._dropped += 1
        # bounded logging: a flood of garbage must not become a flood of log lines
        if self._dropped <= 20 or self._dropped % 1000 == 0:
            log.warning("dropped a bad message on the %s socket (%d so far): %s", where, self._dropped, why[:200])

    def send(self, outs: list[Out], alives_now: bool = False) -> None:
        """Queue replies; they leave at the end of the loop turn (flush), one ZeroMQ message per peer.
        A Release is never urgent: the peers waiting on the rest are served first. It is not held back for a later
        turn, though: one that an orchestrator killed meanwhile never sent would keep its slot taken for the
        successor's grace period (BENCHMARKS.md, "Control plane, a fourth pass"). An Alive (a heartbeat's answer)
        waits for the next tick, with the others (`alives_now`: that tick's send): a role needs one within
        timeouts.heartbeat, and the heartbeats of many instances, spread over the second, are then answered
        with one wake-up of ZeroMQ's I/O thread per tick instead of one each (benchmarks/idle_beats.py)."""
        if not outs:
            return
        if len(outs) > 1:
            outs = sorted(outs, key=_is_release)
        add, destinations = self.outbox.add, self._destinations
        for out in outs:
            if type(out.msg) is Alive and not alives_now:
                self._alives.append(out)
                continue
            if out.to_client is not None:
                add((True, out.to_client), out.msg, out.frames)
                continue
            destination = destinations.get(out.to_instance)
            if destination is None:
                if len(destinations) >= MAX_ROUTES:
                    destinations.clear()
                destination = destinations[out.to_instance] = (False, out.to_instance.encode())
            add(destination, out.msg, out.frames)

    def send_alives(self) -> None:
        """The heartbeats' answers gathered since the last tick (send): they leave with this turn."""
        alives, self._alives = self._alives, []
        self.send(alives, alives_now=True)

    def flush(self) -> None:
        self.outbox.flush(self._send_frames)

    def _send_frames(self, destination: tuple[bool, bytes], frames: list) -> None:
        lane = self._lane_to.get(destination)
        if lane is not None:
            if lane.send(frames):
                return
            if lane.closed:  # broken or stuck peer: from now on ZeroMQ (a client's lane: the client is gone)
                self.drop_lane(lane.fd)
        to_client, identity = destination
        sock = self.frontend if to_client else self.backend
        if not to_client:
            identity = self._route.get(identity, identity)
        try:
            sock.send_multipart([identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # the peer is gone (client quit, role died): nothing to deliver to
            log.debug("could not send to %r: %s", identity, exc)
        self._zmq_due.add(sock)  # (a send may take the signal of a message that came meanwhile)

    def close(self) -> None:
        for fd in list(self._lanes) + list(self._new_lanes):
            self.drop_lane(fd)
        if self.lane_listener is not None:
            self.lane_listener.close()
        if self.auth is not None:
            self.auth.stop()
        self.frontend.close(linger=0)
        self.backend.close(linger=STOP_LINGER_MS)
        self.ctx.term()
