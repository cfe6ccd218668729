"""An asyncio client of the orchestrator: one DEALER socket, many requests in flight, replies
matched to their requests by id (what the HTTP gateway runs on)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Callable

import zmq
import zmq.asyncio

from disagg.client.core import SUSPECT_PROBE_S, Outcome, RequestBook
from disagg.client.sync import SEND_TIMEOUT_S, Unreachable
from disagg.transport.wire.auth import apply_client_curve
from disagg.transport.wire.bundle import decode_frames
from disagg.transport.wire.messages import (
    Cancel,
    ErrorCode,
    GatewayBeat,
    GenerationParams,
    MessageError,
    Partial,
    Rejected,
    RequestQuery,
    RequestStates,
    ServerReply,
    StatusQuery,
    StatusReport,
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
        #: the requests' state (disagg/client/core.py), and the future each caller awaits
        self.book = RequestBook(endpoint)
        self._futures: dict[str, asyncio.Future] = {}
        #: request id -> what its live previews (Partial, image bytes) are handed to
        self._partials: dict[str, Callable] = {}
        self._status_waiters: list[asyncio.Future] = []
        self._query_waiters: list[asyncio.Future] = []
        self._reader: asyncio.Task | None = None

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

    @property
    def orchestrator_id(self) -> str:
        return self.book.orchestrator_id

    def in_flight(self, request_id: str) -> asyncio.Future | None:
        return self._futures.get(request_id)

    async def submit(self, request_id: str, params: GenerationParams, timeout_s: float | None = None,
                     on_partial: Callable | None = None) -> Outcome:
        """Run one request; its Outcome once the orchestrator answers (a refusal is an Outcome too). The same id
        twice, with the same parameters, waits for the one run. `on_partial(Partial, image bytes)`: each live
        preview of it (params.previews), called on the loop as it arrives."""
        if on_partial is not None:
            self._partials[request_id] = on_partial
        msg = self.book.submit(request_id, params, timeout_s, time.monotonic())
        if isinstance(msg, Outcome):
            return msg
        if msg is not None:
            self._futures[request_id] = asyncio.get_running_loop().create_future()
            try:
                await self._send([encode(msg)])
            except Unreachable as exc:
                self._settle([self.book.give_up(request_id, str(exc), ErrorCode.UNREACHABLE, time.monotonic())])
        return await asyncio.shield(self._futures[request_id])

    async def cancel(self, request_id: str) -> bool:
        """Give a request up: the orchestrator drops it (its role stops at the next step); whoever
        awaits it gets a failed Outcome at once. False if it was not pending."""
        if request_id not in self.book.pending:
            return False
        try:
            await self._send([encode(Cancel(request_id=request_id))])
        except Unreachable:
            pass  # nobody to tell: it ends here all the same
        self._settle([self.book.give_up(request_id, "cancelled", ErrorCode.CANCELLED, time.monotonic())])
        return True

    def _settle(self, ended: list[Outcome | None]) -> None:
        for outcome in ended:
            if outcome is not None:
                self._partials.pop(outcome.request_id, None)
            fut = self._futures.pop(outcome.request_id, None) if outcome is not None else None
            if fut is not None and not fut.done():
                fut.set_result(outcome)

    async def _read_forever(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        await self._send_quietly([encode(StatusQuery())])  # learn the orchestrator's id (restarts change it)
        while True:
            events = dict(await poller.poll(SUSPECT_PROBE_S * 1000 if self.book.suspect else 500))
            to_send = []
            if self.monitor in events:
                while await self.monitor.poll(0):
                    await self.monitor.recv_multipart()
                self.book.on_disconnect()
                log.info("lost the connection to the orchestrator; asking who answers")
            if self.sock in events:
                while await self.sock.poll(0):
                    frames = await self.sock.recv_multipart()
                    try:
                        replies = decode_frames(frames, ServerReply)
                    except MessageError as exc:
                        log.warning("bad reply from the orchestrator: %s", exc)
                        continue
                    for reply, rest in replies:
                        to_send += self._handle(reply, rest)
            ended, probes = self.book.tick(time.monotonic())
            self._settle(ended)
            for msg in to_send + probes:
                await self._send_quietly([encode(msg)])

    def _handle(self, reply, frames: list[bytes]) -> list:
        """One reply: ends requests, answers waiters; what to send (resubmits to an orchestrator that restarted)."""
        if isinstance(reply, MessageError):
            log.warning("bad reply from the orchestrator: %s", reply)
        before = self.book.orchestrator_id
        ended, resend = self.book.on_reply(reply, frames, time.monotonic())
        self._settle(ended)
        if isinstance(reply, Partial):
            handler = self._partials.get(reply.request_id)
            if handler is not None and frames:
                handler(reply, bytes(frames[0]))
        if isinstance(reply, StatusReport):
            if resend:
                log.info("the orchestrator restarted (%s, was %s); sending its %d pending requests again",
                         self.book.orchestrator_id, before, len(resend))
            waiters, self._status_waiters = self._status_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(reply)
        elif isinstance(reply, RequestStates):  # answers come in order: the oldest query is answered
            if self._query_waiters:
                fut = self._query_waiters.pop(0)
                if not fut.done():
                    fut.set_result(reply)
        elif isinstance(reply, Rejected) and reply.request_id is None:
            log.warning("the orchestrator refused a message: %s", reply.reason)
        return resend
