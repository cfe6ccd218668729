"""The conditioning cache: an encoder keeps the outputs of recent text requests, and a request whose prompts,
guidance and adapters equal one of them (transport.params.conditioning_key) reuses it and computes nothing.

An LRU bounded in bytes (the `conditioning_cache_mib` setting), on the encoder's device beside its pool. The
orchestrator remembers which encoder encoded which key and sends a repeat there when it has a free slot
(disagg/orchestrator/scheduling/placement.py), so a repeat finds its entry even with many encoders.
"""

from __future__ import annotations

import collections
import threading

import torch

from disagg.transport.wire.role_stats import CacheStats


class ConditioningCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, tuple[dict[str, torch.Tensor], int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        #: lookups and hits since the process started (heartbeats carry them)
        self.lookups = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> CacheStats:
        """What its heartbeats say of it: lookups and hits so far, entries held and their bytes."""
        return CacheStats(lookups=self.lookups, hits=self.hits, entries=len(self._entries), bytes=self.bytes)

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        with self._lock:
            self.lookups += 1
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Keep an encoding. The tensors themselves, not a copy: an adapter's encode makes new ones each call, and
        what reads them (staging them into the pool) only reads."""
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.max_bytes:
            return
        kept = {name: t.detach() for name, t in tensors.items()}
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[key] = (kept, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self.bytes -= freed
