"""A role's buffer pool: one shared-memory segment, mapped once, carved into slots."""

from __future__ import annotations

import mmap
import os

import torch

from transport.allocator import SlotAllocator
from transport.manifest import pack, plan
from transport.messages import SlotRef
from transport.shm import shm_path

class Pool:
    """Preallocated, pre-faulted shared memory that peers on this host can map by name."""

    def __init__(self, name: str, nbytes: int):
        self.name = name
        self.nbytes = nbytes
        self.allocator = SlotAllocator(nbytes)
        fd = os.open(shm_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._mm, dtype=torch.uint8)
        # Touch every page now: fresh shared memory costs a page fault per 4 KiB on first use.
        self.buffer.zero_()

    @property
    def free_bytes(self) -> int:
        return self.allocator.free_bytes

    def alloc(self, nbytes: int) -> int:
        return self.allocator.alloc(nbytes)

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes]

    def stage(self, instance_id: str, tensors: dict[str, torch.Tensor]) -> SlotRef:
        """Copy tensors into a fresh slot and describe it."""
        specs, nbytes = plan(tensors)
        offset = self.alloc(nbytes)
        try:
            pack(tensors, self.view(offset, nbytes), specs)
        except BaseException:
            self.free(offset)
            raise
        return SlotRef(instance_id=instance_id, offset=offset, nbytes=nbytes, tensors=specs)

    def close(self) -> None:
        self.buffer = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        try:
            os.unlink(shm_path(self.name))
        except FileNotFoundError:
            pass
