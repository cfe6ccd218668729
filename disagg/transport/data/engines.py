"""Transfer engines: read a byte range of a peer's pool into a slot of our own pool.

Every engine has the same two sides: `advertise` says what peers need to read from our pool
(it travels in Register), `read` pulls a peer's staged slot. Callers never know which engine
they hold.
"""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from disagg.transport.data.pool import Pool
from disagg.transport.data.selection import Transfer
from disagg.transport.data.shm import shm_path
from disagg.transport.wire.messages import Source

MOONCAKE_HINT = (
    "install it with `pip install 'disagg[mooncake-cpu]'` on CPU hosts (plus Debian's libibverbs1: "
    "`apt-get install -y libibverbs1`) or `pip install 'disagg[mooncake]'` on CUDA hosts"
)


class TransferError(RuntimeError):
    """A pull that did not deliver the bytes it was asked for (a request-scoped error)."""


class EngineUnavailable(RuntimeError):
    """An engine that cannot run in this process (package missing, no device, init failed)."""


class NotApplicable(EngineUnavailable):
    """An engine that does not apply here at all (another kind of pool, its package not installed): nothing is
    wrong. Any other EngineUnavailable is a problem an operator must see (make_engines' `problems`)."""


@dataclass
class EngineOptions:
    """Settings shared by every engine of a role."""

    data_host: str = "127.0.0.1"  # the address peers on other hosts reach us at
    protocol: str = "tcp"  # mooncake: tcp or rdma
    ib_device: str = ""  # mooncake rdma: the NIC, e.g. mlx5_0
    visible_gpus: tuple[int, ...] = ()  # physical GPU ids in this process's cuda:N order


class TransferEngine(ABC):
    """Pulls a peer's staged slot into a destination slice of our pool."""

    name: ClassVar[str]

    def advertise(self) -> dict:
        """PoolInfo fields peers need to read from our pool with this engine."""
        return {}

    @abstractmethod
    def read(self, source: Source, dst: torch.Tensor, frames: list[bytes]) -> None:
        """Fill `dst` (uint8, `source.slot.nbytes` long) with the source slot's bytes."""

    def peer_pools(self) -> list[str]:
        """The names of the peer pools this engine holds open (mapped), sorted (heartbeats carry them)."""
        return []

    def forget(self, pool_name: str) -> None:
        """Drop anything cached about a peer's pool, closing its mapping (its instance is gone)."""

    def close(self) -> None:
        pass


def check_bounds(source: Source, dst: torch.Tensor) -> None:
    slot = source.slot
    if slot.offset + slot.nbytes > source.pool.pool_bytes:
        raise TransferError(
            f"slot [{slot.offset}, {slot.offset + slot.nbytes}) lies outside the "
            f"{source.pool.pool_bytes}-byte pool of {slot.instance_id}"
        )
    if dst.numel() != slot.nbytes:
        raise TransferError(f"destination holds {dst.numel()} bytes, slot has {slot.nbytes}")
    for spec in slot.tensors:
        if spec.offset + spec.nbytes > slot.nbytes:
            raise TransferError(f"tensor {spec.name!r} lies outside its {slot.nbytes}-byte slot")


