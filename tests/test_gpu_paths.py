"""The GPU paths' logic on the CPU: what issue 15's review found, each reproduced without a device.

The parts that need a real GPU (IPC between processes, the copy stream not waiting for compute) are in
test_gpu.py, which runs on a GPU machine (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

import pytest
import torch

from disagg.launcher.topology import ConfigError, cuda_env
from disagg.settings import Settings
from disagg.transport.data import cuda_ipc
from disagg.transport.data.engines import EngineOptions, EngineUnavailable, TransferError, make_engine, make_engines
from disagg.transport.data.pool import CudaPool, Pool
from disagg.transport.wire.messages import CudaIpcHandle, PoolInfo, Run, SlotRef, Source, TensorSpec

HANDLE = CudaIpcHandle(0, b"h" * 64, 1 << 20, 0, b"r" * 16, 0, b"e" * 64, True)


class HostCudaPool(CudaPool):
    """A CudaPool whose bytes live in host memory: the engines' bookkeeping, without a device."""

    def __init__(self, device: str = "cuda:0", ipc: CudaIpcHandle | None = HANDLE, ipc_error: str = ""):
        Pool.__init__(self, f"fake-{device}", 1 << 20)
        self.device = device
        self.buffer = torch.zeros(1 << 20, dtype=torch.uint8)
        self.ipc, self.ipc_error = ipc, ipc_error

    def mark(self):
        return None

    def copying(self, after=None):
        return contextlib.nullcontext()

    def compute_done(self, mark=None) -> None:
        pass

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


def source(instance: str, pool_name: str, nbytes: int = 64, gpu: int | None = 0) -> Source:
    slot = SlotRef(instance_id=instance, offset=0, nbytes=nbytes,
                   tensors=[TensorSpec("x", "uint8", [nbytes], 0, nbytes)])
    pool = PoolInfo(host_id="h", engines=["cuda-ipc"], pool_name=pool_name, pool_bytes=1 << 20, device="cuda:0",
                    cuda_ipc=HANDLE, gpu=gpu)
    return Source(slot=slot, pool=pool, engine="cuda-ipc")


# --- Mooncake and a GPU pool ---------------------------------------------------------------------------

def test_mooncake_host_build_refuses_a_gpu_pool_and_auto_picks_another_engine():
    from disagg.transport.data.mooncake_engine import HOST_BUILD, installed_build

    if not installed_build().startswith(HOST_BUILD):
        pytest.skip(f"needs {HOST_BUILD} (installed: {installed_build() or 'none'})")
    pool = HostCudaPool()
    with pytest.raises(EngineUnavailable, match=f"{HOST_BUILD}.*no CUDA support.*mooncake-transfer-engine"):
        make_engine("mooncake", pool)
    assert "mooncake" not in make_engines(pool, "auto")  # auto: another engine, no crash
    assert "cuda-ipc" in make_engines(pool, "auto")
    with pytest.raises(EngineUnavailable):  # asked for by name: the role fails to boot, with the reason
        make_engines(pool, "mooncake")


# --- CUDA IPC: the handle once, a failure is a refusal, mappings closed -----------------------------------

def test_a_pool_that_cannot_be_shared_refuses_cuda_ipc_instead_of_crashing():
    pool = HostCudaPool(ipc=None, ipc_error="RuntimeError: shareIpcHandle not supported")
    with pytest.raises(EngineUnavailable, match="shareIpcHandle not supported"):
        make_engine("cuda-ipc", pool)
    assert "cuda-ipc" not in make_engines(pool, "auto")


@pytest.mark.parametrize("variable", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
@pytest.mark.parametrize("conf", ["expandable_segments:True", "backend:cudaMallocAsync", "max_split_size_mb:64,expandable_segments:True"])
def test_allocator_settings_that_ipc_cannot_export_refuse_cuda_ipc(monkeypatch, conf, variable):
    # torch reads the generic PYTORCH_ALLOC_CONF too (and first): either name must be checked
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, conf)
    with pytest.raises(EngineUnavailable, match=f"^{variable}="):
        make_engine("cuda-ipc", HostCudaPool())
    monkeypatch.setenv(variable, "max_split_size_mb:64")
    make_engine("cuda-ipc", HostCudaPool())


def test_the_advertised_handle_is_the_one_made_at_pool_creation():
    pool = HostCudaPool()
    engine = make_engine("cuda-ipc", pool, EngineOptions(visible_gpus=(3,)))
    assert engine.advertise() == {"cuda_ipc": HANDLE, "gpu": 3}
    assert engine.advertise()["cuda_ipc"] is engine.advertise()["cuda_ipc"] is pool.ipc


