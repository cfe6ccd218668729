"""The LoRA adapters one role instance holds, loaded with diffusers' own LoRA support (peft).

`LoraBank` keeps loaded adapters, bounded by `loras.slots` and `loras.max_mib`; the one it unloads for a new
one is the least used over its last USE_WINDOW x slots acquires, the least recently used among equals. With
`loras.host_slots`, an unloaded adapter moves to host memory instead (its weights copied off the device, its
layers kept), up to that many, the least recently unloaded forgotten first; a request for it copies it back
(a restore) rather than reading and installing its file again (a load). A request's
adapters are loaded when its Run arrives (`acquire`), on its executor thread: while another request
computes, so a load overlaps compute where capacity allows. They stay pinned until its compute ends.
What the model applies is set per forward: every forward of the modules that hold adapters runs under
one lock, after `set_adapters` with the adapters of the request whose thread calls it (`use`), so
requests with different adapters on one instance never see each other's weights. A batching denoiser
runs one batch's forwards on its driver thread; a batch holds one set of adapters (the batch key).

Backends (disagg/roles/extensions/lora_backends.py): `DiffusersLoras` (a pipeline's components: an adapter's text-encoder parts
load where the text encoders are, its transformer / UNet parts where the denoiser is) and `SimLoras` (sim
models: any name, `load_ms` per load, no files).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from contextlib import contextmanager

from disagg.common.averages import ewma
from disagg.roles.extensions.lora_backends import DiffusersLoras, LoraError, SimLoras
from disagg.roles.pipelines.adapter import LoraSupport
from disagg.transport.wire.role_stats import LoraStats

log = logging.getLogger("disagg.role")

__all__ = ["MAX_EMPTY", "USE_WINDOW", "LoraBank", "make_bank"]


#: how many of an instance's latest adapter acquires, per adapter slot, count towards which adapter it keeps: a
#: popular adapter is not unloaded for one a single request used (least used first, then least recently used;
#: BENCHMARKS.md, LoRA affinity)
USE_WINDOW = 32
#: the most adapters an instance holds as names only (no part for its components: an encoder and an adapter
#: without text-encoder parts), besides its slots; they take no slot, the oldest go past this many
MAX_EMPTY = 1024


class LoraBank:
    """The adapters one instance holds, the next to unload first, and the loads and hits so far."""

    def __init__(self, backend, slots: int, max_bytes: int, host_slots: int = 0):
        self.backend = backend
        self.slots = slots
        self.max_bytes = max_bytes
        #: adapters kept in host memory once unloaded from the device (0: none; a backend that cannot: none)
        self.host_slots = host_slots if getattr(backend, "offloads", False) else 0
        self.held: collections.OrderedDict[str, int] = collections.OrderedDict()  # name -> bytes
        #: adapters in host memory, the next to forget first: name -> bytes
        self.host: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.pins: collections.Counter[str] = collections.Counter()
        #: acquires of each adapter among the latest USE_WINDOW x slots (`recent`)
        self.uses: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[str] = collections.deque()
        #: held adapters with nothing loaded here (no part for this instance's components): known, so their files
        #: are not read again, and taking no slot
        self.empty: set[str] = set()
        self.loading: dict[str, threading.Event] = {}
        self.loads = 0
        self.hits = 0
        self.restores = 0
        #: seconds one load takes (moving average over its loads: reading the file and installing it), and one
        #: restore (copying an adapter back from host memory)
        self.load_s = 0.0
        self.restore_s = 0.0
        self._state = threading.Lock()  # held, pins, loading, counters
        self.model_lock = threading.Lock()  # the model's adapters: loads, unloads, set_adapters, forwards
        self._active: tuple | None = None
        self._local = threading.local()
        for module in backend.modules():
            self._guard(module)

    def names(self) -> list[str]:
        """Held adapters, the next to unload first, then those loading."""
        with self._state:
            return self._unload_order() + [n for n in self.loading if n not in self.held]

    def host_names(self) -> list[str]:
        """Adapters in host memory, the next to forget first."""
        with self._state:
            return list(self.host)

    def stats(self) -> LoraStats:
        """What its Register and heartbeats say of it: the adapters it holds (`names()`), those in host memory, its
        slots, and its loads, hits and restores so far."""
        with self._state:
            return LoraStats(held=self._unload_order() + [n for n in self.loading if n not in self.held],
                             slots=self.slots, loads=self.loads, hits=self.hits, load_s=round(self.load_s, 6),
                             names_only=len(self.empty), host=list(self.host), host_slots=self.host_slots,
                             restores=self.restores, restore_s=round(self.restore_s, 6))

    def _unload_order(self) -> list[str]:
        """Held adapters, least used over the window first, least recently used among equals (held's order)."""
        rank = {name: k for k, name in enumerate(self.held)}
        return sorted(self.held, key=lambda name: (self.uses[name], rank[name]))

    def _used(self, name: str) -> None:
        self.uses[name] += 1
        self.recent.append(name)
        if len(self.recent) > USE_WINDOW * max(self.slots, 1):
            old = self.recent.popleft()
            self.uses[old] -= 1
            if self.uses[old] <= 0:
                del self.uses[old]

    def acquire(self, loras, sources: dict[str, str]) -> float:
        """Load what of `loras` is not held yet and pin them all; the seconds it waited for loads."""
        names = [r.name for r in loras or ()]
        if not names:
            return 0.0
        t0 = time.perf_counter()
        pinned = []
        try:
            for name in names:
                self._acquire_one(name, sources.get(name, ""))
                pinned.append(name)
        except BaseException:
            self.release(pinned)
            raise
        return time.perf_counter() - t0

    def _acquire_one(self, name: str, source: str) -> None:
        while True:
            with self._state:
                if name in self.held:
                    self.held.move_to_end(name)
                    self.pins[name] += 1
                    self.hits += 1
                    self._used(name)
                    return
                wait = self.loading.get(name)
                if wait is None:
                    self.loading[name] = threading.Event()
                    offloaded = self.host.pop(name, None)
                    break
            wait.wait()  # another request loads it: then it is held (or failed: then try ourselves)
        t0 = time.perf_counter()
        if offloaded is not None:
            self._restore(name, offloaded, t0)
            return
        try:
            if not source and self.backend.components:
                raise LoraError(f"adapter {name!r}: no source given (the orchestrator did not resolve it)")
            state, nbytes = self.backend.read(name, source)
            empty = not state and bool(self.backend.components)
            swapped, into = False, None
            if empty:
                self._drop_empty()
            else:
                with self.model_lock:
                    into = self._make_room(nbytes)
                    swapped = self.backend.install(name, state, into=into)
                    self._active = None
            self._now_held(name, nbytes, t0, restored=False, empty=empty)
            log.info("loaded adapter %s (%.1f MiB)%s", name, nbytes / 2**20, f" in place of {into} (hotswap)" if swapped else "")
        finally:
            with self._state:
                self.loading.pop(name).set()

    def _now_held(self, name: str, nbytes: int, t0: float, restored: bool, empty: bool = False) -> None:
        """`name` is held (as a name only: `empty`), pinned once, loaded (or restored) since `t0`: count it, and its
        time in the average."""
        with self._state:
            if empty:
                self.empty.add(name)
            self.held[name] = nbytes
            self.pins[name] += 1
            self._used(name)
            took = time.perf_counter() - t0
            if restored:
                self.restores += 1
                self.restore_s = ewma(self.restore_s or None, took)
            else:
                self.loads += 1
                self.load_s = ewma(self.load_s or None, took)

    def _restore(self, name: str, nbytes: int, t0: float) -> None:
        """Copy an adapter back from host memory (the loading event for `name` is set; cleared here)."""
        try:
            with self.model_lock:
                self._make_room(nbytes)
                try:
                    self.backend.restore(name)
                except BaseException:
                    self.backend.forget(name)
                    raise
                self._active = None
            self._now_held(name, nbytes, t0, restored=True)
            log.info("restored adapter %s from host memory", name)
        finally:
            with self._state:
                self.loading.pop(name).set()

    def _drop_empty(self) -> None:
        """Forget the oldest names-only adapters no request uses, past MAX_EMPTY (nothing to unload)."""
        with self._state:
            extra = len(self.empty) + 1 - MAX_EMPTY
            for name in [n for n in self.held if n in self.empty and self.pins[n] == 0][:max(extra, 0)]:
                del self.held[name]
                self.empty.discard(name)

    def _make_room(self, nbytes: int) -> str | None:
        """Unload adapters no request uses, past slots or MiB (under the model lock), in unload order (least used,
        then least recently used); the last of them is left for the new adapter to take the place of
        (install(into=...): a hotswap, or its unload), and returned."""
        with self._state:
            victims = []
            count, total = len(self.held) - len(self.empty), sum(self.held.values())
            for name in self._unload_order():
                if count + 1 <= self.slots and total + nbytes <= self.max_bytes:
                    break
                if self.pins[name] == 0 and name not in self.empty:
                    victims.append(name)
                    count, total = count - 1, total - self.held[name]
            sizes = [self.held.pop(name) for name in victims]
        if self.host_slots:  # each to host memory; past host_slots, the least recently unloaded are forgotten
            for name in victims:
                self.backend.offload(name)
                log.info("unloaded adapter %s to host memory", name)
            with self._state:
                for name, size in zip(victims, sizes):
                    self.host[name] = size
                gone = [self.host.popitem(last=False)[0] for _ in range(len(self.host) - self.host_slots)]
            for name in gone:
                self.backend.forget(name)
                log.info("forgot adapter %s (host memory full)", name)
            return None
        into = victims.pop() if victims else None
        for name in victims:
            self.backend.forget(name)
            log.info("unloaded adapter %s", name)
        return into

    def release(self, names) -> None:
        with self._state:
            for name in names:
                self.pins[name] -= 1
                if self.pins[name] <= 0:
                    del self.pins[name]

    @contextmanager
    def use(self, loras):
        """This thread's forwards apply `loras` (none: the base model) until the block ends."""
        before = getattr(self._local, "key", ())
        self._local.key = tuple((r.name, r.scale) for r in loras or ())
        try:
            yield
        finally:
            self._local.key = before

    def set_thread_key(self, key: tuple) -> None:
        """A batching driver thread: its next forwards apply this batch's adapters."""
        self._local.key = key

    def _guard(self, module) -> None:
        forward = module.forward

        def guarded(*args, **kw):
            key = getattr(self._local, "key", ())
            with self.model_lock:
                if key != self._active:
                    self.backend.activate(key)
                    self._active = key
                return forward(*args, **kw)

        module.forward = guarded


def make_bank(adapter, role: str, slots: int, max_mib: int, slowdown: float = 1.0,
              compiled: bool = False, host_slots: int = 0) -> LoraBank | None:
    """The bank of an adapter that takes LoRA adapters in `role`; None when it takes none (then a request with
    adapters fails, naming the model). `compiled`: the role compiles its denoiser (DiffusersLoras.compiled);
    `host_slots`: loras.host_slots (a sim profile's lora.host_slots first)."""
    support = adapter.capabilities.loras
    if role == "decoder" or support is LoraSupport.NONE:
        return None
    if support is LoraSupport.SIM:  # its adapters are the denoiser's weights
        if role not in ("denoiser", "monolith"):
            return LoraBank(SimLoras(0.0), 1 << 20, max_mib << 20)  # takes any name, at no cost
        cost = adapter.profile.lora
        return LoraBank(SimLoras(cost.load_ms, slowdown, cost.restore_ms), cost.slots or slots, max_mib << 20,
                        cost.host_slots or host_slots)
    try:  # LoraSupport.DIFFUSERS
        backend = DiffusersLoras(adapter.pipe, role, compiled=compiled and role in ("denoiser", "monolith"))
    except TypeError:
        return None
    return LoraBank(backend, slots, max_mib << 20, host_slots)
