"""Talks to a running orchestrator: status, stop, and submitting many requests at once."""

from __future__ import annotations

import os
import select
import socket
import time
import uuid
from typing import Callable, Iterable

import zmq

from disagg.client.core import (  # noqa: F401  # noqa: F401 - the clients' API
    ORCHESTRATOR_SILENCE_S,
    PROBE_INTERVAL_S,
    SUSPECT_PROBE_S,
    Outcome,
    RequestBook,
    outcome_of,
)
from disagg.client.errors import error_for
from disagg.transport.environment import DISAGG_ENDPOINT
from disagg.transport.wire.auth import apply_client_curve
from disagg.transport.wire.bundle import Outbox, decode_frames
from disagg.transport.wire.lane import LaneClosed, LaneError, LaneLink
from disagg.transport.wire.messages import (
    Cancel,
    ErrorCode,
    GenerationParams,
    IdleDevice,
    LauncherPoll,
    MessageError,
    Partial,
    Rejected,
    Reroles,
    ServerReply,
    StatusQuery,
    StatusReport,
    Stop,
    StopHost,
    Stopping,
    Submit,
    encode,
)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
CONNECT_TIMEOUT_S = 1.0
#: the longest a send may wait for a connection to take it: a DEALER whose only connection failed (a
#: CurveZMQ handshake without the right keys) blocks a plain send forever
SEND_TIMEOUT_S = 5.0


def default_endpoint() -> str:
    return os.environ.get(DISAGG_ENDPOINT) or DEFAULT_ENDPOINT


class Unreachable(ConnectionError):
    """No orchestrator answered at the endpoint."""


def new_request_id() -> str:
    return uuid.uuid4().hex[:12]


