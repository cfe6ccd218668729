"""Continuous batching for the denoiser: requests of one shape share each forward, joining at step boundaries.

Executor threads (one per slot) pull their inputs in parallel and then hand the request to the
batcher and wait. One driver thread runs the steps: before every step it admits waiting requests
of the running batch's shape (up to `max_batch`), runs one batched step through the adapter, and
hands finished requests back. A request of another shape waits until the running batch drains;
admission is first come first served, so it is not starved.

The adapter supplies the step-level API:
    batch_key(p) -> hashable           requests with equal keys may share a forward
    denoise_start(inputs, p) -> state  prepares one request (its latents, schedule); state.done
    denoise_steps(states) -> None      one step for every state, as one batched forward
    denoise_result(state) -> tensors   the request's output once state.done
"""

from __future__ import annotations

import collections
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from disagg.common.averages import ewma
from disagg.common.urgency import order as urgency_order
from disagg.settings.choices import Schedule
from disagg.settings.fields import default
from disagg.transport.wire.params import lora_key


@dataclass(eq=False)  # compared by identity: its fields hold tensors
class _Entry:
    inputs: dict
    params: dict
    key: object
    progress: object
    future: Future = field(default_factory=Future)
    state: object = None
    #: this request's share of device time: each step's time divided by the batch size
    device_s: float = 0.0
    #: schedule slo: its priority, deadline and steps (disagg/roles/turns.py); None under fifo
    ticket: object = None
    #: its step cache (disagg/roles/extensions/step_cache.py): the spec, its step count while it runs, and the hooks' exit
    cache: dict | None = None
    count: object = None
    cache_exit: object = None


