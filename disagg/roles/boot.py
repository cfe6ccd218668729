"""A role's boot, as whoever waits for it sees it: its phase (downloading, loading, compiling, warming up), a
line of detail, the bytes so far, and a count of progress that grows while the boot gets on.

The launcher gives up on an instance only when that count stands still for `timeouts.ready` seconds (a stall), so
a first launch that downloads tens of GB per role, or a compile on a busy CPU, goes on for as long as it
progresses. Progress comes from two places:

- the boot itself: `phase("compiling", "size 1024x1024")` from anywhere in the role process (disagg/roles/extensions/compile.py
  calls it per size and batch); every call counts as progress, as does `tick(detail)`;
- a meter thread (`BootMeter`) that looks, every METER_S, at what grows while a boot gets on: the checkpoint's
  folder in the Hugging Face cache (a download: phase "downloading" with the bytes so far), the process's memory
  (host RSS plus CUDA memory: weights being loaded) and, while compiling, the inductor cache folder and the CPU
  time of the process and its compile workers (a compile burns CPU all along; one blocked for good does not).

Heartbeats carry the snapshot (a BootStats, disagg/transport/wire/role_stats.py: Heartbeat.boot) to the
orchestrator; `disagg status` and the launcher's table show it.

Test hook: DISAGG_TEST_BOOT_HOLD="INSTANCE:MODE:PATH" makes role INSTANCE hold its boot, once its model is loaded,
in phase "loading" until the file PATH exists: MODE `progress` ticks progress meanwhile (a slow load), `hang` does
not (a stuck one). tests/test_readiness.py uses it; nothing else should.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from disagg.transport.environment import DISAGG_TEST_BOOT_HOLD
from disagg.transport.wire.role_stats import BootStats

log = logging.getLogger("disagg.role")

#: how often the meter looks at the cache folders and the memory
METER_S = 0.5
#: growth smaller than this is noise (allocator churn), not progress
MIN_GROWTH = 1 << 20
#: CPU seconds a compile must burn (the process and its compile workers) from one look to the next (METER_S) to
#: count as progress: 5 % of a core, which a compile starved on a busy machine still gets; an idle process, far less
WORK_S = 0.025
#: how often the test hook's slow load ticks
HOLD_TICK_S = 0.2


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class BootProgress:
    """The boot's phase, detail, bytes and progress count; set from any thread, read by the heartbeat."""

    def __init__(self):
        self.lock = threading.Lock()
        self.phase = "starting"
        self.detail = ""
        self.bytes = 0
        self.count = 0

    def set(self, phase: str, detail: str = "", done_bytes: int | None = None) -> None:
        with self.lock:
            if phase != self.phase:
                log.info("boot: %s%s", phase, f" ({detail})" if detail else "")
            self.phase, self.detail = phase, detail
            if done_bytes is not None:
                self.bytes = done_bytes
            self.count += 1

    def tick(self, detail: str | None = None, done_bytes: int | None = None) -> None:
        with self.lock:
            if detail is not None:
                self.detail = detail
            if done_bytes is not None:
                self.bytes = done_bytes
            self.count += 1

    def done(self) -> None:
        with self.lock:
            self.phase, self.detail, self.bytes = "", "", 0
            self.count += 1

    def snapshot(self) -> BootStats:
        with self.lock:
            return BootStats(phase=self.phase, detail=self.detail[:256], bytes=self.bytes, progress=self.count)


#: this process's boot (one role per process)
PROGRESS = BootProgress()


def phase(name: str, detail: str = "", done_bytes: int | None = None) -> None:
    """Say what the boot does now ("downloading", "loading", "compiling", "warming up"), with a line of detail;
    every call counts as progress (the launcher's stall timeout starts again)."""
    PROGRESS.set(name, detail, done_bytes)


def tick(detail: str | None = None, done_bytes: int | None = None) -> None:
    """Progress within the current phase (a block compiled, a size warmed up), with a new detail if given."""
    PROGRESS.tick(detail, done_bytes)


def hub_folder(model: str) -> Path | None:
    """The Hugging Face cache folder of `model` when it is a hub id (owner/name) and not a local folder."""
    if model.count("/") != 1 or model.startswith((".", "/", "~")) or Path(model).expanduser().exists():
        return None
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return Path(constants.HF_HUB_CACHE) / f"models--{model.replace('/', '--')}"


