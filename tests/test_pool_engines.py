"""Pools and transfer engines, including a pull across two real processes."""

import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from disagg.transport.data.allocator import PoolFull
from disagg.transport.data.engines import EngineOptions, InlineEngine, ShmEngine, TransferError, make_engine
from disagg.transport.data.manifest import unpack
from disagg.transport.data.pool import ShmPool as Pool
from disagg.transport.data.selection import choose_engine
from disagg.transport.data.shm import list_segments, remove_segments, shm_path
from disagg.transport.wire.messages import PoolInfo, Source


@pytest.fixture
def pool_name():
    name = f"disagg-test-{uuid.uuid4().hex[:8]}"
    yield name
    remove_segments(name)


def info(pool: Pool, host="h") -> PoolInfo:
    return PoolInfo(host_id=host, engines=["shm", "inline"], pool_name=pool.name, pool_bytes=pool.nbytes)


def test_stage_and_pull_in_process(pool_name):
    src, dst = Pool(pool_name + "-a", 1 << 20), Pool(pool_name + "-b", 1 << 20)
    try:
        tensors = {"emb": torch.randn(2, 8, 16).to(torch.bfloat16), "pooled": torch.randn(2, 32)}
        slot = src.stage("encoder-0", tensors)
        for engine in (ShmEngine(dst, EngineOptions()), InlineEngine(dst, EngineOptions())):
            off = dst.alloc(slot.nbytes)
            frames = [bytes(src.view(slot.offset, slot.nbytes).numpy())]
            engine.read(Source(slot=slot, pool=info(src), engine=engine.name), dst.view(off, slot.nbytes), frames)
            out = unpack(dst.view(off, slot.nbytes), slot.tensors)
            assert all(torch.equal(out[k], v) for k, v in tensors.items())
            dst.free(off)
        src.free(slot.offset)
        assert src.free_bytes == src.nbytes and dst.free_bytes == dst.nbytes
    finally:
        src.close()
        dst.close()
    assert not os.path.exists(shm_path(pool_name + "-a"))


def test_pool_full_is_clear(pool_name):
    pool = Pool(pool_name, 4096)
    try:
        with pytest.raises(PoolFull, match="40000 bytes does not fit the 4096-byte pool"):
            pool.stage("x", {"big": torch.zeros(10_000)})
        pool.stage("x", {"a": torch.zeros(600)})  # 2400 of 4096 bytes taken
        with pytest.raises(PoolFull, match="need 2560 bytes, largest free range is 1536"):
            pool.stage("x", {"b": torch.zeros(600)})
        assert pool.free_bytes == 4096 - 2560
    finally:
        pool.close()


def test_out_of_bounds_source_refused(pool_name):
    pool = Pool(pool_name, 4096)
    try:
        slot = pool.stage("encoder-0", {"x": torch.ones(8)})
        bad = Source(slot=slot, pool=PoolInfo(host_id="h", engines=["shm"], pool_name=pool.name, pool_bytes=16), engine="shm")
        with pytest.raises(TransferError, match="outside"):
            ShmEngine(pool, EngineOptions()).read(bad, torch.empty(slot.nbytes, dtype=torch.uint8), [])
        with pytest.raises(TransferError, match="inline payload"):
            InlineEngine(pool, EngineOptions()).read(Source(slot=slot, pool=info(pool), engine="inline"), torch.empty(slot.nbytes, dtype=torch.uint8), [b"x"])
    finally:
        pool.close()


def test_missing_peer_pool_is_transfer_error(pool_name):
    pool, other = Pool(pool_name, 4096), Pool(pool_name + "-o", 4096)
    slot = pool.stage("encoder-0", {"x": torch.ones(8)})
    src = Source(slot=slot, pool=info(pool), engine="shm")
    pool.close()
    with pytest.raises(TransferError, match="cannot open"):
        ShmEngine(other, EngineOptions()).read(src, other.view(0, slot.nbytes), [])
    other.close()


def test_pull_from_another_process(pool_name):
    """A producer process stages tensors; this process pulls them through shm."""
    code = textwrap.dedent(f"""
        import sys, torch, msgspec
        from disagg.transport.data.pool import ShmPool
        torch.manual_seed(0)
        pool = ShmPool({pool_name!r}, 1 << 20)
        slot = pool.stage("encoder-0", {{"a": torch.randn(64, 32), "b": torch.arange(10)}})
        sys.stdout.write(msgspec.json.encode(slot).decode() + "\\n"); sys.stdout.flush()
        sys.stdin.readline()
        pool.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        import msgspec

        from disagg.transport.wire.messages import SlotRef

        slot = msgspec.json.decode(proc.stdout.readline(), type=SlotRef)
        src = Source(slot=slot, pool=PoolInfo(host_id="h", engines=["shm"], pool_name=pool_name, pool_bytes=1 << 20), engine="shm")
        mine = Pool(pool_name + "-mine", 1 << 20)
        dst = mine.view(0, slot.nbytes)
        make_engine("shm", mine).read(src, dst, [])
        out = unpack(dst, slot.tensors)
        torch.manual_seed(0)
        assert torch.equal(out["a"], torch.randn(64, 32)) and out["b"].tolist() == list(range(10))
    finally:
        proc.communicate("\n", timeout=30)
    assert proc.returncode == 0
    mine.close()
    assert list_segments(pool_name) == []


def test_auto_selection():
    a = PoolInfo(host_id="h1", engines=["shm", "inline"], pool_name="a", pool_bytes=1)
    b = PoolInfo(host_id="h1", engines=["shm", "inline"], pool_name="b", pool_bytes=1)
    c = PoolInfo(host_id="h2", engines=["shm", "inline"], pool_name="c", pool_bytes=1)
    assert choose_engine("auto", a, b) == ("shm", None)
    engine, warning = choose_engine("auto", a, c)
    assert engine == "inline" and "different hosts" in warning
    assert choose_engine("inline", a, b) == ("inline", None)
    engine, warning = choose_engine("shm", a, PoolInfo(host_id="h1", engines=["inline"], pool_name="d", pool_bytes=1))
    assert engine == "inline" and "not served by both" in warning
    g1 = PoolInfo(host_id="h1", engines=["cuda-ipc", "mooncake", "inline"], pool_name="g1", pool_bytes=1, device="cuda:0")
    g2 = PoolInfo(host_id="h1", engines=["cuda-ipc", "mooncake", "inline"], pool_name="g2", pool_bytes=1, device="cuda:0")
    g3 = PoolInfo(host_id="h2", engines=["cuda-ipc", "mooncake", "inline"], pool_name="g3", pool_bytes=1, device="cuda:0")
    assert choose_engine("auto", g1, g2) == ("cuda-ipc", None)
    assert choose_engine("auto", g1, g3) == ("mooncake", None)  # cuda-ipc never crosses hosts
    m1 = PoolInfo(host_id="h1", engines=["shm", "mooncake", "inline"], pool_name="m1", pool_bytes=1)
    m2 = PoolInfo(host_id="h2", engines=["shm", "mooncake", "inline"], pool_name="m2", pool_bytes=1)
    assert choose_engine("auto", m1, m2) == ("mooncake", None)
    assert choose_engine("mooncake", m1, PoolInfo(host_id="h1", engines=["shm", "mooncake"], pool_name="m3", pool_bytes=1)) == ("mooncake", None)
    engine, warning = choose_engine("auto", g1, m1)
    assert engine == "mooncake"  # a GPU pool and a host pool on one host: no shm, no cuda-ipc
