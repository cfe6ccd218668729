import random

import pytest

from disagg.transport.data.allocator import ALIGN_BYTES, PoolFull, SlotAllocator


def test_alloc_aligns_and_fills():
    a = SlotAllocator(4096, align=256)
    offs = [a.alloc(100) for _ in range(16)]
    assert offs == [i * 256 for i in range(16)]
    assert a.free_bytes == 0
    with pytest.raises(PoolFull, match="need 256 bytes"):
        a.alloc(1)


def test_free_coalesces_neighbours():
    a = SlotAllocator(1024, align=256)
    x, y, z, w = (a.alloc(256) for _ in range(4))
    a.free(x)
    a.free(z)
    assert a.largest_free == 256
    a.free(y)  # merges with x and z
    assert a.free_ranges() == [(0, 768)]
    a.free(w)
    assert a.free_ranges() == [(0, 1024)]
    assert a.alloc(1024) == 0


def test_error_names_sizes():
    a = SlotAllocator(1000 * ALIGN_BYTES)
    with pytest.raises(PoolFull) as err:
        a.alloc(10**9)
    assert "largest free range" in str(err.value) and str(1000 * ALIGN_BYTES) in str(err.value)


def test_double_free_and_unknown_offset():
    a = SlotAllocator(4096)
    off = a.alloc(10)
    a.free(off)
    with pytest.raises(KeyError):
        a.free(off)


def test_random_workload_never_overlaps_and_returns_to_empty():
    rng = random.Random(7)
    a = SlotAllocator(1 << 20)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and (rng.random() < 0.5 or len(live) > 50):
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            n = rng.randint(1, 40_000)
            try:
                off = a.alloc(n)
            except PoolFull:
                continue
            assert off % a.align == 0
            for o, size in live.items():
                assert off + n <= o or o + size <= off
            live[off] = n
    for off in list(live):
        a.free(off)
    assert a.free_ranges() == [(0, 1 << 20)] and a.used_bytes == 0