class StepBatcher:
    """Runs the denoising loops of up to `max_batch` same-shape requests as one batch."""

    def __init__(self, adapter, max_batch: int, sync=None, loras=None, schedule: Schedule = default("schedule.order"),
                 aging_s: float = default("schedule.aging_s"), caches=None, memory_limit=None):
        self.adapter = adapter
        #: the transformer's step caches: a request with one runs alone, its steps back to back
        self.caches = caches
        #: the instance's LoRA adapters (disagg/roles/extensions/loras.py): each step's forward applies its batch's own
        self.loras = loras
        #: waits for the device to finish what a step queued (a GPU's kernels are asynchronous), so each
        #: step's time, and every request's share of it, is the device's time and not the launch time
        self.sync = sync or (lambda: None)
        self.max_batch = max_batch
        #: where the adapter knows its device's memory (Capabilities.memory_model, the Stage passes its batch_limit):
        #: the most requests like one a batch may hold there (0: no limit); a batch is never formed past it
        self.memory_limit = memory_limit or (lambda p: 0)
        self._waiting: deque[_Entry] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        #: batch size -> steps run at that size so far (heartbeats carry it; /metrics shows it)
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        #: fifo: a batch runs until its requests finish, joined by waiting ones of its key. slo: the batch is
        #: formed again before every step: the most urgent request and the most urgent others of its key
        self.schedule = schedule
        self.aging_s = aging_s
        #: key -> moving average of one step's seconds (a request's slack counts its steps left at it)
        self.step_s: dict[object, float] = {}

    def most(self, params: dict) -> int:
        """The most requests like `params` one batch holds: max_batch, less where the device's memory says so."""
        limit = self.memory_limit(params)
        return min(self.max_batch, limit) if limit else self.max_batch

    def denoise(self, inputs: dict, params: dict, progress=None, ticket=None) -> tuple[dict, float, dict]:
        """Blocks until this request is denoised; returns (output tensors, its share of device seconds, its step
        cache's label and counts: disagg/roles/stage.py StageOutput.cache_steps)."""
        # a batch holds one shape and one set of adapters; a request with a step cache is a batch of its own
        cache = params.get("cache")
        entry = _Entry(inputs, params, (self.adapter.batch_key(params), lora_key(params.get("loras")),
                                        object() if cache else None), progress, ticket=ticket, cache=cache)
        with self._cond:
            if self._thread is None:
                drive = self._drive_slo if self.schedule == Schedule.SLO else self._drive
                self._thread = threading.Thread(target=drive, name="batcher", daemon=True)
                self._thread.start()
            self._waiting.append(entry)
            self._cond.notify()
        result = entry.future.result()
        counted = {}
        if entry.count is not None:
            from disagg.transport.wire.params import cache_label

            counted = {"cache": cache_label(cache), **entry.count.as_dict()}
        return result, entry.device_s, counted

    def _start(self, e: _Entry) -> None:
        """A request's denoising starts: its step cache's hooks first (they stay until it finishes)."""
        if e.cache is not None:
            import contextlib

            stack = contextlib.ExitStack()
            e.count = stack.enter_context(self.caches.use(
                e.cache, e.params["num_inference_steps"], lambda: e.state.timesteps[min(e.state.i, len(e.state.timesteps) - 1)]))
            e.cache_exit = stack
        e.state = self.adapter.denoise_start(e.inputs, e.params)

    def _stepped(self, batch: list[_Entry]) -> None:
        for e in batch:
            if e.count is not None:
                e.count.step()

    @staticmethod
    def _settle(e: _Entry, result=None, exc: BaseException | None = None) -> None:
        """Hand a request back, its step cache's hooks removed first."""
        if e.cache_exit is not None:
            e.cache_exit.close()
            e.cache_exit = None
        if exc is not None:
            e.future.set_exception(exc)
        else:
            e.future.set_result(result)

    def _admit(self, active: list[_Entry]) -> list[_Entry]:
        """Waiting requests that join now: the head's shape (or the running one's), in arrival order."""
        joining = []
        with self._cond:
            while not active and not self._waiting:
                self._cond.wait()
            head = active[0] if active else self._waiting[0]
            key, most = head.key, self.most(head.params)
            while self._waiting and len(active) + len(joining) < most and self._waiting[0].key == key:
                joining.append(self._waiting.popleft())
        return joining

    def _drive(self) -> None:
        active: list[_Entry] = []
        while True:
            for entry in self._admit(active):
                t0 = time.perf_counter()
                try:
                    self._start(entry)
                    self.sync()
                except Exception as exc:  # that request's error only
                    self._settle(entry, exc=exc)
                    continue
                entry.device_s += time.perf_counter() - t0
                active.append(entry)
            if not active:
                continue
            running = [e for e in active if not e.state.done]
            if running:
                if self.loras is not None:
                    self.loras.set_thread_key(running[0].key[1])
                t0 = time.perf_counter()
                try:
                    self.adapter.denoise_steps([e.state for e in running])
                    self.sync()
                except Exception as exc:  # a failed forward fails every request in it
                    for e in running:
                        self._settle(e, exc=exc)
                    active = [e for e in active if e not in running]
                    continue
                self._stepped(running)
                share = (time.perf_counter() - t0) / len(running)
                self.batch_sizes[len(running)] += 1
                for e in running:
                    e.device_s += share
                    if e.progress:
                        try:
                            e.progress(self.adapter.denoise_result(e.state))  # the latents: for a preview
                        except Exception as exc:  # cancelled: that request leaves the batch, the rest go on
                            self._settle(e, exc=exc)
                            active.remove(e)
            still = []
            for e in active:
                if not e.state.done:
                    still.append(e)
                    continue
                try:
                    self._settle(e, self.adapter.denoise_result(e.state))
                except Exception as exc:
                    self._settle(e, exc=exc)
            active = still

    # --- schedule slo: the batch formed again at every step, by urgency --------------------------------------

    def _left_s(self, e: _Entry) -> float:
        return e.ticket.left_s(self.step_s.get(e.key, 0.0)) if e.ticket is not None else 0.0

    def _drive_slo(self) -> None:
        held: list[_Entry] = []  # every request handed over and not finished, started or not
        while True:
            try:
                self._step_slo(held)
            except Exception as exc:  # a fault of the driver itself: fail what it holds, never hang it
                for e in held:
                    if not e.future.done():
                        self._settle(e, exc=exc)
                held.clear()

    def _step_slo(self, held: list[_Entry]) -> None:
        """One step of the slo driver: take what was handed over, form the batch, run one step."""
        with self._cond:
            while not held and not self._waiting:
                self._cond.wait()
            held.extend(self._waiting)
            self._waiting.clear()
        now = time.monotonic()
        for e in held:
            if e.ticket is not None and e.ticket.waiting_since is None:
                e.ticket.waiting_since = now
        order = urgency_order(held, now, self.aging_s, ticket_of=lambda e: e.ticket, left_s=self._left_s)
        # a started request with a step cache keeps the device to its last step (its state is in the hooks)
        pinned = [e for e in order if e.cache is not None and e.state is not None and not e.state.done]
        batch = pinned[:1] or [e for e in order if e.key == order[0].key][:self.most(order[0].params)]
        stepping = []
        for e in batch:
            if e.state is None:
                t0 = time.perf_counter()
                try:
                    self._start(e)
                    self.sync()
                except Exception as exc:  # that request's error only
                    self._settle(e, exc=exc)
                    held.remove(e)
                    continue
                e.device_s += time.perf_counter() - t0
            if e.state.done:
                self._finish(e)
                held.remove(e)
                continue
            stepping.append(e)
        if not stepping:
            return
        if self.loras is not None:
            self.loras.set_thread_key(stepping[0].key[1])
        t0 = time.perf_counter()
        try:
            self.adapter.denoise_steps([e.state for e in stepping])
            self.sync()
        except Exception as exc:  # a failed forward fails every request in it
            for e in stepping:
                self._settle(e, exc=exc)
                held.remove(e)
            return
        took = time.perf_counter() - t0
        self._stepped(stepping)
        # one request's step time at this batch size stands for the key's (the slack estimate's unit)
        self.step_s[stepping[0].key] = ewma(self.step_s.get(stepping[0].key), took)
        share = took / len(stepping)
        self.batch_sizes[len(stepping)] += 1
        for e in stepping:
            e.device_s += share
            if e.ticket is not None:
                e.ticket.done += 1
                e.ticket.waiting_since = None
            if e.progress:
                try:
                    e.progress(self.adapter.denoise_result(e.state))  # the latents: for a preview
                except Exception as exc:  # cancelled: that request leaves, the rest go on
                    self._settle(e, exc=exc)
                    held.remove(e)
                    continue
            if e.state.done:
                self._finish(e)
                held.remove(e)

    def _finish(self, e: _Entry) -> None:
        try:
            self._settle(e, self.adapter.denoise_result(e.state))
        except Exception as exc:
            self._settle(e, exc=exc)
