"""Transfer engines: read a byte range of a peer's pool into our own pool."""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch

from transport.messages import Source
from transport.shm import shm_path


class TransferError(RuntimeError):
    """A pull that did not deliver the bytes it was asked for."""


class TransferEngine(ABC):
    """Pulls a peer's staged slot into a destination slice of our pool."""

    name: ClassVar[str]

    @abstractmethod
    def read(self, source: Source, dst: torch.Tensor, frames: list[bytes]) -> None:
        """Fill `dst` (uint8, `source.slot.nbytes` long) with the source slot's bytes."""

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


class ShmEngine(TransferEngine):
    """Same host, CPU: map each peer's shared memory once, then memcpy."""

    name = "shm"

    def __init__(self):
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
            mm = mmap.mmap(fd, source.pool.pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        arr = np.frombuffer(mm, dtype=np.uint8)
        self._maps[source.pool.pool_name] = (mm, arr)
        return arr

    def read(self, source: Source, dst: torch.Tensor, frames: list[bytes]) -> None:
        check_bounds(source, dst)
        peer = self._peer(source)
        np.copyto(dst.numpy(), peer[source.slot.offset : source.slot.offset + source.slot.nbytes])

    def forget(self, pool_name: str) -> None:
        """Drop a cached mapping (the peer restarted with a new pool)."""
        self._maps.pop(pool_name, None)

    def close(self) -> None:
        self._maps.clear()


class InlineEngine(TransferEngine):
    """Last resort: the bytes rode in a ZeroMQ frame through the orchestrator."""

    name = "inline"

    def read(self, source: Source, dst: torch.Tensor, frames: list[bytes]) -> None:
        check_bounds(source, dst)
        if not frames or len(frames[0]) != source.slot.nbytes:
            got = len(frames[0]) if frames else 0
            raise TransferError(f"inline payload of {got} bytes, expected {source.slot.nbytes}")
        np.copyto(dst.numpy(), np.frombuffer(frames[0], dtype=np.uint8))


def local_engines(device: str) -> list[str]:
    """Engines this process can serve and use, fastest first."""
    names = []
    # pools live in host shared memory for every device today, so shm works for GPU roles too
    if os.path.isdir("/dev/shm"):
        names.append("shm")
    names.append("inline")
    return names


def make_engine(name: str) -> TransferEngine:
    if name == "shm":
        return ShmEngine()
    if name == "inline":
        return InlineEngine()
    raise ValueError(f"unknown transfer engine {name!r}")
