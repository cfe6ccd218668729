"""An asyncio client of the orchestrator: one DEALER socket, many requests in flight, replies
matched to their requests by id (what the HTTP gateway runs on)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import zmq
import zmq.asyncio

from client.sync import ORCHESTRATOR_SILENCE_S, PROBE_INTERVAL_S, SEND_TIMEOUT_S, SUSPECT_PROBE_S, Outcome, Unreachable, outcome_of
from transport.auth import apply_client_curve
from transport.bundle import decode_frames
from transport.messages import (
    ErrorCode,
    Cancel,
    GatewayBeat,
    GenerationParams,
    MessageError,
    Rejected,
    RequestQuery,
    RequestStates,
    ServerReply,
    StatusQuery,
    StatusReport,
    Submit,
    encode,
)

log = logging.getLogger("disagg.client")


class AsyncClient:
    """Submit requests and ask for status concurrently; `start()` first, `close()` at the end."""

    def __init__(self, endpoint: str, curve: tuple[bytes, bytes, bytes] | None = None):
        self.endpoint = endpoint
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, b"gateway-" + uuid.uuid4().hex.encode())
        apply_client_curve(self.sock, curve)
        self.sock.connect(endpoint)
        # told when the connection drops (the orchestrator died): then ask who answers now
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.suspect = False
        #: request id -> (params, sent at, its future)
        self._pending: dict[str, tuple[GenerationParams, float, asyncio.Future]] = {}
        #: request id -> its Submit's timeout_s (sent again, under the same id, to an orchestrator that restarted)
        self._timeouts: dict[str, float | None] = {}
        self._status_waiters: list[asyncio.Future] = []
        self._query_waiters: list[asyncio.Future] = []
        self._reader: asyncio.Task | None = None
        self._last_heard = time.monotonic()
        self.orchestrator_id = ""
        #: pending requests to send again (the orchestrator restarted)
        self._resubmit: list[str] = []

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_forever(), name="orchestrator-replies")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)

    async def _ask(self, msg, waiters: list[asyncio.Future], timeout_s: float):
        """Send `msg`; the next reply of its kind (answers come in order) resolves the oldest waiter."""
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        try:
            await self._send([encode(msg)], timeout_s)
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise Unreachable(f"cannot reach the orchestrator at {self.endpoint} (no answer in {timeout_s:g} s)") from None
        finally:
            if fut in waiters:
                waiters.remove(fut)

    async def _send(self, frames: list, timeout_s: float = SEND_TIMEOUT_S) -> None:
        """Send, or raise Unreachable once no connection took the message in `timeout_s` (a DEALER whose only
        connection failed, as a CurveZMQ handshake without the right keys does, would wait forever)."""
        try:
            await asyncio.wait_for(self.sock.send_multipart(frames), timeout_s)
        except asyncio.TimeoutError:
            raise Unreachable(f"cannot reach the orchestrator at {self.endpoint} (no connection took a message "
                              f"in {timeout_s:g} s)") from None

    async def _send_quietly(self, frames: list) -> None:
        """The reader's own sends: one no connection takes is logged, and the reader goes on."""
        try:
            await self._send(frames)
        except Unreachable as exc:
            log.warning("%s", exc)

    async def status(self, timeout_s: float = 2.0) -> StatusReport:
        return await self._ask(StatusQuery(), self._status_waiters, timeout_s)

    async def query(self, request_ids: list[str], timeout_s: float = 2.0) -> RequestStates:
        """Where these requests are (queued / running in which stage / denoising step)."""
        return await self._ask(RequestQuery(request_ids=request_ids), self._query_waiters, timeout_s)

    async def beat(self, url: str, pid: int, restarts: int = 0) -> None:
        """Tell the orchestrator this gateway serves it (status lists gateways heard from lately)."""
        await self._send([encode(GatewayBeat(url=url, pid=pid, restarts=restarts))])

    def in_flight(self, request_id: str) -> asyncio.Future | None:
        entry = self._pending.get(request_id)
        return entry[2] if entry else None

    async def submit(self, request_id: str, params: GenerationParams, timeout_s: float | None = None) -> Outcome:
        """Run one request; its Outcome once the orchestrator answers (a refusal is an Outcome too)."""
        entry = self._pending.get(request_id)
        if entry is not None and entry[0] != params:  # as the orchestrator answers such a Submit
            return Outcome(request_id, params, False, "refused: duplicate request_id with other parameters",
                           code=ErrorCode.DUPLICATE_REQUEST_ID, param="request_id")
        fut = self.in_flight(request_id)
        if fut is None:  # the same id twice: both wait for the one run
            fut = asyncio.get_running_loop().create_future()
            if not self._pending:  # silence counts from here: an idle client hears nothing, and that is fine
                self._last_heard = time.monotonic()
            self._pending[request_id] = (params, time.monotonic(), fut)
            self._timeouts[request_id] = timeout_s
            try:
                await self._send([encode(Submit(request_id=request_id, params=params, timeout_s=timeout_s))])
            except Unreachable as exc:
                self._settle(request_id, Outcome(request_id, params, False, str(exc), code=ErrorCode.UNREACHABLE))
        return await asyncio.shield(fut)

    async def cancel(self, request_id: str) -> bool:
        """Give a request up: the orchestrator drops it (its role stops at the next step); whoever
        awaits it gets a failed Outcome at once. False if it was not pending."""
        entry = self._pending.get(request_id)
        if entry is None:
            return False
        try:
            await self._send([encode(Cancel(request_id=request_id))])
        except Unreachable:
            pass  # nobody to tell: it ends here all the same
        self._settle(request_id, Outcome(request_id, entry[0], False, "cancelled",
                                         latency_s=time.monotonic() - entry[1], code=ErrorCode.CANCELLED))
        return True

    def _settle(self, rid: str, outcome: Outcome) -> None:
        self._timeouts.pop(rid, None)
        entry = self._pending.pop(rid, None)
        if entry is not None and not entry[2].done():
            entry[2].set_result(outcome)

    async def _read_forever(self) -> None:
        last_probe = 0.0
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        await self._send_quietly([encode(StatusQuery())])  # learn the orchestrator's id (restarts change it)
        while True:
            events = dict(await poller.poll(SUSPECT_PROBE_S * 1000 if self.suspect else 500))
            if self.monitor in events:
                while await self.monitor.poll(0):
                    await self.monitor.recv_multipart()
                self.suspect = True
                log.info("lost the connection to the orchestrator; asking who answers")
            if self.sock in events:
                while await self.sock.poll(0):
                    frames = await self.sock.recv_multipart()
                    self._last_heard = time.monotonic()
                    try:
                        replies = decode_frames(frames, ServerReply)
                    except MessageError as exc:
                        log.warning("bad reply from the orchestrator: %s", exc)
                        continue
                    for reply, rest in replies:
                        self._handle(reply, rest)
            now = time.monotonic()
            if not self._pending:
                continue
            if now - self._last_heard > ORCHESTRATOR_SILENCE_S:
                for rid, (params, t0, _) in list(self._pending.items()):
                    self._settle(rid, Outcome(rid, params, False, f"the orchestrator at {self.endpoint} stopped "
                                                                  "answering; request lost", latency_s=now - t0,
                                              code=ErrorCode.UNREACHABLE))
            elif now - last_probe > (SUSPECT_PROBE_S if self.suspect else PROBE_INTERVAL_S) and (
                    self.suspect or now - self._last_heard > PROBE_INTERVAL_S):
                last_probe = now  # quiet, or the connection dropped: who answers now?
                await self._send_quietly([encode(StatusQuery())])
            if self._resubmit:
                todo, self._resubmit = self._resubmit, []
                for rid in todo:
                    if rid in self._pending:
                        msg = Submit(request_id=rid, params=self._pending[rid][0], timeout_s=self._timeouts.get(rid),
                                     resume=True)
                        await self._send_quietly([encode(msg)])

    def _handle(self, reply, frames: list[bytes]) -> None:
        if isinstance(reply, MessageError):
            log.warning("bad reply from the orchestrator: %s", reply)
            return
        if isinstance(reply, StatusReport):
            oid = str(reply.orchestrator.get("id", ""))
            self.suspect = False
            if self.orchestrator_id and oid != self.orchestrator_id:
                # a successor: it knows our requests only from us (and what the roles still hold)
                log.info("the orchestrator restarted (%s, was %s); sending its %d pending requests again", oid,
                         self.orchestrator_id, len(self._pending))
                self._resubmit.extend(self._pending)
            self.orchestrator_id = oid
            waiters, self._status_waiters = self._status_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(reply)
            return
        if isinstance(reply, RequestStates):  # answers come in order: the oldest query is answered
            if self._query_waiters:
                fut = self._query_waiters.pop(0)
                if not fut.done():
                    fut.set_result(reply)
            return
        rid = getattr(reply, "request_id", None)
        entry = self._pending.get(rid) if rid else None
        if entry is None:
            if isinstance(reply, Rejected) and rid is None:
                log.warning("the orchestrator refused a message: %s", reply.reason)
            return
        params, t0, _ = entry
        latency = time.monotonic() - t0
        self._settle(rid, outcome_of(rid, params, reply, frames, latency))