def folder_bytes(path: Path | str | None) -> int:
    """Bytes of the files under `path` (0 if none); files that vanish meanwhile are skipped."""
    if not path:
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def memory_bytes() -> int:
    """This process's host memory (RSS) plus the CUDA memory it allocated: grows while weights load."""
    import psutil

    total = psutil.Process().memory_info().rss
    try:
        import torch

        if torch.cuda.is_initialized():
            total += sum(torch.cuda.memory_allocated(d) for d in range(torch.cuda.device_count()))
    except Exception:  # noqa: BLE001 - a meter must not break a boot
        pass
    return total


def work_seconds() -> float:
    """CPU seconds of this process (all its threads: dynamo traces on the boot thread, inductor compiles on worker
    threads) plus those of its child processes (inductor's compile workers)."""
    import psutil

    me = psutil.Process()
    times = me.cpu_times()
    total = times.user + times.system
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


class BootMeter:
    """Watches what grows while the boot gets on and counts it as progress, until stopped."""

    def __init__(self, model: str, compile_cache_dir: str = "", progress: BootProgress = PROGRESS,
                 memory=memory_bytes, work=None):
        self.progress = progress
        self.memory = memory  # a test's own measures
        self.work = work or work_seconds
        self.hub = hub_folder(model)
        self.compile_cache_dir = compile_cache_dir
        self.stopped = threading.Event()
        self.high = {"hub": folder_bytes(self.hub), "memory": 0, "inductor": folder_bytes(compile_cache_dir)}
        self.work_before = float("inf")  # the first look only takes the measure
        self.thread = threading.Thread(target=self.run, name="boot-meter", daemon=True)

    def start(self) -> BootMeter:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()

    def grew(self, key: str, now: int) -> bool:
        if now >= self.high[key] + MIN_GROWTH:
            self.high[key] = now
            return True
        return False

    def look(self) -> None:
        """One look: a growing download, memory or inductor cache is progress."""
        current = self.progress.phase
        if current in ("starting", "loading", "downloading") and self.hub is not None:
            got = folder_bytes(self.hub)
            if self.grew("hub", got):
                self.progress.set("downloading", f"{_gb(got)} of {self.hub.name[8:].replace('--', '/')} in the "
                                  "Hugging Face cache", got)
                return
        if current == "downloading":
            self.progress.set("loading", "weights into memory")
        mem = self.memory()
        if self.grew("memory", mem):  # the bytes, not the detail: that stays what the boot said it does
            self.progress.tick(done_bytes=mem if current in ("loading", "starting") else None)
        if current in ("compiling", "warming up"):
            # a compile writes kernels now and then, and burns CPU all along (its threads' and its compile
            # workers'): either is progress; a compile blocked for good does neither
            work, before = self.work(), self.work_before
            self.work_before = work  # the rate, not the sum: a process idling for good adds up CPU slowly too
            if self.grew("inductor", folder_bytes(self.compile_cache_dir)) or work >= before + WORK_S:
                self.progress.tick()

    def run(self) -> None:
        while not self.stopped.wait(METER_S):
            try:
                self.look()
            except Exception:  # noqa: BLE001 - a meter must not break a boot
                log.debug("boot meter", exc_info=True)


def test_hold(instance_id: str) -> None:
    """The test hook (DISAGG_TEST_BOOT_HOLD, module docstring): hold this instance's boot until a file exists."""
    value = os.environ.get(DISAGG_TEST_BOOT_HOLD, "")
    who, _, rest = value.partition(":")
    mode, _, path = rest.partition(":")
    if not value or who != instance_id:
        return
    if mode not in ("progress", "hang") or not path:
        raise ValueError(f"{DISAGG_TEST_BOOT_HOLD}={value!r}: expected INSTANCE:progress:PATH or INSTANCE:hang:PATH")
    log.warning("test hook %s: holding the boot until %s exists (%s)", DISAGG_TEST_BOOT_HOLD, path, mode)
    phase("loading", f"test hook: waiting for {path}")
    n = 0
    while not os.path.exists(path):
        time.sleep(HOLD_TICK_S)
        if mode == "progress":
            n += 1
            tick(f"test hook: waiting for {path} ({n} ticks)")
