"""The mooncake engine between two real processes over tcp on loopback (CI installs mooncake-cpu)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import msgspec
import pytest
import torch

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda is not installed")

from disagg.transport.data.engines import EngineOptions, TransferError, make_engine  # noqa: E402
from disagg.transport.data.manifest import unpack  # noqa: E402
from disagg.transport.data.pool import ShmPool  # noqa: E402
from disagg.transport.data.shm import remove_segments  # noqa: E402
from disagg.transport.wire.messages import PoolInfo, SlotRef, Source  # noqa: E402

PRODUCER = textwrap.dedent("""
    import sys, torch, msgspec
    from disagg.transport.data.pool import ShmPool
    from disagg.transport.data.engines import make_engine
    name = sys.argv[1]
    pool = ShmPool(name, 64 << 20)
    engine = make_engine("mooncake", pool)
    torch.manual_seed(0)
    slot = pool.stage("encoder-0", {"emb": torch.randn(512, 64).to(torch.bfloat16), "pooled": torch.randn(3, 32), "big": torch.randn(1 << 20)})
    print(msgspec.json.encode({"slot": slot, "adv": engine.advertise(), "nbytes": pool.nbytes}).decode(), flush=True)
    sys.stdin.readline()
    engine.close(); pool.close()
""")


@pytest.fixture
def producer():
    name = f"disagg-test-mc-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, "producer did not start"
    doc = msgspec.json.decode(line)
    slot = msgspec.convert(doc["slot"], SlotRef)
    pool = PoolInfo(host_id="h", engines=["shm", "mooncake"], pool_name=name, pool_bytes=doc["nbytes"], **doc["adv"])
    mine = ShmPool(name + "-consumer", 64 << 20)
    engine = make_engine("mooncake", mine, EngineOptions())
    yield proc, Source(slot=slot, pool=pool, engine="mooncake"), mine, engine
    engine.close()
    mine.close()
    if proc.poll() is None:
        proc.communicate("\n", timeout=30)
    remove_segments(name)


def test_pull_between_processes(producer):
    proc, source, mine, engine = producer
    assert source.pool.session_id.startswith("127.0.0.1:") and source.pool.base_addr > 0
    off = mine.alloc(source.slot.nbytes)
    engine.read(source, mine.view(off, source.slot.nbytes), [])
    got = unpack(mine.view(off, source.slot.nbytes), source.slot.tensors)
    torch.manual_seed(0)
    want = {"emb": torch.randn(512, 64).to(torch.bfloat16), "pooled": torch.randn(3, 32), "big": torch.randn(1 << 20)}
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_address_outside_registered_pool_is_an_error(producer):
    proc, source, mine, engine = producer
    # a peer that lies about its base address: Mooncake refuses, we raise (never a silent success)
    lying = msgspec.structs.replace(source.pool, base_addr=source.pool.base_addr + source.pool.pool_bytes)
    with pytest.raises(TransferError, match=r"mooncake read of \d+ bytes from encoder-0 .* failed with code"):
        engine.read(msgspec.structs.replace(source, pool=lying), mine.view(0, source.slot.nbytes), [])
    # a slot past the advertised pool end never leaves this process
    far = msgspec.structs.replace(source.slot, offset=source.pool.pool_bytes)
    with pytest.raises(TransferError, match="outside"):
        engine.read(msgspec.structs.replace(source, slot=far), mine.view(0, source.slot.nbytes), [])


def test_dead_peer_is_an_error(producer):
    proc, source, mine, engine = producer
    proc.communicate("\n", timeout=30)
    with pytest.raises(TransferError, match=r"encoder-0 \(127\.0\.0\.1:\d+\)"):
        engine.read(source, mine.view(0, source.slot.nbytes), [])
