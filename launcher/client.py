"""Talks to a running orchestrator: status, stop, and submitting many requests at once."""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

import zmq

from transport.messages import (
    GenerationParams,
    MessageError,
    Rejected,
    Result,
    ServerReply,
    StatusQuery,
    StatusReport,
    Stop,
    Stopping,
    Submit,
    decode,
    encode,
)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
CONNECT_TIMEOUT_S = 1.0


def default_endpoint() -> str:
    return os.environ.get("DISAGG_ENDPOINT") or DEFAULT_ENDPOINT


class Unreachable(ConnectionError):
    """No orchestrator answered at the endpoint."""


@dataclass
class Outcome:
    """How one submitted request ended, with its images."""

    request_id: str
    params: GenerationParams
    ok: bool
    error: str | None = None
    images: list[bytes] = field(default_factory=list)
    image_format: str = "png"
    seed: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    latency_s: float = 0.0


def new_request_id() -> str:
    return uuid.uuid4().hex[:12]


class Client:
    """A DEALER socket to the orchestrator's frontend."""

    def __init__(self, endpoint: str | None = None):
        self.endpoint = endpoint or default_endpoint()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        self._probed = False

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _recv(self, timeout_s: float) -> tuple[object, list[bytes]] | None:
        if not self.sock.poll(timeout_s * 1000):
            return None
        frames = self.sock.recv_multipart()
        try:
            return decode(frames[0], ServerReply), frames[1:]
        except MessageError as exc:
            raise RuntimeError(f"bad reply from the orchestrator: {exc}") from None

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
        self.sock.send_multipart([encode(msg)])
        deadline = time.monotonic() + timeout_s
        while True:
            got = self._recv(max(0.0, deadline - time.monotonic()))
            if got is None:
                raise Unreachable(f"cannot reach the orchestrator at {self.endpoint} (no answer in {timeout_s:g} s)")
            reply, _ = got
            if isinstance(reply, expect):
                return reply
            if isinstance(reply, Rejected) and reply.request_id is None:
                raise RuntimeError(f"orchestrator refused: {reply.reason}")

    def status(self, timeout_s: float = CONNECT_TIMEOUT_S) -> StatusReport:
        if not self._probed:
            self.probe()
            self._probed = True
        return self._ask(StatusQuery(), StatusReport, timeout_s)

    def stop(self, timeout_s: float = CONNECT_TIMEOUT_S) -> Stopping:
        return self._ask(Stop(), Stopping, timeout_s)

    def run_all(
        self,
        params: Iterable[GenerationParams],
        concurrency: int = 4,
        timeout_s: float | None = None,
        on_outcome: Callable[[Outcome], None] | None = None,
        ids: Iterable[str] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[Outcome]:
        """Submit every request, at most `concurrency` at a time; wait for each to end."""
        todo = list(params)
        id_list = list(ids) if ids is not None else [new_request_id() for _ in todo]
        self.status()  # fail fast with Unreachable instead of waiting per request
        pending: dict[str, tuple[GenerationParams, float]] = {}
        outcomes: dict[str, Outcome] = {}
        nxt = 0
        # no answer at all for this long means the orchestrator went away
        silence_limit_s = (timeout_s or 600.0) + 30.0
        last_heard = time.monotonic()
        while nxt < len(todo) or pending:
            if cancelled is not None and cancelled():
                raise KeyboardInterrupt
            while nxt < len(todo) and len(pending) < concurrency:
                rid, p = id_list[nxt], todo[nxt]
                self.sock.send_multipart([encode(Submit(request_id=rid, params=p, timeout_s=timeout_s))])
                pending[rid] = (p, time.monotonic())
                nxt += 1
            got = self._recv(0.25)
            if got is None:
                if time.monotonic() - last_heard > silence_limit_s:
                    for rid, (p, t0) in pending.items():
                        outcomes[rid] = Outcome(rid, p, False, f"no answer from {self.endpoint}")
                    break
                continue
            last_heard = time.monotonic()
            reply, frames = got
            rid = getattr(reply, "request_id", None)
            if rid not in pending:
                continue
            p, t0 = pending.pop(rid)
            if isinstance(reply, Result):
                outcome = Outcome(
                    rid, p, reply.ok, reply.error, list(frames), reply.image_format, reply.seed, reply.timings,
                    time.monotonic() - t0,
                )
            else:
                outcome = Outcome(rid, p, False, f"refused: {reply.reason}", latency_s=time.monotonic() - t0)
            outcomes[rid] = outcome
            if on_outcome:
                on_outcome(outcome)
        return [outcomes[rid] for rid in id_list if rid in outcomes]
