"""What a role measures about itself, one struct per concern: its Heartbeat carries them nested, the orchestrator's
registry keeps the latest of each as it came (disagg/orchestrator/registry.py `Instance`), `disagg status` reports
them as they are (InstanceStatus), and metrics read them there (the gateway's /metrics, the launcher's table).

A new per-instance statistic is a field here, the line of the role that measures it (the struct's `stats()` /
`snapshot()` maker: disagg/roles/extensions/loras.py, conditioning.py, boot.py, compile.py, limits.py), and, if it is exported, the metric
that reads it (disagg/gateway/metrics.py): nothing between copies it. Every field has a default, so a struct a role
leaves out reads as zeros. disagg/transport/wire/messages.py re-exports them."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from disagg.transport.wire.descriptors import Count
from disagg.transport.wire.params import LoraName


class _Stats(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of the statistics structs (untagged: each is a field of a message, not a message)."""


class LoraStats(_Stats):
    """LoRA adapters (disagg/roles/extensions/loras.py LoraBank): those it holds, the next to unload first, of `slots`; adapter
    loads (misses) and hits since it started; the seconds one load takes here (moving average of its loads: reading
    and installing; 0 before the first)."""

    held: Annotated[list[LoraName], Meta(max_length=4096)] = []
    slots: Count = 0
    loads: Count = 0
    hits: Count = 0
    load_s: Annotated[float, Meta(ge=0)] = 0.0
    #: how many of `held` it holds as names only: no part for its components (an encoder and an adapter without
    #: text-encoder parts); they take no slot, so `held` may list more than `slots`
    names_only: Count = 0
    #: adapters it keeps in host memory (loras.host_slots), the next to forget first, of `host_slots`; its restores
    #: (an adapter copied back from host memory, not a load) and the seconds one takes (moving average)
    host: Annotated[list[LoraName], Meta(max_length=65536)] = []
    host_slots: Count = 0
    restores: Count = 0
    restore_s: Annotated[float, Meta(ge=0)] = 0.0


class CacheStats(_Stats):
    """A cache of results (an encoder's conditioning cache, disagg/roles/extensions/conditioning.py): lookups and hits since it
    started (a hit computed nothing), entries it holds now, and their bytes (on its device, against its bound)."""

    lookups: Count = 0
    hits: Count = 0
    entries: Count = 0
    bytes: Count = 0


class BootStats(_Stats):
    """Its boot until it is ready (disagg/roles/boot.py): what it does ("starting", "downloading", "loading",
    "compiling", "warming up"; "" once ready), a line of detail, the bytes so far (downloaded, or in memory), and a
    count that grows while the boot progresses (the launcher's timeouts.ready counts only time without growth)."""

    phase: Annotated[str, Meta(max_length=32)] = ""
    detail: Annotated[str, Meta(max_length=256)] = ""
    bytes: Count = 0
    progress: Count = 0


class MemoryStats(_Stats):
    """Its device's memory now (disagg/roles/limits.py memory_stats): the device (a GPU's name, a simulated device's
    class, "" on the CPU) and its memory (0: unknown); free bytes, every process on it counted (a GPU's,
    torch.cuda.mem_get_info; a simulated device's: its memory less this instance's weights and activations' peak; 0
    elsewhere: unknown); the bytes of the weights it loaded (parameters x their dtype's size; 0 before they are
    loaded), of its transfer pool where the pool is on the device, of its caches there (its encodings'), and the
    peak of its activations so far. `rebalance` checks free bytes before it gives this device another role."""

    device: Annotated[str, Meta(max_length=256)] = ""
    total_bytes: Count = 0
    free_bytes: Count = 0
    weights_bytes: Count = 0
    pool_bytes: Count = 0
    cache_bytes: Count = 0
    activation_peak_bytes: Count = 0


class CompileStats(_Stats):
    """A compiled denoiser's boot compile (disagg/roles/extensions/compile.py, `compile: true`): the seconds its compile and
    warm-up took (0: not compiled)."""

    seconds: Annotated[float, Meta(ge=0)] = 0.0
