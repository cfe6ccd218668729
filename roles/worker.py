"""The worker runtime shared by all three roles: register, heartbeat, pull, compute, stage, report.

One thread owns the DEALER socket and the poll loop; compute and transfers run on a pool of
`capacity` threads that hand their reports back through an inproc socket, so the loop never
blocks on a model.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import zmq

from roles.stage import Stage
from transport.engines import EngineOptions, TransferEngine, make_engines
from transport.manifest import unpack
from transport.messages import (
    BOOT_ERROR_EXIT,
    MAX_FRAMES_BYTES,
    Dead,
    Done,
    Failed,
    Fetched,
    Heartbeat,
    MessageError,
    OrchestratorCommand,
    PoolInfo,
    Register,
    Registered,
    Rejected,
    Release,
    Run,
    Shutdown,
    Staged,
    decode,
    encode,
)
from transport.pool import Pool

HEARTBEAT_INTERVAL_S = 1.0
REGISTER_RETRY_S = 1.0
REPORTS = "inproc://reports"


@dataclass
class WorkerSpec:
    """What the launcher tells one role process."""

    role: str
    instance_id: str
    endpoint: str  # the orchestrator's backend socket
    model: str = "tiny"
    device: str = "cpu"
    capacity: int = 1
    pool_bytes: int = 64 * 1024 * 1024
    pool_name: str = ""
    host_id: str = ""
    threads: int = 0  # torch intra-op threads; 0 = the CPUs this process may run on
    transfer: str = "auto"  # a forced engine must start, or the role fails to boot
    transfer_protocol: str = "tcp"
    ib_device: str = ""
    data_host: str = "127.0.0.1"
    visible_gpus: list[int] = field(default_factory=list)  # physical ids, in cuda:N order


class Worker:
    """Drives a Stage from the orchestrator's messages."""

    def __init__(self, spec: WorkerSpec, load_stage, pool: Pool):
        self.spec = spec
        self.load_stage = load_stage
        self.stage: Stage | None = None
        self.exit_code = 0
        self.pool = pool
        self.log = logging.getLogger("disagg.role")
        options = EngineOptions(spec.data_host, spec.transfer_protocol, spec.ib_device, tuple(spec.visible_gpus))
        self.engines: dict[str, TransferEngine] = make_engines(pool, spec.transfer, options, self.log)
        self.pool_lock = threading.Lock()
        self.executor = ThreadPoolExecutor(max_workers=spec.capacity, thread_name_prefix=spec.instance_id)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, spec.instance_id.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAMES_BYTES)
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.bind(REPORTS)
        self._local = threading.local()
        self.in_flight = 0
        self.ready = False
        self.registered = False
        self.stop = False
        self.parent_pid = os.getppid()
        self._handlers = {
            Registered: self.handle_registered,
            Run: self.handle_run,
            Release: self.handle_release,
            Shutdown: self.handle_shutdown,
            Rejected: self.handle_rejected,
        }

    # --- socket side (loop thread only) ----------------------------------------------------

    def send(self, msg, frames=()) -> None:
        self.sock.send_multipart([encode(msg), *frames])

    def pool_info(self) -> PoolInfo:
        advertised = {}
        for engine in self.engines.values():
            advertised.update(engine.advertise())
        return PoolInfo(
            host_id=self.spec.host_id,
            engines=list(self.engines),
            pool_name=self.pool.name,
            pool_bytes=self.pool.nbytes,
            device=self.pool.device,
            **advertised,
        )

    def register(self) -> None:
        pool = self.pool_info()
        self.send(
            Register(
                role=self.spec.role,
                instance_id=self.spec.instance_id,
                pid=os.getpid(),
                host_id=self.spec.host_id,
                device=self.spec.device,
                capacity=self.spec.capacity,
                pool=pool,
                ready=self.ready,
            )
        )

    def heartbeat(self) -> None:
        self.send(
            Heartbeat(
                instance_id=self.spec.instance_id,
                ready=self.ready,
                in_flight=self.in_flight,
                pool_free_bytes=self.pool.free_bytes,
            )
        )

    def connect(self) -> None:
        self.sock.connect(self.spec.endpoint)
        self.register()

    def boot(self) -> None:
        """Load the model off the loop thread, so heartbeats go on while it loads."""
        try:
            self.stage = self.load_stage()
        except BaseException as exc:  # noqa: BLE001 - any boot failure ends the process
            self.log.exception("cannot load the model")
            self.report(None, [f"{type(exc).__name__}: {exc}".encode()], kind=b"boot-failed")
        else:
            self.report(None, kind=b"ready")

    def serve_forever(self) -> None:
        threading.Thread(target=self.boot, name="boot", daemon=True).start()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.reports, zmq.POLLIN)
        next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
        last_register = time.monotonic()
        while not self.stop:
            timeout_ms = max(0.0, next_beat - time.monotonic()) * 1000
            events = dict(poller.poll(timeout_ms))
            if self.reports in events:
                self.forward_reports()
            if self.sock in events:
                self.drain_inbox()
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_INTERVAL_S
                if not self.registered and now - last_register > REGISTER_RETRY_S:
                    last_register = now
                    self.register()
                self.heartbeat()
                if os.getppid() != self.parent_pid:
                    self.log.warning("launcher is gone; exiting")
                    self.stop = True
        self.close()

    def drain_inbox(self) -> None:
        for _ in range(256):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frames[0], OrchestratorCommand)
            except MessageError as exc:
                self.log.warning("dropped a bad message from the orchestrator: %s", exc)
                continue
            self._handlers[type(msg)](msg, frames[1:])

    def forward_reports(self) -> None:
        for _ in range(256):
            try:
                frames = self.reports.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = frames[0]
            if kind == b"finished":
                self.in_flight -= 1
            elif kind == b"ready":
                self.ready = True
                self.log.info("model loaded; ready")
                self.heartbeat()
            elif kind == b"boot-failed":
                self.send_dead(f"boot failed: {frames[1].decode(errors='replace')}")
                self.exit_code = BOOT_ERROR_EXIT
                self.stop = True
            else:
                self.sock.send_multipart(frames)

    def handle_registered(self, msg: Registered, frames) -> None:
        self.registered = True
        self.log.info("registered, session %d", msg.session)

    def handle_rejected(self, msg: Rejected, frames) -> None:
        self.log.warning("orchestrator rejected a message: %s", msg.reason)
        if "register" in msg.reason:
            self.registered = False
            self.register()

    def handle_run(self, msg: Run, frames) -> None:
        if self.stage is None:
            self.send(Failed(request_id=msg.request_id, attempt=msg.attempt, error="model not loaded yet"))
            return
        self.in_flight += 1
        self.executor.submit(self.execute, msg, frames, time.perf_counter())

    def handle_release(self, msg: Release, frames) -> None:
        with self.pool_lock:
            if self.pool.allocator.owns(msg.offset):
                self.pool.free(msg.offset)
            else:
                self.log.warning("release of unknown slot %d for %s ignored", msg.offset, msg.request_id)

    def handle_shutdown(self, msg: Shutdown, frames) -> None:
        self.log.info("shutdown requested")
        self.stop = True

    # --- compute side (executor threads) ---------------------------------------------------

    def report(self, msg, frames=(), kind: bytes = b"finished") -> None:
        """Hand a message (or, with msg None, a local event `kind`) to the loop thread."""
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._local.push = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(REPORTS)
        sock.send_multipart([encode(msg) if msg is not None else kind, *frames])

    def execute(self, run: Run, frames: list[bytes], received: float) -> None:
        """Pull, compute, stage, report. `received`: when the loop got the Run (fetch_s counts from it)."""
        local_slot = None
        try:
            inputs = {}
            if run.source is not None:
                nbytes = run.source.slot.nbytes
                with self.pool_lock:
                    local_slot = self.pool.alloc(nbytes)
                dst = self.pool.view(local_slot, nbytes)
                engine = self.engines.get(run.source.engine)
                if engine is None:
                    raise RuntimeError(f"transfer engine {run.source.engine!r} is not available here")
                engine.read(run.source, dst, frames)
                inputs = unpack(dst, run.source.slot.tensors)
                self.report(Fetched(request_id=run.request_id, attempt=run.attempt, fetch_s=time.perf_counter() - received))
            t0 = time.perf_counter()
            out = self.stage.run(run.params, inputs)
            compute_s = time.perf_counter() - t0
            if out.images:
                self.report(
                    Done(
                        request_id=run.request_id,
                        attempt=run.attempt,
                        num_images=len(out.images),
                        image_format=out.image_format,
                        compute_s=compute_s,
                    ),
                    out.images,
                )
            else:
                with self.pool_lock:
                    slot = self.pool.stage(self.spec.instance_id, out.tensors)
                extra = [self.pool.view(slot.offset, slot.nbytes).cpu().numpy().tobytes()] if run.inline_output else []
                self.report(Staged(request_id=run.request_id, attempt=run.attempt, slot=slot, compute_s=compute_s), extra)
        except Exception as exc:  # a request error: report it and keep serving
            self.log.exception("request %s failed", run.request_id)
            self.report(Failed(request_id=run.request_id, attempt=run.attempt, error=f"{type(exc).__name__}: {exc}"))
        finally:
            if local_slot is not None:
                with self.pool_lock:
                    self.pool.free(local_slot)
            self.report(None)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        for engine in self.engines.values():
            engine.close()
        self.sock.close(linger=500)
        self.reports.close(linger=0)
        self.pool.close()

    def send_dead(self, reason: str) -> None:
        try:
            self.send(Dead(instance_id=self.spec.instance_id, reason=reason[:60_000]))
        except zmq.ZMQError:
            pass


def install_signal_handlers(worker: Worker) -> None:
    def on_signal(*_):
        worker.stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def spec_from_json(data: str) -> WorkerSpec:
    return msgspec.json.decode(data, type=WorkerSpec)
