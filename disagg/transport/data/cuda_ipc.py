"""Same host, GPU: open each peer pool's CUDA IPC handle once, then one device copy per pull."""

from __future__ import annotations

import collections
import os
import threading

import torch

from disagg.transport.data.engines import (
    EngineOptions,
    EngineUnavailable,
    NotApplicable,
    TransferEngine,
    TransferError,
    check_bounds,
)
from disagg.transport.data.pool import CudaPool, Pool
from disagg.transport.environment import PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF
from disagg.transport.wire.messages import Source

#: allocator settings whose memory cudaIpcGetMemHandle cannot export (torch refuses or hands out another kind)
UNSHAREABLE_ALLOC_CONF = ("expandable_segments:true", "backend:cudamallocasync")
#: the most peer pools kept open at once (the least recently used is closed first)
MAX_PEERS = 64


#: where torch reads its allocator settings: the generic name (torch >= 2.9) and the older CUDA one
ALLOC_CONF_VARIABLES = (PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF)


def alloc_conf_problem(conf: str, variable: str = PYTORCH_CUDA_ALLOC_CONF) -> str:
    """Why allocator settings `conf` (from `variable`) keep a pool from being shared over CUDA IPC ('' if not)."""
    settings = conf.replace(" ", "").lower().split(",")
    bad = [s for s in UNSHAREABLE_ALLOC_CONF if s in settings]
    return f"{variable}={conf!r} ({', '.join(bad)}) makes allocations CUDA IPC cannot export" if bad else ""


def environ_alloc_conf_problem(environ=os.environ) -> str:
    """Why either allocator variable keeps pools from being shared over CUDA IPC ('' if neither does)."""
    problems = (alloc_conf_problem(environ.get(v, ""), v) for v in ALLOC_CONF_VARIABLES)
    return "; ".join(p for p in problems if p)


class CudaIpcEngine(TransferEngine):
    """Pulls straight from a peer's GPU pool into ours (same GPU, or another over NVLink/PCIe).

    A peer's pool is opened once, on our own device (lazy peer access: no CUDA context on the peer's
    GPU), and closed when that instance comes back with another pool or falls out of the MAX_PEERS
    most recently read. Copies run on the pool's copy stream, and a pull waits for that stream only."""

    name = "cuda-ipc"

    def __init__(self, pool: Pool, options: EngineOptions):
        if not isinstance(pool, CudaPool):
            raise NotApplicable("cuda-ipc needs a GPU pool")
        problem = environ_alloc_conf_problem()
        if problem:
            raise EngineUnavailable(problem)
        if pool.ipc is None:
            raise EngineUnavailable(f"torch cannot share the pool over CUDA IPC: {pool.ipc_error}")
        self.pool = pool
        self.visible = list(options.visible_gpus)
        self.device = torch.device(pool.device).index or 0
        self.gpu = self.visible[self.device] if self.visible else -1
        #: instance id -> (pool name, the peer's pool opened here), least recently read first; under `_lock`:
        #: executor threads read, the loop thread forgets
        self._peers: collections.OrderedDict[str, tuple[str, torch.Tensor]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def advertise(self) -> dict:
        return {"cuda_ipc": self.pool.ipc, "gpu": self.gpu}

    def _check_visible(self, source: Source) -> None:
        gpu = source.pool.gpu
        if gpu is not None and gpu >= 0 and self.visible and gpu not in self.visible:
            raise TransferError(f"GPU {gpu} of {source.slot.instance_id} is not visible to this process")

    def _open(self, source: Source) -> torch.Tensor:
        """The peer's whole pool as a uint8 tensor on our device (its memory stays on the peer's GPU)."""
        h = source.pool.cuda_ipc
        try:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(
                self.device, h.handle, h.storage_bytes, h.storage_offset,
                h.ref_counter_handle, h.ref_counter_offset, h.event_handle, h.event_sync_required,
            )
        except (RuntimeError, TypeError) as exc:
            raise TransferError(f"cannot open the CUDA IPC handle of {source.slot.instance_id}: {exc}") from None
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{self.device}").set_(storage, 0, (h.storage_bytes,), (1,))

    def _peer(self, source: Source) -> torch.Tensor:
        instance, name = source.slot.instance_id, source.pool.pool_name
        with self._lock:
            cached = self._peers.get(instance)
            if cached is not None and cached[0] == name:
                self._peers.move_to_end(instance)
                return cached[1]
            if source.pool.cuda_ipc is None:
                raise TransferError(f"{instance} advertised no CUDA IPC handle")
            self._check_visible(source)
            # a new pool under a known instance: it restarted. Dropping our last reference to the old pool
            # closes its mapping (torch calls cudaIpcCloseMemHandle with the storage); opened under the lock, so
            # two threads never open one pool twice
            self._peers.pop(instance, None)
            buf = self._open(source)
            self._peers[instance] = (name, buf)
            while len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)
            return buf

    def read(self, source: Source, dst: torch.Tensor, frames: list[bytes]) -> None:
        check_bounds(source, dst)
        peer = self._peer(source)
        slot = source.slot
        # a pull waits for no one's compute; the block ends when its copy is done (the producer may reuse the
        # slot as soon as we report Fetched)
        with self.pool.copying():
            dst.copy_(peer[slot.offset : slot.offset + slot.nbytes], non_blocking=True)

    def mapped(self) -> dict[str, str]:
        """Instance id -> pool name of every peer pool open here."""
        with self._lock:
            return {k: v[0] for k, v in self._peers.items()}

    def peer_pools(self) -> list[str]:
        return sorted(self.mapped().values())

    def forget(self, pool_name: str) -> None:
        with self._lock:
            for instance, (name, _) in list(self._peers.items()):
                if name == pool_name:
                    del self._peers[instance]

    def close(self) -> None:
        with self._lock:
            self._peers.clear()
