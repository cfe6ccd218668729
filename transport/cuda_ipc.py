"""Same host, GPU: open each peer pool's CUDA IPC handle once, then one device copy per pull."""

from __future__ import annotations

import torch

from transport.engines import EngineOptions, EngineUnavailable, TransferEngine, TransferError, check_bounds
from transport.messages import Source
from transport.pool import CudaPool, Pool


class CudaIpcEngine(TransferEngine):
    """Pulls straight from a peer's GPU pool into ours (same GPU, or another over NVLink/PCIe)."""

    name = "cuda-ipc"

    def __init__(self, pool: Pool, options: EngineOptions):
        if not isinstance(pool, CudaPool):
            raise EngineUnavailable("cuda-ipc needs a GPU pool")
        self.pool = pool
        self.visible = list(options.visible_gpus)
        self.gpu = self.visible[pool.buffer.device.index or 0] if self.visible else -1
        self._peers: dict[str, torch.Tensor] = {}

    def advertise(self) -> dict:
        return {"cuda_ipc": self.pool.ipc_handle(), "gpu": self.gpu}

    def _local_device(self, source: Source) -> int:
        """Our cuda:N index of the peer's physical GPU (each role lists its own GPU first)."""
        gpu = source.pool.gpu
        if gpu is None or gpu < 0 or not self.visible:
            return source.pool.cuda_ipc.device
        if gpu not in self.visible:
            raise TransferError(f"GPU {gpu} of {source.slot.instance_id} is not visible to this process")
        return self.visible.index(gpu)

    def _peer(self, source: Source) -> torch.Tensor:
        buf = self._peers.get(source.pool.pool_name)
        if buf is not None:
            return buf
        h = source.pool.cuda_ipc
        if h is None:
            raise TransferError(f"{source.slot.instance_id} advertised no CUDA IPC handle")
        device = self._local_device(source)
        try:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(
                device, h.handle, h.storage_bytes, h.storage_offset,
                h.ref_counter_handle, h.ref_counter_offset, h.event_handle or None, h.event_sync_required,
            )
        except RuntimeError as exc:
            raise TransferError(f"cannot open the CUDA IPC handle of {source.slot.instance_id}: {exc}") from None
        buf = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage, 0, (h.storage_bytes,), (1,))
        self._peers[source.pool.pool_name] = buf
        return buf

    def read(self, source: Source, dst: torch.Tensor, frames: list[bytes]) -> None:
        check_bounds(source, dst)
        peer = self._peer(source)
        slot = source.slot
        dst.copy_(peer[slot.offset : slot.offset + slot.nbytes], non_blocking=True)
        # the producer may reuse the slot as soon as we report Fetched: the copy must be done
        torch.cuda.current_stream(dst.device).synchronize()

    def forget(self, pool_name: str) -> None:
        self._peers.pop(pool_name, None)

    def close(self) -> None:
        self._peers.clear()
