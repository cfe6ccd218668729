"""A role's buffer pool: allocated once, registered once, carved into slots.

On the CPU it is one shared-memory segment that same-host peers map by name; on a GPU it is one
CUDA allocation that same-host peers open through its IPC handle.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading

import torch

from disagg.transport.data.allocator import PoolFull, SlotAllocator
from disagg.transport.data.manifest import pack, plan
from disagg.transport.data.shm import shm_path
from disagg.transport.wire.messages import CudaIpcHandle, SlotRef


class Pool:
    """Slots over one preallocated byte buffer (`self.buffer`, a uint8 tensor)."""

    device = "cpu"

    def __init__(self, name: str, nbytes: int):
        self.name = name
        self.nbytes = nbytes
        self.allocator = SlotAllocator(nbytes)
        self.buffer: torch.Tensor | None = None
        # guards the allocator only: copies into slots run unlocked, so a Release handled on a
        # role's loop thread never waits behind another thread's multi-MiB copy
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        return self.allocator.free_bytes

    def alloc(self, nbytes: int) -> int:
        if nbytes > self.nbytes:
            raise PoolFull(
                f"a payload of {nbytes} bytes does not fit the {self.nbytes}-byte pool of this instance "
                f"(raise pool_mib for its role)", transient=False
            )
        with self._lock:
            return self.allocator.alloc(nbytes)

    def free(self, offset: int) -> None:
        with self._lock:
            self.allocator.free(offset)

    def mark(self):
        """A point in the compute this thread has queued so far on the pool's device (a GPU pool: a CUDA event
        recorded now on the compute stream; None here, where compute is synchronous)."""
        return None

    def copying(self, after=None):
        """Where copies into and out of the pool run; they are complete when the block ends, and only they are
        waited for (a GPU pool: this thread's copy stream, and an event recorded after its copies). `after`: a
        `mark` the copies first wait for (the tensors to copy come from that compute), not the whole stream."""
        return contextlib.nullcontext()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes]

    def stage(self, instance_id: str, tensors: dict[str, torch.Tensor], after=None) -> SlotRef:
        """Copy tensors into a fresh slot and describe it; the bytes are complete on return. `after`: the `mark`
        of the compute that made the tensors (None: the compute this thread queued so far)."""
        specs, nbytes = plan(tensors)
        offset = self.alloc(nbytes)
        try:
            with self.copying(after=self.mark() if after is None else after):
                pack(tensors, self.view(offset, nbytes), specs)
        except BaseException:
            self.free(offset)
            raise
        return SlotRef(instance_id=instance_id, offset=offset, nbytes=nbytes, tensors=specs)

    def compute_done(self, mark=None) -> None:
        """Wait until the compute this thread queued on the pool's device has finished, up to `mark` (None: up to
        now); timers call it: GPU kernels run asynchronously, so a timer stopped without it sees only the launch
        time. Compute queued after the mark, by other requests' threads, is not waited for."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer for a copy to or from the pool (a GPU pool: pinned, so the copy is one DMA)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def close(self) -> None:
        self.buffer = None


class ShmPool(Pool):
    """Host shared memory, pre-faulted, that peers on this host map by name."""

    def __init__(self, name: str, nbytes: int):
        super().__init__(name, nbytes)
        fd = os.open(shm_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._mm, dtype=torch.uint8)
        # Touch every page now: fresh shared memory costs a page fault per 4 KiB on first use.
        self.buffer.zero_()

    def close(self) -> None:
        super().close()
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        try:
            os.unlink(shm_path(self.name))
        except FileNotFoundError:
            pass


class CudaPool(Pool):
    """One CUDA allocation; outputs of GPU stages are staged here with no host round trip.

    Copies into and out of it run on a copy stream of the copying thread's own; they wait for the event of the
    compute that made their tensors, and a handoff waits for an event recorded after its own copies: it never
    waits behind other requests' denoising steps queued on the compute stream, nor their copies. Its
    CUDA IPC handle is made once, here: making it again would swap the storage's data pointer under
    copies that may be running."""

    def __init__(self, name: str, nbytes: int, device: str):
        super().__init__(name, nbytes)
        self.device = device
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._streams = threading.local()
        #: the IPC handle, or why there is none (cuda-ipc then refuses to serve this pool)
        self.ipc: CudaIpcHandle | None = None
        self.ipc_error = ""
        try:
            self.ipc = share_handle(self.buffer)
        except (RuntimeError, TypeError) as exc:
            self.ipc_error = f"{type(exc).__name__}: {exc}"

    def _copy_stream(self) -> "torch.cuda.Stream":
        """This thread's copy stream: one per thread, so one request's copies never queue behind another's
        (a preview's copy waits for its own request's compute)."""
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.buffer.device)
        return stream

    def mark(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.buffer.device))
        return event

    @contextlib.contextmanager
    def copying(self, after=None):
        stream = self._copy_stream()
        if after is not None:
            stream.wait_event(after)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            copied = torch.cuda.Event()
            copied.record(stream)
            copied.synchronize()  # our own copies only, not what other threads queued

    def compute_done(self, mark=None) -> None:
        (self.mark() if mark is None else mark).synchronize()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def ipc_handle(self) -> CudaIpcHandle:
        if self.ipc is None:
            raise RuntimeError(f"the pool {self.name} has no CUDA IPC handle: {self.ipc_error}")
        return self.ipc


def share_handle(buffer: torch.Tensor) -> CudaIpcHandle:
    """The 8 fields torch's _new_shared_cuda needs to open `buffer`'s allocation in another process."""
    (device, handle, size, offset, ref_handle, ref_offset, event, sync) = buffer.untyped_storage()._share_cuda_()
    return CudaIpcHandle(device, handle, size, offset, ref_handle, ref_offset, event or b"", bool(sync))


def make_pool(name: str, nbytes: int, device: str) -> Pool:
    """The pool for a role on `device`: shared memory on the CPU, a CUDA allocation on a GPU."""
    if device.startswith("cuda"):
        return CudaPool(name, nbytes, device)
    return ShmPool(name, nbytes)  # cpu, and the simulated devices of sim models