def test_a_peer_pool_is_opened_on_our_own_device_with_its_event_handle_unchanged(monkeypatch):
    # we are cuda:1 of (2, 3); the peer lives on physical GPU 2, our cuda:0. Opening it there would make
    # a CUDA context on that GPU: it must open on cuda:1, with lazy peer access
    calls = []

    def new_shared_cuda(*args):
        calls.append(args)
        raise RuntimeError("stop here")

    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(new_shared_cuda), raising=False)
    engine = make_engine("cuda-ipc", HostCudaPool("cuda:1"), EngineOptions(visible_gpus=(2, 3)))
    with pytest.raises(TransferError, match="cannot open the CUDA IPC handle of encoder-0"):
        engine.read(source("encoder-0", "p1", gpu=2), torch.empty(64, dtype=torch.uint8), [])
    device, *_, event, sync = calls[0]
    assert device == 1
    assert event is HANDLE.event_handle and sync is True


def test_a_restarted_peer_closes_its_old_mapping_and_the_open_pools_are_bounded(monkeypatch):
    engine = make_engine("cuda-ipc", HostCudaPool(), EngineOptions(visible_gpus=(0,)))
    opened: dict[str, weakref.ref] = {}

    def fake_open(src):
        buf = torch.full((1 << 20,), len(opened) % 250, dtype=torch.uint8)
        opened[src.pool.pool_name] = weakref.ref(buf)
        return buf

    monkeypatch.setattr(engine, "_open", fake_open)
    dst = torch.empty(64, dtype=torch.uint8)
    engine.read(source("encoder-0", "pool-a"), dst, [])
    engine.read(source("encoder-0", "pool-a"), dst, [])  # opened once
    assert list(opened) == ["pool-a"]
    engine.read(source("encoder-0", "pool-b"), dst, [])  # encoder-0 came back with a new pool
    assert engine.mapped() == {"encoder-0": "pool-b"}
    assert opened["pool-a"]() is None, "the old mapping is still referenced, so never closed"
    for i in range(cuda_ipc.MAX_PEERS + 5):
        engine.read(source(f"denoiser-{i}", f"pool-d{i}"), dst, [])
    assert len(engine.mapped()) == cuda_ipc.MAX_PEERS
    assert "encoder-0" not in engine.mapped() and opened["pool-b"]() is None
    engine.forget("pool-d10")
    assert "denoiser-10" not in engine.mapped()


def test_a_peer_gpu_we_cannot_see_is_a_clear_transfer_error(monkeypatch):
    engine = make_engine("cuda-ipc", HostCudaPool(), EngineOptions(visible_gpus=(0, 1)))
    with pytest.raises(TransferError, match="GPU 5 of encoder-0 is not visible"):
        engine.read(source("encoder-0", "p", gpu=5), torch.empty(64, dtype=torch.uint8), [])


# --- compute times include the device's time ----------------------------------------------------------

class AsyncDevicePool(HostCudaPool):
    """A device whose "kernels" finish 0.3 s after the call that queued them returned."""

    def __init__(self):
        super().__init__()
        self.done = threading.Event()

    def queue(self):
        self.done.clear()
        threading.Timer(0.3, self.done.set).start()

    def compute_done(self, mark=None):
        self.done.wait(5)


def test_compute_s_counts_until_the_device_has_finished():
    from disagg.roles.compute import StageRunner
    from disagg.roles.stage import StageOutput
    from disagg.transport.wire.messages import GenerationParams, Staged

    pool = AsyncDevicePool()
    reports = []

    class Stage:
        role = "encoder"
        turn = contextlib.nullcontext()
        turns = None  # schedule fifo: one compute at a time, no step-level turns

        class adapter:
            @staticmethod
            def defaults():
                return {}

        def ticket(self, request_id, params, deadline_s, steps):
            return None

        def run(self, params, inputs, step, ticket=None):
            pool.queue()  # returns at once, as a CUDA launch does
            return StageOutput(tensors={"x": torch.ones(4)})

    runner = StageRunner("encoder-0", pool, {}, lambda msg, frames=(): reports.append(msg))
    runner.stage = Stage()
    runner.execute(Run(request_id="r", attempt=1, params=GenerationParams(prompt="p")), [], time.perf_counter())
    staged = [m for m in reports if isinstance(m, Staged)]
    assert staged and staged[0].compute_s >= 0.25, reports