class Client:
    """A DEALER socket to the orchestrator's frontend."""

    def __init__(self, endpoint: str | None = None, curve: tuple[bytes, bytes, bytes] | None = None):
        self.endpoint = endpoint or default_endpoint()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # named, so the fast lane can say which ZeroMQ peer it stands for (big replies still come here)
        self.identity = b"client-" + uuid.uuid4().hex.encode()
        self.sock.setsockopt(zmq.IDENTITY, self.identity)
        apply_client_curve(self.sock, curve)
        self.secured = curve is not None
        self.sock.connect(self.endpoint)
        self._probed = False
        #: the orchestrator's same-host fast lane, when it has one here (disagg/transport/wire/lane.py)
        self.lane: LaneLink | None = None
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        # told when the connection drops (the orchestrator died): run_all then asks who answers now
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller.register(self.monitor, zmq.POLLIN)
        #: the connection (lane or ZeroMQ) to the orchestrator dropped since it last answered
        self.suspect = False

    def close(self) -> None:
        self.close_lane()
        self.poller.unregister(self.monitor)
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)

    def open_lane(self, report: StatusReport) -> None:
        """Requests and results take the orchestrator's fast lane when it runs on this host."""
        path, oid = report.orchestrator.get("lane"), report.orchestrator.get("id", "")
        if self.lane is not None or not path:
            return
        lane = LaneLink.open(path, [b"client", self.identity, str(oid).encode()])
        if lane is None:
            return
        try:
            if select.select([lane.fd], [], [], CONNECT_TIMEOUT_S)[0]:
                lane.recv(1)  # the welcome
        except LaneClosed:
            pass
        if not lane.welcomed:
            lane.close()
            return
        self.lane = lane
        self.poller.register(lane.fd, zmq.POLLIN)

    def close_lane(self) -> None:
        if self.lane is not None:
            self.poller.unregister(self.lane.fd)
            self.lane.close()
            self.lane = None
            self.suspect = True

    def _send(self, frames: list) -> None:
        if self.lane is not None:
            if self.lane.send(frames):
                return
            if self.lane.closed:
                self.close_lane()
        self._zsend(frames)

    def _zsend(self, frames: list, timeout_s: float = SEND_TIMEOUT_S) -> None:
        """Send over ZeroMQ, or raise Unreachable once no connection took the message in `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0:
                    hint = "" if self.secured else " (if it uses keys, pass --keys)"
                    raise Unreachable(f"cannot reach the orchestrator at {self.endpoint} (no connection took a "
                                      f"message in {timeout_s:g} s){hint}") from None
                self.sock.poll(min(left, 0.05) * 1000, zmq.POLLOUT)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _recv(self, timeout_s: float, most: int = 1) -> list[tuple[object, list[bytes]]]:
        """The replies of up to `most` waiting ZeroMQ messages (a Bundle holds several); waits
        up to `timeout_s` for the first one. Empty when nothing came."""
        events = dict(self.poller.poll(timeout_s * 1000))
        if not events:
            return []
        messages = []
        if self.monitor in events:
            while self.monitor.poll(0):
                self.monitor.recv_multipart()
            self.suspect = True
        if self.lane is not None and self.lane.fd in events:
            try:
                messages.extend(self.lane.recv(most))
            except LaneClosed:
                self.close_lane()
        if self.sock in events:
            for _ in range(most):
                try:
                    messages.append(self.sock.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
        replies = []
        for frames in messages:
            try:
                if isinstance(frames, LaneError):
                    raise MessageError(str(frames))
                replies.extend(decode_frames(frames, ServerReply))
            except MessageError as exc:
                raise RuntimeError(f"bad reply from the orchestrator: {exc}") from None
        for reply, _ in replies:
            if isinstance(reply, MessageError):
                raise RuntimeError(f"bad reply from the orchestrator: {reply}")
        return replies

    def probe(self) -> None:
        """Fail at once when nothing listens at a tcp endpoint (ZeroMQ would wait silently)."""
        if not self.endpoint.startswith("tcp://"):
            return
        host, _, port = self.endpoint[len("tcp://") :].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except ValueError:
            raise Unreachable(f"cannot reach the orchestrator at {self.endpoint}: not a tcp://HOST:PORT address") from None
        except OSError as exc:
            raise Unreachable(f"cannot reach the orchestrator at {self.endpoint}: {exc.strerror or exc}") from None

    def _ask(self, msg, expect: type, timeout_s: float):
        if not self._probed:
            self.probe()
            self._probed = True
        deadline = time.monotonic() + timeout_s
        self._zsend([encode(msg)], timeout_s)
        while True:
            got = self._recv(max(0.0, deadline - time.monotonic()))
            if not got and time.monotonic() < deadline:
                continue  # woken by a connection event, not an answer
            if not got:
                self.probe()  # gone (connection refused) rather than silent: say that
                hint = "" if self.secured else " (if it uses keys, pass --keys)"
                raise Unreachable(f"cannot reach the orchestrator at {self.endpoint} (no answer in {timeout_s:g} s){hint}")
            for reply, _ in got:
                if isinstance(reply, expect):
                    return reply
                if isinstance(reply, Rejected) and reply.request_id is None:
                    raise error_for(f"orchestrator refused: {reply.reason}", reply.code, reply.param)

    def wait_gone(self, timeout_s: float) -> bool:
        """Wait until nothing listens at the endpoint any more (after a Stop); False if still there."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.probe()
            except Unreachable:
                return True
            time.sleep(0.05)
        return False

    def status(self, timeout_s: float = CONNECT_TIMEOUT_S) -> StatusReport:
        return self._ask(StatusQuery(), StatusReport, timeout_s)

    def stop(self, timeout_s: float = CONNECT_TIMEOUT_S, drain: bool = False, orchestrator_id: str = "") -> Stopping:
        """Stop the deployment; with `orchestrator_id`, only if that orchestrator is the one answering."""
        return self._ask(Stop(drain=drain, orchestrator_id=orchestrator_id), Stopping, timeout_s)

    def stop_host(self, host_id: str, drain: bool = False, timeout_s: float = CONNECT_TIMEOUT_S,
                  launcher: str = "") -> Stopping:
        """Stop one host's instances only (with `drain`, once what they run and hold is done); with `launcher`,
        only those that launcher started."""
        return self._ask(StopHost(host_id=host_id, drain=drain, launcher=launcher), Stopping, timeout_s)

    def launcher_poll(self, launcher: str, timeout_s: float = CONNECT_TIMEOUT_S, ids: list[str] = (),
                      idle: list[IdleDevice] = ()) -> Reroles:
        """A launcher's orders (`rebalance: auto`): the instances it should start again as another role. `ids`: every
        instance id it started; `idle`: its devices whose instance exited for a move and that await a new role."""
        return self._ask(LauncherPoll(launcher=launcher, ids=list(ids), idle=list(idle)), Reroles, timeout_s)

    def run_all(
        self,
        params: Iterable[GenerationParams],
        concurrency: int = 4,
        timeout_s: float | None = None,
        on_outcome: Callable[[Outcome], None] | None = None,
        ids: Iterable[str] | None = None,
        cancelled: Callable[[], bool] | None = None,
        arrivals: list[float] | None = None,
        on_partial: Callable[[Partial, bytes], None] | None = None,
    ) -> list[Outcome]:
        """Submit every request, at most `concurrency` at a time; wait for each to end.

        With `arrivals` (seconds from the start, one per request) requests are sent at those
        times instead, however many are pending (an open loop). `on_partial(Partial, image bytes)`: each live
        preview (params.previews) as it arrives.
        """
        todo = list(params)
        id_list = list(ids) if ids is not None else [new_request_id() for _ in todo]
        report = self.status()  # also fails fast with Unreachable
        self.open_lane(report)
        book = RequestBook(self.endpoint)
        book.on_reply(report, [], time.monotonic())  # the orchestrator that holds our requests
        book.suspect = self.suspect
        outcomes: dict[str, Outcome] = {}
        nxt = 0
        start = time.monotonic()

        def settle(ended: list[Outcome]) -> None:
            for outcome in ended:
                outcomes[outcome.request_id] = outcome
                if on_outcome:
                    on_outcome(outcome)

        outbox = Outbox()
        try:
            while nxt < len(todo) or book.pending:
                if cancelled is not None and cancelled():
                    raise KeyboardInterrupt
                if book.stopping:  # the deployment is stopping: what was not sent yet never will be
                    why = f"not sent: the deployment at {self.endpoint} is {book.stopping}"
                    settle([Outcome(rid, p, False, why, code=ErrorCode.UNAVAILABLE)
                            for rid, p in zip(id_list[nxt:], todo[nxt:])])
                    nxt = len(todo)
                while nxt < len(todo) and (
                    time.monotonic() - start >= arrivals[nxt] if arrivals is not None else len(book.pending) < concurrency
                ):
                    msg = book.submit(id_list[nxt], todo[nxt], timeout_s, time.monotonic())
                    if isinstance(msg, Submit):
                        outbox.add(None, msg)
                    elif msg is not None:
                        settle([msg])
                    nxt += 1
                # the submits of this turn leave as one message
                outbox.flush(lambda _dest, frames: self._send(frames))
                wait_s = 0.25
                if arrivals is not None and nxt < len(todo):
                    wait_s = min(wait_s, max(0.0, start + arrivals[nxt] - time.monotonic()))
                # everything that is already here, so the next submits go out together
                got = self._recv(wait_s, most=256)
                book.suspect = book.suspect or self.suspect
                for reply, frames in got:
                    before = book.orchestrator_id
                    ended, resend = book.on_reply(reply, frames, time.monotonic())
                    if isinstance(reply, StatusReport):
                        self.suspect = False
                        if book.orchestrator_id != before:  # a successor: its own lane
                            self.open_lane(reply)
                    settle(ended)
                    if on_partial is not None and isinstance(reply, Partial) and frames:
                        on_partial(reply, bytes(frames[0]))
                    for msg in resend:
                        outbox.add(None, msg)
                ended, to_send = book.tick(time.monotonic())
                settle(ended)
                for msg in to_send:
                    self._zsend([encode(msg)])  # who answers now? (it may have restarted): never the lane
        except KeyboardInterrupt:  # Ctrl-C: what we had in flight is given up, not left computing
            for rid in book.pending:
                outbox.add(None, Cancel(request_id=rid))
            outbox.flush(lambda _dest, frames: self._send(frames))
            raise
        return [outcomes[rid] for rid in id_list if rid in outcomes]
