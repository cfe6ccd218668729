"""The compute side of a role: pull inputs, run the stage, stage outputs; runs on executor threads.

It owns the staged-output bookkeeping and the transfer engines; it talks to the socket loop only through the
`report` callable, so it can be driven without any socket.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import msgspec

from disagg.roles.errors import GroupBroken, RequestError
from disagg.roles.extensions.lora_backends import LoraError
from disagg.roles.meter import BusyMeter
from disagg.roles.stage import Stage, StageOutput
from disagg.transport.data.allocator import PoolFull
from disagg.transport.data.engines import TransferEngine, TransferError
from disagg.transport.data.manifest import unpack
from disagg.transport.data.pool import Pool
from disagg.transport.wire.messages import (
    Dead,
    Done,
    ErrorCode,
    Failed,
    Fetched,
    Forward,
    Held,
    HeldPreview,
    Preview,
    Run,
    Staged,
    cache_report,
)

log = logging.getLogger("disagg.role")

#: computes shorter than this (mean of the last 32) fold their Fetched report into Staged / Done
FOLD_FETCHED_BELOW_S = 0.002
#: when each of the last 32 computes took less than this, a role runs the next ones on its loop thread
RUN_INLINE_BELOW_S = 0.005
#: a decoder keeps its Done messages this long (and at most this many bytes): one its orchestrator took
#: and died with before the Result left is sent again to the next one (disagg/orchestrator/parts/recovery.py)
KEEP_RESULTS_S = 10.0
KEEP_RESULTS_BYTES = 64 * 2**20
#: attempts withdrawn before they ran here, remembered (Withdraw)
MAX_WITHDRAWN = 4096


def preview_steps(steps: int, previews: int) -> dict[int, int]:
    """The steps after which a request's previews are staged -> their index: evenly spaced, never the last."""
    at = sorted({max(1, round(steps * (i + 1) / (previews + 1))) for i in range(previews)} - {steps})
    return {s: i for i, s in enumerate(at)}


class Cancelled(Exception):
    """The request's client gave it up (Cancel): its compute stops at the next step."""


def failure_code(exc: Exception) -> tuple[ErrorCode, bool]:
    """A failed compute's code and whether another attempt may go better, by the exception's type (errors.py):
    the request's fault is invalid_input; a dead peer or a momentarily full pool may go better on another try; a
    model error not."""
    if isinstance(exc, RequestError):
        return ErrorCode.INVALID_INPUT, False
    if isinstance(exc, TransferError) or (isinstance(exc, PoolFull) and exc.transient):
        return ErrorCode.GENERATION_FAILED, True
    return ErrorCode.GENERATION_FAILED, False


