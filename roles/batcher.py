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

from transport.params import lora_key


@dataclass
class _Entry:
    inputs: dict
    params: dict
    key: object
    progress: object
    future: Future = field(default_factory=Future)
    state: object = None
    #: this request's share of device time: each step's time divided by the batch size
    device_s: float = 0.0


class StepBatcher:
    """Runs the denoising loops of up to `max_batch` same-shape requests as one batch."""

    def __init__(self, adapter, max_batch: int, sync=None, loras=None):
        self.adapter = adapter
        #: the instance's LoRA adapters (roles/loras.py): each step's forward applies its batch's own
        self.loras = loras
        #: waits for the device to finish what a step queued (a GPU's kernels are asynchronous), so each
        #: step's time, and every request's share of it, is the device's time and not the launch time
        self.sync = sync or (lambda: None)
        self.max_batch = max_batch
        self._waiting: deque[_Entry] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        #: batch size -> steps run at that size so far (heartbeats carry it; /metrics shows it)
        self.batch_sizes: collections.Counter[int] = collections.Counter()

    def denoise(self, inputs: dict, params: dict, progress=None) -> tuple[dict, float]:
        """Blocks until this request is denoised; returns (output tensors, its share of device seconds)."""
        # a batch holds one shape and one set of adapters
        entry = _Entry(inputs, params, (self.adapter.batch_key(params), lora_key(params.get("loras"))), progress)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._drive, name="batcher", daemon=True)
                self._thread.start()
            self._waiting.append(entry)
            self._cond.notify()
        return entry.future.result(), entry.device_s

    def _admit(self, active: list[_Entry]) -> list[_Entry]:
        """Waiting requests that join now: the head's shape (or the running one's), in arrival order."""
        joining = []
        with self._cond:
            while not active and not self._waiting:
                self._cond.wait()
            key = active[0].key if active else self._waiting[0].key
            while self._waiting and len(active) + len(joining) < self.max_batch and self._waiting[0].key == key:
                joining.append(self._waiting.popleft())
        return joining

    def _drive(self) -> None:
        active: list[_Entry] = []
        while True:
            for entry in self._admit(active):
                t0 = time.perf_counter()
                try:
                    entry.state = self.adapter.denoise_start(entry.inputs, entry.params)
                    self.sync()
                except Exception as exc:  # that request's error only
                    entry.future.set_exception(exc)
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
                        e.future.set_exception(exc)
                    active = [e for e in active if e not in running]
                    continue
                share = (time.perf_counter() - t0) / len(running)
                self.batch_sizes[len(running)] += 1
                for e in running:
                    e.device_s += share
                    if e.progress:
                        try:
                            e.progress()
                        except Exception as exc:  # cancelled: that request leaves the batch, the rest go on
                            e.future.set_exception(exc)
                            active.remove(e)
            still = []
            for e in active:
                if not e.state.done:
                    still.append(e)
                    continue
                try:
                    e.future.set_result(self.adapter.denoise_result(e.state))
                except Exception as exc:
                    e.future.set_exception(exc)
            active = still
