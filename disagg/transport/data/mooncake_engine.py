"""Any host: Mooncake Transfer Engine reads from a peer's registered pool (tcp or rdma)."""

from __future__ import annotations

from importlib import metadata

import torch

from disagg.transport.data.engines import (
    MOONCAKE_HINT,
    EngineOptions,
    EngineUnavailable,
    NotApplicable,
    TransferEngine,
    TransferError,
    check_bounds,
)
from disagg.transport.data.pool import Pool
from disagg.transport.wire.messages import Source

#: the wheels that install the `mooncake` module: the CUDA build, and the one for hosts without CUDA
CUDA_BUILD = "mooncake-transfer-engine"
HOST_BUILD = "mooncake-transfer-engine-non-cuda"

#: P2P handshake: peers exchange segment metadata directly, no etcd and no master
METADATA = "P2PHANDSHAKE"


class MooncakeEngine(TransferEngine):
    """Registers our pool once with Mooncake; pulls a peer slot tensor by tensor in one batch."""

    name = "mooncake"

    def __init__(self, pool: Pool, options: EngineOptions):
        try:
            from mooncake.engine import TransferEngine as Mooncake
        except ImportError as exc:
            raise NotApplicable(f"mooncake is not installed ({exc}): {MOONCAKE_HINT}") from None
        if pool.device.startswith("cuda") and not cuda_build_installed():
            # its TCP transport stages device memory through cudaMemcpy only when built with CUDA: the
            # host build would read the GPU address as host memory (EFAULT, or a crash)
            raise EngineUnavailable(
                f"the installed Mooncake ({installed_build() or 'unknown build'}) has no CUDA support and cannot "
                f"move a GPU pool; install {CUDA_BUILD} (`pip install 'disagg[mooncake]'`) instead of {HOST_BUILD}"
            )
        self.engine = Mooncake()
        rc = self.engine.initialize(options.data_host, METADATA, options.protocol, options.ib_device)
        if rc != 0:
            raise EngineUnavailable(
                f"Mooncake initialize({options.data_host!r}, {METADATA}, {options.protocol!r}, {options.ib_device!r}) returned {rc}"
            )
        self.session_id = f"{options.data_host}:{self.engine.get_rpc_port()}"
        self.base = pool.buffer.data_ptr()
        self.pool_bytes = pool.nbytes
        rc = self.engine.register_memory(self.base, pool.nbytes)
        if rc != 0:
            raise EngineUnavailable(f"Mooncake register_memory of the {pool.nbytes}-byte pool returned {rc}")

    def advertise(self) -> dict:
        return {"session_id": self.session_id, "base_addr": self.base}

    def read(self, source: Source, dst: torch.Tensor, frames: list[bytes]) -> None:
        check_bounds(source, dst)
        pool, slot = source.pool, source.slot
        if not pool.session_id or not pool.base_addr:
            raise TransferError(f"{slot.instance_id} advertised no Mooncake session")
        remote = pool.base_addr + slot.offset
        local = dst.data_ptr()
        parts = [(s.offset, s.nbytes) for s in slot.tensors if s.nbytes] or [(0, slot.nbytes)]
        if len(parts) == 1:
            off, n = parts[0]
            rc = self.engine.transfer_sync_read(pool.session_id, local + off, remote + off, n)
        else:
            rc = self.engine.batch_transfer_sync_read(
                pool.session_id, [local + o for o, _ in parts], [remote + o for o, _ in parts], [n for _, n in parts]
            )
        if rc != 0:
            raise TransferError(
                f"mooncake read of {slot.nbytes} bytes from {slot.instance_id} ({pool.session_id}) failed with code {rc}"
            )

    def close(self) -> None:
        try:
            self.engine.unregister_memory(self.base)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def installed_build() -> str:
    """Which Mooncake wheel is installed ('' if neither is)."""
    for dist in (CUDA_BUILD, HOST_BUILD):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return ""


def cuda_build_installed() -> bool:
    return installed_build().startswith(CUDA_BUILD + " ")