class ShmEngine(TransferEngine):
    """Same host, CPU: map each peer's shared memory once (pre-faulted), then memcpy."""

    name = "shm"

    def __init__(self, pool: Pool, options: EngineOptions):
        if pool.device != "cpu":
            raise NotApplicable("shm needs a host-memory pool")
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}

    def _peer(self, source: Source) -> np.ndarray:
        cached = self._maps.get(source.pool.pool_name)
        if cached is not None and len(cached[0]) == source.pool.pool_bytes:
            return cached[1]
        try:
            fd = os.open(shm_path(source.pool.pool_name), os.O_RDONLY)
        except OSError as exc:
            raise TransferError(f"cannot open the pool of {source.slot.instance_id}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size < source.pool.pool_bytes:
                raise TransferError(
                    f"pool of {source.slot.instance_id} is {size} bytes, expected {source.pool.pool_bytes}"
                )
            # MAP_POPULATE: fault the whole mapping in now, once, not page by page on every first read
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, source.pool.pool_bytes, flags, mmap.PROT_READ)
        finally:
            os.close(fd)
        arr = np.frombuffer(mm, dtype=np.uint8)
        self._maps[source.pool.pool_name] = (mm, arr)
        return arr

    def read(self, source: Source, dst: torch.Tensor, frames: list[bytes]) -> None:
        check_bounds(source, dst)
        peer = self._peer(source)
        # numpy on both sides: slicing is ~20x cheaper than torch's and the copy is one memcpy
        np.copyto(dst.numpy(), peer[source.slot.offset : source.slot.offset + source.slot.nbytes])

    def peer_pools(self) -> list[str]:
        return sorted(self._maps)

    def forget(self, pool_name: str) -> None:
        # a read in progress keeps its own reference: the mapping closes when that read is done
        self._maps.pop(pool_name, None)

    def close(self) -> None:
        self._maps.clear()


class InlineEngine(TransferEngine):
    """Last resort: the bytes rode in a ZeroMQ frame through the orchestrator."""

    name = "inline"

    def __init__(self, pool: Pool, options: EngineOptions):
        self.pool = pool

    def read(self, source: Source, dst: torch.Tensor, frames: list[bytes]) -> None:
        check_bounds(source, dst)
        if not frames or len(frames[0]) != source.slot.nbytes:
            got = len(frames[0]) if frames else 0
            raise TransferError(f"inline payload of {got} bytes, expected {source.slot.nbytes}")
        src = np.frombuffer(frames[0], dtype=np.uint8)
        if dst.device.type == "cpu":
            np.copyto(dst.numpy(), src)
            return
        # a GPU pool: through pinned host memory (one DMA), on its copy stream, not behind the compute queued
        # on the default one; the block ends when the copy is done
        host = self.pool.host_buffer(source.slot.nbytes)
        np.copyto(host.numpy(), src)
        with self.pool.copying():
            dst.copy_(host, non_blocking=True)


def _engine_classes() -> dict[str, type[TransferEngine]]:
    from disagg.transport.data.cuda_ipc import CudaIpcEngine
    from disagg.transport.data.mooncake_engine import MooncakeEngine

    return {Transfer.CUDA_IPC: CudaIpcEngine, Transfer.SHM: ShmEngine, Transfer.MOONCAKE: MooncakeEngine,
            Transfer.INLINE: InlineEngine}


def make_engine(name: str, pool: Pool, options: EngineOptions | None = None) -> TransferEngine:
    """One engine serving `pool`; raises EngineUnavailable with the reason if it cannot run here."""
    classes = _engine_classes()
    if name not in classes:
        raise ValueError(f"unknown transfer engine {name!r}; choose from {', '.join(classes)}")
    return classes[name](pool, options or EngineOptions())


def make_engines(pool: Pool, forced: str = Transfer.AUTO, options: EngineOptions | None = None, log=None,
                 problems: dict[str, str] | None = None) -> dict[str, TransferEngine]:
    """Every engine this process can serve, fastest first. A forced engine must work (else raise). `problems`
    gets each engine that applies here but could not start, with the reason (a GPU pool Mooncake cannot register,
    one torch cannot share over CUDA IPC): hand-offs that needed it go inline through the orchestrator. Under a
    forced engine the others are not used, so none is a problem."""
    engines: dict[str, TransferEngine] = {}
    for name in _engine_classes():
        try:
            engines[name] = make_engine(name, pool, options)
        except EngineUnavailable as exc:
            if name == forced:
                raise
            if isinstance(exc, NotApplicable):
                continue
            if log is not None:
                log.warning("%s engine unavailable: %s", name, exc)
            if problems is not None and Transfer(forced) == Transfer.AUTO:
                problems[name] = str(exc)[:1024]
    return engines
