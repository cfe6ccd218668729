"""GPU checks: CUDA pools and the cuda-ipc engine between real processes. Skipped without CUDA."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PRODUCER = textwrap.dedent("""
    import sys, torch, msgspec
    from transport.pool import CudaPool
    from transport.engines import make_engine, EngineOptions
    pool = CudaPool("gpu-producer", 64 << 20, "cuda:0")
    engine = make_engine("cuda-ipc", pool, EngineOptions(visible_gpus=(0,)))
    torch.manual_seed(0)
    slot = pool.stage("encoder-0", {"emb": torch.randn(512, 4096, device="cuda:0").to(torch.bfloat16)})
    adv = engine.advertise()
    print(msgspec.json.encode({"slot": slot, "adv": adv}).decode(), flush=True)
    sys.stdin.readline()
""")


def test_cuda_ipc_pull_between_processes():
    from transport.engines import EngineOptions, make_engine
    from transport.manifest import unpack
    from transport.messages import CudaIpcHandle, PoolInfo, SlotRef, Source
    from transport.pool import CudaPool

    proc = subprocess.Popen([sys.executable, "-c", PRODUCER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        doc = msgspec.json.decode(proc.stdout.readline())
        slot = msgspec.convert(doc["slot"], SlotRef)
        adv = doc["adv"]
        pool = PoolInfo(host_id="h", engines=["cuda-ipc"], pool_name="gpu-producer", pool_bytes=64 << 20, device="cuda:0",
                        cuda_ipc=msgspec.convert(adv["cuda_ipc"], CudaIpcHandle), gpu=adv["gpu"])
        mine = CudaPool("gpu-consumer", 64 << 20, "cuda:0")
        engine = make_engine("cuda-ipc", mine, EngineOptions(visible_gpus=(0,)))
        dst = mine.view(0, slot.nbytes)
        engine.read(Source(slot=slot, pool=pool, engine="cuda-ipc"), dst, [])
        got = unpack(dst, slot.tensors)["emb"]
        torch.manual_seed(0)
        assert torch.equal(got, torch.randn(512, 4096, device="cuda:0").to(torch.bfloat16))
    finally:
        proc.communicate("\n", timeout=60)


def test_gpu_pool_stages_without_host_copy():
    from transport.pool import CudaPool

    pool = CudaPool("gpu-stage", 1 << 20, "cuda:0")
    t = torch.randn(64, 64, device="cuda:0")
    slot = pool.stage("denoiser-0", {"latents": t})
    assert pool.buffer.is_cuda and slot.nbytes >= t.numel() * 4