class StageRunner:
    """Runs Run messages against a Stage, a Pool and the transfer engines."""

    def __init__(self, instance_id: str, pool: Pool, engines: dict[str, TransferEngine], report: Callable):
        self.instance_id = instance_id
        self.pool = pool
        self.engines = engines
        self.report = report
        self.stage: Stage | None = None
        self.lock = threading.Lock()  # guards `staged`: executor threads add, the loop releases
        #: grows with every stage start, step and end: the orchestrator's stall detector reads it
        self.progress = 0
        #: request id -> attempt of what is computing now
        self.busy: dict[str, int] = {}
        #: grows with every Register (`registered`): a Run handed over before it that has not started by then is
        #: not run (the orchestrator it registers with knows of it from nothing: it places that request itself)
        self.epoch = 0
        #: request id -> attempt its client cancelled: its compute stops at its next step
        self.cancelled: dict[str, int] = {}
        #: request id -> [done, total] denoising steps of what runs now (heartbeats carry it)
        self.steps: dict[str, list[int]] = {}
        #: outputs staged here and not yet released, by offset (every Register lists them)
        self.staged: dict[int, Held] = {}
        #: recent Done messages and their frames: (when, message, frames), oldest first
        self.finished: collections.deque[tuple[float, Done, list[bytes]]] = collections.deque()
        self._finished_bytes = 0
        #: stages finished since the process started (heartbeats carry it)
        self.computed = 0
        self.meter = BusyMeter()
        #: a parallel instance whose ranks lost each other: the worker exits (disagg/roles/parallel.py)
        self.broken = False
        #: the last computes' times (short_computes and fold_fetched read them)
        self.recent: collections.deque[float] = collections.deque(maxlen=32)
        #: sends a Forward (Run.then) on to its instance, after the Staged that says so (disagg/roles/peers.py)
        self.forward: Callable[[Forward], None] | None = None
        #: (request id, attempt) withdrawn before it ran here (Withdraw): not run when its Forward comes
        self.withdrawn: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()

    @property
    def short_computes(self) -> bool:
        """Every recent compute was short: running the next ones on the socket loop's own thread, one after
        another, costs less than waking compute threads for them (the loop bounds how long it does so)."""
        return len(self.recent) == self.recent.maxlen and max(self.recent) < RUN_INLINE_BELOW_S

    @property
    def fold_fetched(self) -> bool:
        """Fold Fetched into the Staged / Done that follows when computes are this short: the producer's
        slot is then freed a moment later, and the request saves a control message."""
        return bool(self.recent) and sum(self.recent) / len(self.recent) < FOLD_FETCHED_BELOW_S

    def tick(self, *_args) -> None:
        self.progress += 1

    def cancel(self, request_id: str, attempt: int) -> bool:
        """Stop that request at its next step (or before its compute starts); False if not here."""
        if self.busy.get(request_id) != attempt:
            return False
        self.cancelled[request_id] = attempt
        if self.stage is not None and self.stage.turns is not None:
            self.stage.turns.wake()  # one waiting for the device stops waiting now
        return True

    def withdraw(self, request_id: str, attempt: int) -> bool:
        """The orchestrator takes back a forwarded Run (Withdraw): True if it runs now (it stops at its next step and
        reports, cancelled); False: it is not running, and will not run if its Forward comes later."""
        with self.lock:  # (execute marks a run busy under it: either it runs now, or it sees this)
            if self.busy.get(request_id) != attempt:
                self.withdrawn[(request_id, attempt)] = None
                while len(self.withdrawn) > MAX_WITHDRAWN:
                    self.withdrawn.popitem(last=False)
                return False
        self.cancel(request_id, attempt)  # (one that ended meanwhile has reported: that report answers)
        return True

    def check_cancelled(self, run: Run) -> None:
        if self.cancelled.get(run.request_id) == run.attempt:
            raise Cancelled(f"request {run.request_id} was cancelled by its client")

    def steps_of(self, run: Run) -> int:
        return run.params.num_inference_steps or self.stage.adapter.defaults().get("num_inference_steps", 0)

    def _stepper(self, run: Run):
        """The progress callback of one run: a denoising step counted (for the stall detector and the
        request's own progress), the point where a cancelled run stops, and where a preview is staged: the
        callback's argument, where the adapter gives one, is the latents after the step."""
        done = [0, self.steps_of(run)]
        if self.stage.role in ("denoiser", "monolith"):  # the roles that denoise report their steps
            self.steps[run.request_id] = done
        at = preview_steps(done[1], run.params.previews or 0) if self.stage.role == "denoiser" and \
            self.stage.caps.previews else {}

        def step(*args) -> None:
            self.progress += 1
            done[0] += 1
            self.check_cancelled(run)
            if done[0] in at and args and isinstance(args[0], dict):
                self.stage_preview(run, at[done[0]], done[0], done[1], args[0])
        return step

    def stage_preview(self, run: Run, index: int, step: int, steps: int, latents: dict) -> None:
        """Stage a copy of the latents and tell the orchestrator (Preview); a full pool skips the preview."""
        try:
            slot = self.pool.stage(self.instance_id, {k: v for k, v in latents.items() if hasattr(v, "dtype")})
        except PoolFull:
            return
        with self.lock:
            staged_at = time.time()
            self.staged[slot.offset] = Held(request_id=run.request_id, attempt=run.attempt, role=self.stage.role,
                                            slot=slot, seed=run.params.seed,
                                            preview=HeldPreview(index=index, step=step, steps=steps, staged_at=staged_at))
        extra = [self.inline_bytes(slot)] if run.inline_output else []
        self.report(Preview(request_id=run.request_id, attempt=run.attempt, index=index, step=step, steps=steps, slot=slot,
                            staged_at=staged_at), extra)

    def release(self, offset: int, request_id: str | None = None) -> bool:
        """Free the output staged at `offset`; False if none is, or it is another request's than
        `request_id`: a stale Release (sent twice, once before this role was declared dead and once
        after) must never free a newer output that reuses the offset."""
        with self.lock:
            held = self.staged.get(offset)
            if held is None or (request_id is not None and held.request_id != request_id):
                return False
            del self.staged[offset]
            self.pool.free(offset)
            return True

    def keep_result(self, done: Done, frames: list[bytes]) -> None:
        """Keep a Done for a while: the orchestrator may die before its Result reaches the client."""
        now = time.monotonic()
        with self.lock:
            self.computed += 1
            self.finished.append((now, done, list(frames)))
            self._finished_bytes += sum(map(len, frames))
            while self.finished and (self.finished[0][0] < now - KEEP_RESULTS_S or self._finished_bytes > KEEP_RESULTS_BYTES):
                self._finished_bytes -= sum(map(len, self.finished.popleft()[2]))

    def recent_results(self) -> list[tuple[Done, list[bytes]]]:
        horizon = time.monotonic() - KEEP_RESULTS_S
        with self.lock:
            return [(done, frames) for t, done, frames in self.finished if t >= horizon]

    def inline_bytes(self, slot) -> bytes:
        """A staged slot's bytes for a ZeroMQ frame (from a GPU pool on its copy stream)."""
        view = self.pool.view(slot.offset, slot.nbytes)
        if view.device.type == "cpu":
            return view.numpy().tobytes()
        host = self.pool.host_buffer(slot.nbytes)  # pinned: one DMA, on this thread's copy stream
        with self.pool.copying():
            host.copy_(view, non_blocking=True)
        return host.numpy().tobytes()

    def registered(self) -> tuple[dict[str, int], list[Held]]:
        """What a Register lists (what computes, what is staged), and from now on a Run handed over before it
        does not start: once an orchestrator restarted, or declared this instance dead, a Run of before that had
        not started is one it will place again itself (running it too would run the request twice, and its
        Fetched would free the input the other run still reads)."""
        with self.lock:
            self.epoch += 1
            return dict(self.busy), list(self.staged.values())

    def execute(self, run: Run, frames: list[bytes], received: float, epoch: int | None = None) -> None:
        """Pull, compute, stage, report. `received`: when the loop got the Run (fetch_s counts from it); `epoch`:
        `self.epoch` then (a Run of before the last Register is dropped, see `registered`)."""
        with self.lock:
            stale = epoch is not None and epoch != self.epoch
            withdrawn = (run.request_id, run.attempt) in self.withdrawn
            if not (stale or withdrawn):
                self.busy[run.request_id] = run.attempt
            epoch = self.epoch  # a Run.then is sent on only while it is still this registration's (_deliver)
        if stale or withdrawn:
            log.info("request %s attempt %d: not run: %s", run.request_id, run.attempt,
                     "withdrawn by the orchestrator" if withdrawn else
                     "handed over before this instance registered again")
            self.report(None)
            return
        self.tick()
        local = []  # the input's slot in this instance's pool, once allocated
        lora_s, pinned = 0.0, []
        fetched = False
        busy_from = self.meter.enter()
        try:
            inputs, fetch_s = self._fetch(run, frames, received, local)
            fetched = True
            if run.params.loras and self.stage.role != "decoder":  # loaded while another request computes
                lora_s, pinned = self._acquire_loras(run), [r.name for r in run.params.loras]
            out, ticket, computed, compute_s = self._compute(run, inputs)
            if pinned:  # its adapters are free to unload before the report lets the next request in
                self.stage.loras.release(pinned)
                pinned = []
            self.recent.append(compute_s)
            # a batched forward knows each request's share itself; else the meter splits the busy time
            share = self.meter.leave(busy_from)
            busy_from = None
            if out.device_s is not None:
                device_s = out.device_s
            else:  # under schedule slo the device was this request's while it held the turn
                device_s = ticket.held_s if ticket is not None and self.stage.turns is not None else share
            self._deliver(run, out, computed, dict(compute_s=compute_s, fetch_s=fetch_s, device_s=device_s,
                                                   lora_s=lora_s), epoch)
        except Exception as exc:  # the request's failure: report it and keep serving
            self._failed(run, exc, source_lost=not fetched and isinstance(exc, TransferError))
        finally:
            if pinned:
                self.stage.loras.release(pinned)
            if busy_from is not None:
                self.meter.leave(busy_from)
            if local:
                self.pool.free(local[0])
            self.busy.pop(run.request_id, None)
            self.cancelled.pop(run.request_id, None)
            self.steps.pop(run.request_id, None)
            self.tick()
            self.report(None)

    def _fetch(self, run: Run, frames: list[bytes], received: float, local: list) -> tuple[dict, float | None]:
        """The Run's inputs read into this instance's pool (its slot appended to `local`), and fetch_s where the
        Fetched report is folded into the Staged / Done that follows (else it is sent now)."""
        if run.source is None:
            return {}, None
        nbytes = run.source.slot.nbytes
        local.append(self.pool.alloc(nbytes))
        dst = self.pool.view(local[0], nbytes)
        engine = self.engines.get(run.source.engine)
        if engine is None:
            raise TransferError(f"transfer engine {run.source.engine!r} is not available here")
        engine.read(run.source, dst, frames)
        inputs = unpack(dst, run.source.slot.tensors)
        fetch_s = time.perf_counter() - received
        if self.fold_fetched:
            return inputs, fetch_s
        # tell now, so the producer's slot is freed while we compute
        self.report(Fetched(request_id=run.request_id, attempt=run.attempt, fetch_s=fetch_s))
        return inputs, None

    def _acquire_loras(self, run: Run) -> float:
        """Load the request's LoRA adapters (pinned until `release`); the seconds it took."""
        bank = self.stage.loras
        if bank is None:
            raise LoraError(f"model {self.stage.model!r} takes no LoRA adapters"
                            + (" on an instance over several ranks" if self.stage.group is not None else ""))
        return bank.acquire(run.params.loras, run.lora_sources)

    def _compute(self, run: Run, inputs: dict):
        """The stage's compute, in its turn: (output, ticket, the pool's mark where it ended, compute_s)."""
        step = self._stepper(run)
        ticket = self.stage.ticket(run.request_id, run.params, run.stage_deadline_s, self.steps_of(run))
        if ticket is not None:
            ticket.check = lambda: self.check_cancelled(run)
        # one compute at a time where the pipeline keeps per-call state; under schedule slo the most urgent
        # held request's, handed over at step boundaries (disagg/roles/turns.py)
        with self.stage.turns.hold(ticket) if self.stage.turns is not None else self.stage.turn:
            self.check_cancelled(run)  # cancelled while it waited for its input or turn: stop now
            t0 = time.perf_counter()
            out = self.stage.run(run.params, inputs, step, ticket)
            # where this request's compute ends: its outputs are staged after it, not after whatever other
            # requests queued on the device since (GPU kernels are asynchronous: the time counts until they finish)
            computed = self.pool.mark()
            self.pool.compute_done(computed)
            compute_s = time.perf_counter() - t0
        return out, ticket, computed, compute_s

    def _deliver(self, run: Run, out: StageOutput, computed, times: dict, epoch: int | None = None) -> None:
        """A decoder's images as Done (kept a while), another role's tensors staged for the next (Staged), and
        the next stage's Run sent on to the instance reserved for it (Run.then), while this is still the
        registration `epoch` the Run came to."""
        if out.images:
            done = Done(request_id=run.request_id, attempt=run.attempt, num_images=len(out.images),
                        image_format=out.image_format, resolved={**out.resolved, **out.cache_steps, **run.carry},
                        **times)
            self.keep_result(done, out.images)
            self.report(done, out.images)
            return
        slot = self.pool.stage(self.instance_id, out.tensors, after=computed)
        with self.lock:
            self.computed += not out.from_cache  # a conditioning-cache hit computed nothing
            self.staged[slot.offset] = Held(request_id=run.request_id, attempt=run.attempt, role=self.stage.role,
                                            slot=slot, seed=run.params.seed, **out.cache_steps)
        extra = [self.inline_bytes(slot)] if run.inline_output else []
        staged = Staged(request_id=run.request_id, attempt=run.attempt, slot=slot, **times, **out.cache_steps)
        then = run.then if self.forward is not None and not run.inline_output and epoch == self.epoch else None
        staged.forwarded = then is not None
        self.report(staged, extra)
        if then is not None:  # after the Staged: the orchestrator learns where it went before it hears from there
            self.forward(self.forward_of(then, staged))

    @staticmethod
    def forward_of(then: Forward, staged: Staged) -> Forward:
        """`then` with its Run reading the slot `staged` names (and a decoder's carrying its step-cache report)."""
        run = then.run
        carry = {**run.carry, **cache_report(staged)} if staged.steps_computed is not None else run.carry
        source = msgspec.structs.replace(run.source, slot=staged.slot)
        return msgspec.structs.replace(then, run=msgspec.structs.replace(run, source=source, carry=carry))

    def _failed(self, run: Run, exc: Exception, source_lost: bool = False) -> None:
        """Report a failed compute, by the exception's type (errors.py); the instance keeps serving. `source_lost`:
        it failed pulling its input (Failed.source_lost)."""
        if isinstance(exc, Cancelled):  # nobody waits for it: free the slot, no retry
            self.report(Failed(request_id=run.request_id, attempt=run.attempt, error=str(exc), retryable=False,
                               code=ErrorCode.CANCELLED))
            return
        if isinstance(exc, GroupBroken):  # a parallel instance whose ranks lost each other (parallel.py)
            # it cannot serve: say so before anything else, so its work (this request too) moves at once
            # instead of failing here again; the worker then exits and the launcher restarts all its ranks
            log.error("%s; this instance stops", exc)
            self.report(Dead(instance_id=self.instance_id, reason=str(exc)))
            self.broken = True
            return
        code, retryable = failure_code(exc)
        invalid = code is ErrorCode.INVALID_INPUT  # the request's fault: one line, no traceback
        log.log(logging.INFO if invalid else logging.WARNING, "request %s attempt %d failed: %s: %s",
                run.request_id, run.attempt, type(exc).__name__, exc, exc_info=not (retryable or invalid))
        self.report(Failed(request_id=run.request_id, attempt=run.attempt, error=f"{type(exc).__name__}: {exc}",
                           retryable=retryable, code=code, param=exc.param if invalid else None,
                           source_lost=source_lost))
