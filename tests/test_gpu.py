"""GPU checks: CUDA pools and the cuda-ipc engine between real processes. Skipped without CUDA.

Every wait on a child is bounded: a hang costs seconds of a short GPU run, not pytest's 300 s."""

from __future__ import annotations

import select
import subprocess
import sys
import textwrap
import threading
import time

import msgspec
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(120)]

WAIT_S = 60

PRODUCER = textwrap.dedent("""
    import sys, torch, msgspec
    from disagg.transport.data.pool import CudaPool
    from disagg.transport.data.engines import make_engine, EngineOptions
    pool = CudaPool(sys.argv[1], 64 << 20, "cuda:0")
    engine = make_engine("cuda-ipc", pool, EngineOptions(visible_gpus=(0,)))
    torch.manual_seed(int(sys.argv[2]))
    slot = pool.stage("encoder-0", {"emb": torch.randn(512, 4096, device="cuda:0").to(torch.bfloat16)})
    print(msgspec.json.encode({"slot": slot, "adv": engine.advertise()}).decode(), flush=True)
    sys.stdin.readline()
""")


def readline(proc: subprocess.Popen, timeout: float = WAIT_S) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        raise AssertionError(f"the producer printed nothing in {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"the producer exited with {proc.wait(timeout=5)} before printing its slot")
    return line


class Producer:
    """A child process that stages one bf16 tensor in its own GPU pool and waits."""

    def __init__(self, name: str, seed: int):
        self.proc = subprocess.Popen([sys.executable, "-c", PRODUCER, name, str(seed)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        from disagg.transport.wire.messages import CudaIpcHandle, PoolInfo, SlotRef, Source

        doc = msgspec.json.decode(readline(self.proc))
        slot = msgspec.convert(doc["slot"], SlotRef)
        adv = doc["adv"]
        pool = PoolInfo(host_id="h", engines=["cuda-ipc"], pool_name=name, pool_bytes=64 << 20, device="cuda:0",
                        cuda_ipc=msgspec.convert(adv["cuda_ipc"], CudaIpcHandle), gpu=adv["gpu"])
        self.source = Source(slot=slot, pool=pool, engine="cuda-ipc")
        torch.manual_seed(seed)
        self.expected = torch.randn(512, 4096, device="cuda:0").to(torch.bfloat16)

    def stop(self) -> None:
        try:
            self.proc.communicate("\n", timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def consumer():
    from disagg.transport.data.engines import EngineOptions, make_engine
    from disagg.transport.data.pool import CudaPool

    mine = CudaPool("gpu-consumer", 64 << 20, "cuda:0")
    return mine, make_engine("cuda-ipc", mine, EngineOptions(visible_gpus=(0,)))


def test_cuda_ipc_pull_between_processes():
    from disagg.transport.data.manifest import unpack

    producer = Producer("gpu-producer", 0)
    mine, engine = consumer()
    try:
        dst = mine.view(0, producer.source.slot.nbytes)
        engine.read(producer.source, dst, [])
        assert torch.equal(unpack(dst, producer.source.slot.tensors)["emb"], producer.expected)
    finally:
        engine.close()  # close our mapping before the producer frees what it maps
        producer.stop()


def test_a_restarted_producer_replaces_its_old_mapping():
    from disagg.transport.data.manifest import unpack

    mine, engine = consumer()
    first = Producer("gpu-producer-a", 1)
    try:
        engine.read(first.source, mine.view(0, first.source.slot.nbytes), [])
    finally:
        first.stop()
    second = Producer("gpu-producer-b", 2)  # the same instance id (encoder-0) with a new pool
    try:
        dst = mine.view(0, second.source.slot.nbytes)
        engine.read(second.source, dst, [])
        assert engine.mapped() == {"encoder-0": "gpu-producer-b"}
        assert torch.equal(unpack(dst, second.source.slot.tensors)["emb"], second.expected)
    finally:
        engine.close()
        second.stop()


def test_a_pull_does_not_wait_for_queued_compute():
    producer = Producer("gpu-producer-c", 3)
    mine, engine = consumer()
    try:
        torch.cuda._sleep(int(3e9))  # ~1-2 s of queued "compute" on the default stream
        t0 = time.perf_counter()
        engine.read(producer.source, mine.view(0, producer.source.slot.nbytes), [])
        took = time.perf_counter() - t0
        assert not torch.cuda.current_stream().query(), "the compute finished first: the test proves nothing"
        assert took < 0.5
        mine.compute_done()
        assert torch.cuda.current_stream().query()
    finally:
        engine.close()
        producer.stop()


def test_a_stage_and_a_pull_do_not_wait_for_another_requests_queued_compute():
    """A finished request's stage waits for the event of its own compute, not for the compute stream, where
    another request's step is queued by then; a pull does not queue behind another thread's copies, which wait
    for that thread's compute (a preview of latents its step is still making)."""
    from disagg.transport.data.manifest import unpack

    producer = Producer("gpu-producer-d", 4)
    mine, engine = consumer()
    others: list[threading.Thread] = []
    try:
        nbytes = producer.source.slot.nbytes
        # a first pull opens the peer's pool and makes this thread's copy stream: what follows times waits only
        engine.read(producer.source, mine.view(mine.alloc(nbytes), nbytes), [])
        dst = mine.view(mine.alloc(nbytes), nbytes)
        out = torch.randn(256, 1024, device="cuda:0")  # this request's output
        expected = out.clone()
        done = mine.mark()
        mine.compute_done(done)
        torch.cuda._sleep(int(3e9))  # ~1-2 s: another request's step, queued after ours ended
        t0 = time.perf_counter()
        slot = mine.stage("denoiser-0", {"x": out}, after=done)
        staged_s = time.perf_counter() - t0
        assert not torch.cuda.current_stream().query(), "the other compute finished first: the test proves nothing"
        assert staged_s < 0.5

        queued = threading.Event()

        def preview():  # another thread's copy that waits for the compute queued so far (the sleeps)
            with mine.copying(after=mine.mark()):
                queued.set()

        torch.cuda._sleep(int(3e9))  # more of that step
        others.append(threading.Thread(target=preview))
        others[0].start()
        assert queued.wait(WAIT_S)
        t0 = time.perf_counter()
        engine.read(producer.source, dst, [])
        pulled_s = time.perf_counter() - t0
        assert not torch.cuda.current_stream().query(), "the other compute finished first: the test proves nothing"
        assert pulled_s < 0.5
        others[0].join(WAIT_S)
        mine.compute_done()
        assert torch.equal(unpack(mine.view(slot.offset, slot.nbytes), slot.tensors)["x"], expected)
        assert torch.equal(unpack(dst, producer.source.slot.tensors)["emb"], producer.expected)
    finally:
        for t in others:
            t.join(WAIT_S)
        engine.close()
        producer.stop()


def test_gpu_pool_stages_without_host_copy():
    from disagg.transport.data.manifest import unpack
    from disagg.transport.data.pool import CudaPool

    pool = CudaPool("gpu-stage", 1 << 20, "cuda:0")
    assert pool.ipc is not None, pool.ipc_error
    t = torch.randn(64, 64, device="cuda:0")
    slot = pool.stage("denoiser-0", {"latents": t})
    assert pool.buffer.is_cuda and slot.nbytes >= t.numel() * 4
    assert torch.equal(unpack(pool.view(slot.offset, slot.nbytes), slot.tensors)["latents"], t)
    assert pool.ipc_handle() is pool.ipc  # made once, at creation


def test_inline_copies_out_of_and_into_a_gpu_pool_go_through_pinned_memory():
    from disagg.roles.compute import StageRunner
    from disagg.transport.data.engines import make_engine
    from disagg.transport.data.pool import CudaPool
    from disagg.transport.wire.messages import PoolInfo, Source

    pool = CudaPool("gpu-inline", 1 << 20, "cuda:0")
    assert pool.host_buffer(64).is_pinned()
    slot = pool.stage("denoiser-0", {"x": torch.randn(64, 64, device="cuda:0")})
    frame = StageRunner("denoiser-0", pool, {}, lambda *args, **kwargs: None).inline_bytes(slot)
    source = Source(slot=slot, engine="inline", pool=PoolInfo(host_id="h", engines=["inline"], pool_name="gpu-inline",
                                                               pool_bytes=1 << 20, device="cuda:0"))
    dst = pool.view(pool.alloc(slot.nbytes), slot.nbytes)
    make_engine("inline", pool).read(source, dst, [frame])
    assert torch.equal(dst, pool.view(slot.offset, slot.nbytes))


def test_mooncake_refuses_a_gpu_pool_without_its_cuda_build():
    from disagg.transport.data.engines import EngineUnavailable, make_engine
    from disagg.transport.data.mooncake_engine import cuda_build_installed, installed_build
    from disagg.transport.data.pool import CudaPool

    if not installed_build() or cuda_build_installed():
        pytest.skip(f"needs the non-CUDA Mooncake build (installed: {installed_build() or 'none'})")
    with pytest.raises(EngineUnavailable, match="no CUDA support"):
        make_engine("mooncake", CudaPool("gpu-mc", 1 << 20, "cuda:0"))
