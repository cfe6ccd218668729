"""The worker runtime shared by all three roles: register, heartbeat, receive work, report.

One thread owns the link to the orchestrator (disagg/roles/link.py: the DEALER socket, the same-host fast
lane once the orchestrator welcomes us on it) and the poll loop; what it sends in one turn leaves together at the
end of the turn (one Bundle). Compute and transfers run on a pool of `capacity` threads
(disagg/roles/compute.py) that send their reports on their own sockets, so the loop never blocks on a
model; computes that all took microseconds run on the loop thread itself. The loop also watches
the orchestrator: if it goes silent the role reconnects and registers again, with backoff, and
exits only after a long grace period.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zmq

from disagg.roles.boot import PROGRESS as BOOT
from disagg.roles.boot import BootMeter, test_hold
from disagg.roles.boot import phase as boot_phase
from disagg.roles.compute import StageRunner
from disagg.roles.limits import model_limits, served_model
from disagg.roles.link import Link
from disagg.roles.peers import PeerLink, Peers
from disagg.roles.reports import SelfReport
from disagg.roles.spec import WorkerSpec
from disagg.transport.data.engines import EngineOptions, TransferEngine, make_engines
from disagg.transport.data.pool import Pool
from disagg.transport.parent import LauncherWatch
from disagg.transport.wire.auth import client_curve
from disagg.transport.wire.bundle import Outbox, decode_frames
from disagg.transport.wire.lane import LaneLink
from disagg.transport.wire.messages import (
    BOOT_ERROR_EXIT,
    HEARTBEAT_INTERVAL_S,
    MOVE_EXIT,
    Alive,
    Cancel,
    Dead,
    ErrorCode,
    Failed,
    MessageError,
    OrchestratorCommand,
    Registered,
    Rejected,
    Release,
    Run,
    Shutdown,
    Withdraw,
    encode,
)
from disagg.transport.wire.role_stats import CompileStats

RECONNECT_MAX_BACKOFF_S = 5.0
#: a refusal as "not registered" within this long of a Register is answered by it, not by another Register
REGISTER_AGAIN_S = 0.5
REPORTS = "inproc://reports"
#: the most time one pass over the inbox spends before the loop looks at its heartbeat again
INLINE_BUDGET_S = 0.1


class Worker(Link, PeerLink, SelfReport):
    """Drives a StageRunner from the orchestrator's messages."""

    def __init__(self, spec: WorkerSpec, load_stage, pool: Pool):
        self.spec = spec
        self.load_stage = load_stage
        self.exit_code = 0
        self.register_sent = -REGISTER_AGAIN_S
        self.pool = pool
        self.log = logging.getLogger("disagg.role")
        options = EngineOptions(spec.data_host, spec.transfer_protocol, spec.ib_device, tuple(spec.visible_gpus))
        #: engines that apply to our pool but could not start, and why (every Register tells them: status shows them)
        self.engine_problems: dict[str, str] = {}
        self.engines: dict[str, TransferEngine] = make_engines(pool, spec.transfer, options, self.log, self.engine_problems)
        self.ctx = zmq.Context()
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.bind(REPORTS)
        self._local = threading.local()
        self._loop_ident = threading.get_ident()  # built on the thread that runs serve_forever
        self._dealers: list[zmq.Socket] = []
        self._dealers_lock = threading.Lock()
        self.runner = StageRunner(spec.instance_id, pool, self.engines, self.report)
        self.executor = ThreadPoolExecutor(max_workers=spec.capacity, thread_name_prefix=spec.instance_id)
        self.sock: zmq.Socket | None = None
        #: messages from the loop thread, sent together at the end of each loop turn
        self.outbox = Outbox()
        #: the orchestrator's same-host fast lane, once connected (disagg/transport/wire/lane.py)
        self.lane: LaneLink | None = None
        self.poller: zmq.Poller | None = None
        self.curve = client_curve(Path(spec.keys)) if spec.keys else None
        self.in_flight = 0
        self._count_lock = threading.Lock()
        self.ready = False
        #: its compile, once done (None: not compiled; its boot's phase and progress: disagg/roles/boot.py)
        self.compile: CompileStats | None = None
        self.components: dict[str, int] = {}
        #: the largest request the model makes, told to the orchestrator so it refuses larger ones at once
        self.limits = model_limits(spec.model)
        self.identity = served_model(spec.model, spec.dtype)
        self.orchestrator_id = ""
        #: this registration's number with that orchestrator (Registered.session): a Forward names the one it is for
        self.session = 0
        #: the peer lane: Forwards come in on it, and go out from it (disagg/roles/peers.py); None with lane off
        self.peers: Peers | None = None
        if spec.lane:
            try:
                self.peers = Peers(spec.instance_id, self.log)
            except OSError as exc:
                self.log.warning("no peer lane (%s): the orchestrator sends this instance every Run itself", exc)
        #: Forwards of this loop turn's computes, sent after its reports (PeerLink.send_forwards)
        self.pending_forwards: list = []
        if self.peers is not None:
            self.runner.forward = self.forward_run
        self.stop = False
        #: the launcher went away (killed): on the way out, clean what nobody else will
        self.orphaned = False
        self.launcher = LauncherWatch()
        self.last_heard = time.monotonic()
        self.backoff_s = HEARTBEAT_INTERVAL_S
        self.next_register = 0.0
        self._handlers = {
            Registered: self.handle_registered,
            Alive: self.handle_alive,
            Run: self.handle_run,
            Release: self.handle_release,
            Shutdown: self.handle_shutdown,
            Rejected: self.handle_rejected,
            Cancel: self.handle_cancel,
            Withdraw: self.handle_withdraw,
        }

    # --- socket side (loop thread only) ----------------------------------------------------

    def boot(self) -> None:
        """Load the model off the loop thread, so heartbeats go on while it loads; they carry the boot's phase and
        progress (disagg/roles/boot.py), so the launcher tells a slow boot from a stuck one."""
        meter = BootMeter(self.spec.model, self.spec.compile.cache_dir).start()
        try:
            if self.spec.compile.enabled:  # before the load: a mode that cannot serve here fails the boot at once
                from disagg.roles.extensions.compile import refuse_cudagraphs

                refuse_cudagraphs(self.spec.compile.mode, self.spec.device)
            boot_phase("loading", f"model {self.spec.model}")
            stage = self.load_stage()
            self.components = stage.adapter.components_loaded()
            test_hold(self.spec.instance_id)
            if self.spec.compile.enabled and stage.role in ("denoiser", "monolith"):
                from disagg.roles.boot import tick as boot_tick
                from disagg.roles.extensions.compile import CompileWatch, compile_stage

                boot_phase("compiling", f"torch.compile {self.spec.compile.mode}, warm-up at "
                           f"{', '.join(self.spec.compile.sizes) or 'the default size'}")
                # each warm-up (size, batch) and every TICK_S of it: the boot's detail, and progress
                self.compile = compile_stage(stage, self.spec.compile.mode, self.spec.compile.sizes,
                                               self.spec.compile.cache_dir, self.spec.compile.scope,
                                               hook=lambda what, s: boot_tick(f"{what} ({s:.0f} s so far)"))
                self.log.info("compiled in %.1f s", self.compile.seconds)
                CompileWatch(self.runner.tick).install()  # a compile inside a request is progress, and logged
            self.runner.stage = stage
        except BaseException as exc:  # noqa: BLE001 - any boot failure ends the process
            self.log.exception("cannot load the model")
            self.report(None, [f"{type(exc).__name__}: {exc}".encode()], kind=b"boot-failed")
        else:
            BOOT.done()
            self.report(None, kind=b"ready")
        finally:
            meter.stop()

    def serve_forever(self) -> None:
        threading.Thread(target=self.boot, name="boot", daemon=True).start()
        self.poller = poller = zmq.Poller()
        poller.register(self.reports, zmq.POLLIN)
        poller.register(self.sock, zmq.POLLIN)
        if self.lane is not None:
            poller.register(self.lane.fd, zmq.POLLIN)
        peers = self.peers
        if peers is not None:
            poller.register(peers.fileno(), zmq.POLLIN)
        next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
        while not self.stop:
            timeout_ms = max(0.0, next_beat - time.monotonic()) * 1000
            events = dict(poller.poll(timeout_ms))
            if self.reports in events:
                self.forward_reports()
            if self.lane is not None and self.lane.fd in events:
                self.drain_lane()
            if self.sock in events:
                self.drain_inbox()
            if peers is not None:
                self.drain_peers(events)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_INTERVAL_S
                sock = self.sock
                self.watch_orchestrator(now)
                if self.sock is not sock:  # reconnected: poll the new socket
                    poller.unregister(sock)
                    poller.register(self.sock, zmq.POLLIN)
                self.heartbeat()
                if self.launcher.gone():
                    self.log.warning("launcher is gone; exiting")
                    self.stop = self.orphaned = True
            self.flush()
            if self.runner.broken and not self.stop:  # its ranks lost each other: the launcher restarts them all
                self.exit_code, self.stop = 1, True
        self.close()

    def watch_orchestrator(self, now: float) -> None:
        """Reconnect with backoff when the orchestrator is silent; give up after the grace period."""
        silent = now - self.last_heard
        if silent > self.spec.orphan_grace_s:
            self.log.error("no word from the orchestrator for %.0f s; exiting", silent)
            self.exit_code, self.stop = 1, True
        elif silent > self.spec.timeouts.heartbeat and now >= self.next_register:
            self.log.warning("orchestrator silent for %.1f s; reconnecting", silent)
            self.connect()
            self.next_register = now + self.backoff_s
            self.backoff_s = min(self.backoff_s * 2, RECONNECT_MAX_BACKOFF_S)

    def drain_inbox(self) -> None:
        # bounded in count and time: computes run inline here must not hold back the heartbeat
        until = time.monotonic() + INLINE_BUDGET_S
        for _ in range(256):
            if time.monotonic() > until:
                return
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle_frames(frames)

    def handle_frames(self, frames: list) -> None:
        """One message from the orchestrator (or a bundle of them), by ZeroMQ or the lane."""
        self.last_heard = time.monotonic()
        try:
            items = decode_frames(frames, OrchestratorCommand)
        except MessageError as exc:
            items = [(exc, [])]
        for msg, rest in items:
            if isinstance(msg, MessageError):
                self.log.warning("dropped a bad message from the orchestrator: %s", msg)
                continue
            self._handlers[type(msg)](msg, rest)

    def forward_reports(self) -> None:
        for _ in range(256):
            try:
                frames = self.reports.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = frames[0]
            if kind == b"ready":
                self.ready = True
                self.log.info("model loaded; ready")
                self.heartbeat()
            elif kind == b"boot-failed":
                self.send_dead(f"boot failed: {frames[1].decode(errors='replace')}")
                self.exit_code, self.stop = BOOT_ERROR_EXIT, True
            else:
                self.send_frames(frames)

    def handle_registered(self, msg: Registered, frames) -> None:
        # what we hold went with the Register: the orchestrator resumes requests from it or releases it
        if self.orchestrator_id and msg.orchestrator_id != self.orchestrator_id:
            # a new orchestrator: results we sent the old one may have died with it before reaching their client
            results = self.runner.recent_results()
            for done, images in results:
                self.send(done, images)
            self.log.info("the orchestrator restarted; told the new one what we hold (%d outputs, %d recent results)",
                          len(self.runner.staged), len(results))
        self.orchestrator_id, self.session = msg.orchestrator_id, msg.session
        self.open_lane(msg.lane)
        self.backoff_s = HEARTBEAT_INTERVAL_S
        self.log.info("registered, session %d", msg.session)

    def handle_alive(self, msg: Alive, frames) -> None:
        if self.orchestrator_id and msg.orchestrator_id != self.orchestrator_id:
            self.log.warning("a different orchestrator answers; registering again")
            self.register()
            return
        for name in msg.forget_pools:  # their instances are gone: close our mappings of their pools
            self.log.info("closing the mapping of %s: its instance is gone", name)
            for engine in self.engines.values():
                engine.forget(name)

    def handle_rejected(self, msg: Rejected, frames) -> None:
        if msg.code == ErrorCode.FOREIGN_MODEL:
            # a deployment of another model: restarting would only be refused again
            self.log.error("refused: %s; exiting", msg.reason)
            self.exit_code, self.stop = BOOT_ERROR_EXIT, True
            return
        if msg.code == ErrorCode.FOREIGN_DEPLOYMENT:
            # our orchestrator is gone and another deployment's holds its port: never work for that one
            self.log.error("refused: %s; exiting", msg.reason)
            self.exit_code, self.stop = 1, True
            return
        self.log.warning("orchestrator rejected a message: %s", msg.reason)
        # every message sent before the Register is refused alike: one Register answers them all (a second one
        # would read as a restart of this instance); the next heartbeat's refusal asks again if it was lost
        if msg.code == ErrorCode.NOT_REGISTERED and time.monotonic() - self.register_sent >= REGISTER_AGAIN_S:
            self.register()

    def handle_run(self, msg: Run, frames) -> None:
        if self.runner.stage is None:
            self.send(Failed(request_id=msg.request_id, attempt=msg.attempt, error="model not loaded yet", retryable=True))
            return
        with self._count_lock:
            self.in_flight += 1
            inline = self.runner.short_computes
        if inline:  # computes here are all short: run it now rather than wake a compute thread for it
            self.runner.execute(msg, frames, time.perf_counter())
        else:
            self.executor.submit(self.runner.execute, msg, frames, time.perf_counter(), self.runner.epoch)

    def handle_cancel(self, msg: Cancel, frames) -> None:
        if msg.attempt is not None and self.runner.cancel(msg.request_id, msg.attempt):
            self.log.info("request %s cancelled; stopping it at its next step", msg.request_id)

    def handle_release(self, msg: Release, frames) -> None:
        if not self.runner.release(msg.offset, msg.request_id):
            self.log.warning("release of slot %d for %s ignored: nothing of that request is staged there",
                             msg.offset, msg.request_id)

    def handle_shutdown(self, msg: Shutdown, frames) -> None:
        self.log.info("shutdown requested%s", " (the device changes role)" if msg.move else "")
        if msg.move:
            self.exit_code = MOVE_EXIT
        self.stop = True

    # --- compute side (executor threads) ---------------------------------------------------

    def report(self, msg, frames=(), kind: bytes = b"finished") -> None:
        """Send a stage's report to the orchestrator straight from this compute thread (one hop
        fewer than through the loop), or hand a local event `kind` (msg None) to the loop thread."""
        if msg is None and kind == b"finished":  # counted here: waking the loop for it costs a hop
            with self._count_lock:
                self.in_flight -= 1
            return
        if msg is not None and threading.get_ident() == self._loop_ident:
            self.send(msg, frames)  # a compute run inline on the loop thread
            return
        if msg is not None and self.sock is not None:
            try:
                self._thread_dealer().send_multipart([encode(msg), *frames], zmq.NOBLOCK)
            except zmq.Again:
                self.log.warning("orchestrator not accepting messages; %s dropped", type(msg).__name__)
            return
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._local.push = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(REPORTS)
        sock.send_multipart([encode(msg) if msg is not None else kind, *frames])

    def close(self) -> None:
        self.flush()
        self.close_lane()
        if self.peers is not None:
            self.peers.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        for engine in self.engines.values():
            engine.close()
        if self.sock is not None:
            self.sock.close(linger=500)
        with self._dealers_lock:
            for sock in self._dealers:
                sock.close(linger=500)
        self.reports.close(linger=0)
        self.pool.close()

    def send_dead(self, reason: str) -> None:
        self.send(Dead(instance_id=self.spec.instance_id, reason=reason[:60_000]))


def install_signal_handlers(worker: Worker) -> None:
    def on_signal(*_):
        worker.stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

