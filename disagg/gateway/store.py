"""What the gateway keeps between requests, bounded by count, bytes and age: oldest out first."""

from __future__ import annotations

import collections
import time


class BoundedCache:
    """Entries in insertion order, each with its size; the oldest go when a bound is passed."""

    def __init__(self, max_items: int, max_bytes: int, ttl_s: float | None = None, clock=time.monotonic):
        self.max_items, self.max_bytes, self.ttl_s, self.clock = max_items, max_bytes, ttl_s, clock
        self._items: collections.OrderedDict[str, tuple[object, int, float]] = collections.OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def put(self, key: str, value, nbytes: int) -> None:
        self.pop(key)
        now = self.clock()
        self._items[key] = (value, nbytes, now + self.ttl_s if self.ttl_s is not None else float("inf"))
        self.nbytes += nbytes
        while self._items and (len(self._items) > self.max_items or self.nbytes > self.max_bytes
                               or next(iter(self._items.values()))[2] < now):
            self.pop(next(iter(self._items)))

    def get(self, key: str):
        item = self._items.get(key)
        if item is None:
            return None
        if item[2] < self.clock():
            self.pop(key)
            return None
        return item[0]

    def pop(self, key: str):
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.nbytes -= item[1]
        return item[0]