def test_batched_steps_are_timed_until_the_device_has_finished():
    from disagg.roles.batcher import StepBatcher

    class State:
        def __init__(self):
            self.left = 3

        @property
        def done(self):
            return self.left == 0

    class Adapter:
        batch_key = staticmethod(lambda p: 0)
        denoise_start = staticmethod(lambda inputs, p: State())
        denoise_result = staticmethod(lambda s: {"x": torch.ones(1)})

        @staticmethod
        def denoise_steps(states):
            for s in states:
                s.left -= 1

    batcher = StepBatcher(Adapter(), 2, sync=lambda: time.sleep(0.05))
    _, device_s, _ = batcher.denoise({}, {})
    assert device_s >= 3 * 0.05


# --- --gpus through the scheduler's CUDA_VISIBLE_DEVICES --------------------------------------------------

def test_gpus_map_through_the_parents_visible_devices():
    assert cuda_env([1, 0], {"CUDA_VISIBLE_DEVICES": "4,5"}) == {"CUDA_VISIBLE_DEVICES": "5,4",
                                                                 "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    uuids = "GPU-aaaa-1111,GPU-bbbb-2222,GPU-cccc-3333"
    assert cuda_env([2], {"CUDA_VISIBLE_DEVICES": uuids})["CUDA_VISIBLE_DEVICES"] == "GPU-cccc-3333"
    assert cuda_env([3, 1], {})["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert cuda_env([0], {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"
    assert cuda_env([], {"CUDA_VISIBLE_DEVICES": "4,5"})["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(ConfigError, match=r"GPU 2 not found: CUDA_VISIBLE_DEVICES='4,5'"):
        cuda_env([2], {"CUDA_VISIBLE_DEVICES": "4,5"})


def test_each_role_gets_its_own_gpu_first_through_the_parents_list(monkeypatch, tmp_path):
    from disagg.launcher.deployment import Deployment

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b,GPU-c,GPU-d")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    config = Settings(model="tiny", gpus=[3, 1])
    dep = Deployment(config, run_dir=tmp_path)
    seen = {}
    monkeypatch.setattr(dep.supervisor, "spawn", lambda name, argv, env=None, **kw: seen.setdefault(name, env))
    for p in dep.placements:
        dep.spawn_role(p)
    assert seen["encoder-0"]["CUDA_VISIBLE_DEVICES"] == "GPU-d,GPU-b"  # --gpus 3 first, then 1
    assert seen["denoiser-0"]["CUDA_VISIBLE_DEVICES"] == "GPU-b,GPU-d"
    assert {env["CUDA_DEVICE_ORDER"] for env in seen.values()} == {"PCI_BUS_ID"}


def test_heartbeats_report_a_gpus_free_memory_and_nothing_where_it_is_unknown(monkeypatch):
    from disagg.roles.limits import device_free_memory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 30, 80 << 30))
    assert device_free_memory("cuda:0") == 3 << 30  # free, not total: other processes on the GPU counted
    assert device_free_memory("cpu") == 0 and device_free_memory("sim:0") == 0  # rebalance checks the total

    def broken(device=None):
        raise RuntimeError("CUDA error: unknown error")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    assert device_free_memory("cuda:0") == 0  # unknown: the heartbeat goes on


def test_an_adapter_offloaded_from_a_gpu_model_is_pinned_in_host_memory(monkeypatch):
    """Review L2: the LoRA host tier was pageable, so a restore was a synchronous pageable copy."""
    from torch import nn

    from disagg.roles.extensions.lora_backends import DiffusersLoras

    class Layer(nn.Module):  # a peft LoRA layer's tables: adapter name -> its A and B
        def __init__(self):
            super().__init__()
            self.lora_A = nn.ModuleDict({n: nn.Linear(4, 2) for n in ("a", "b")})
            self.lora_B = nn.ModuleDict({n: nn.Linear(2, 4) for n in ("a", "b")})

    class Pipe:
        _lora_loadable_modules = ["transformer"]

        def __init__(self):
            self.transformer = nn.Sequential(Layer(), nn.Linear(4, 4))
            self.moved = []

        def load_lora_weights(self, *args, **kwargs):
            pass

        def set_lora_device(self, names, device):
            self.moved.append((names, device))

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(tuple(self.shape)) or self.clone())
    pipe = Pipe()
    loras = DiffusersLoras(pipe, "denoiser")
    monkeypatch.setattr(loras, "_device", lambda: torch.device("cuda", 0))
    loras.offload("a")
    assert pipe.moved == [(["a"], "cpu")]
    assert sorted(pinned) == [(2,), (2, 4), (4,), (4, 2)]  # adapter a's A and B (weights, biases); not b's
    pinned.clear()
    monkeypatch.setattr(loras, "_device", lambda: torch.device("cpu"))  # a model on the CPU: nothing to pin
    loras.offload("b")
    assert pinned == []
