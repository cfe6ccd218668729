"""First-fit slot allocator over one contiguous byte range, with coalescing frees."""

from __future__ import annotations

import bisect

ALIGN_BYTES = 256  # CUDA's allocation granularity; also keeps every dtype aligned


class PoolFull(RuntimeError):
    """No free range is large enough for an allocation. `transient`: it may fit once other slots are freed (a
    payload larger than the whole pool never does)."""

    def __init__(self, message: str, transient: bool = True):
        super().__init__(message)
        self.transient = transient


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


class SlotAllocator:
    """Hands out aligned [offset, offset+size) ranges of a pool of `total` bytes."""

    def __init__(self, total: int, align: int = ALIGN_BYTES):
        if total <= 0:
            raise ValueError(f"pool size must be positive, got {total}")
        self.total = total
        self.align = align
        # free ranges as parallel sorted lists of starts and sizes
        self._starts: list[int] = [0]
        self._sizes: list[int] = [total]
        self._used: dict[int, int] = {}

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def free_bytes(self) -> int:
        return self.total - self.used_bytes

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    def alloc(self, nbytes: int) -> int:
        """Reserve `nbytes` (rounded up to the alignment); return the offset."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = align_up(max(nbytes, 1), self.align)
        for i, free in enumerate(self._sizes):
            if free >= size:
                start = self._starts[i]
                if free == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                self._used[start] = size
                return start
        raise PoolFull(
            f"pool full: need {size} bytes, largest free range is {self.largest_free} "
            f"of {self.free_bytes} free / {self.total} total"
        )

    def free(self, offset: int) -> None:
        """Return the range that starts at `offset`; neighbours merge into one free range."""
        size = self._used.pop(offset, None)
        if size is None:
            raise KeyError(f"no allocation at offset {offset}")
        i = bisect.bisect_left(self._starts, offset)
        self._starts.insert(i, offset)
        self._sizes.insert(i, size)
        if i + 1 < len(self._starts) and offset + size == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset:
            self._sizes[i - 1] += self._sizes.pop(i)
            self._starts.pop(i)

    def owns(self, offset: int) -> bool:
        return offset in self._used

    def size_of(self, offset: int) -> int:
        return self._used[offset]

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._sizes))
