"""The data plane as the control messages describe it: a role's pool, a staged slot and the tensors in it,
and where a consumer pulls its input from. Part of the wire schema (transport/messages.py re-exports them)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

Id = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@-]+$")]
Count = Annotated[int, Meta(ge=0)]


class TensorSpec(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """Where one tensor lies inside a slot: byte offset from the slot start."""

    name: Annotated[str, Meta(min_length=1, max_length=128)]
    dtype: Annotated[str, Meta(max_length=32)]
    shape: list[Annotated[int, Meta(ge=0)]]
    offset: Count
    nbytes: Count


class CudaIpcHandle(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """What torch needs to open another process's CUDA allocation (the fields of _share_cuda_)."""

    device: int
    handle: bytes
    storage_bytes: Count
    storage_offset: Count
    ref_counter_handle: bytes
    ref_counter_offset: Count
    event_handle: bytes
    event_sync_required: bool


class PoolInfo(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A role's buffer pool as its peers see it: enough to read from it with any engine it serves."""

    host_id: Annotated[str, Meta(max_length=256)]
    engines: list[Annotated[str, Meta(max_length=32)]]
    pool_name: Annotated[str, Meta(max_length=256)]
    pool_bytes: Count
    #: cpu (host shared memory) or cuda:N (a CUDA allocation)
    device: Annotated[str, Meta(max_length=64)] = "cpu"
    #: mooncake: the peer id ("ip:rpc_port") and the registered base address of the pool
    session_id: Annotated[str, Meta(max_length=256)] = ""
    base_addr: Count = 0
    #: cuda-ipc: the pool's IPC handle, and the physical GPU it lives on
    cuda_ipc: CudaIpcHandle | None = None
    gpu: int | None = None


class SlotRef(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A staged output: which slot of which instance's pool, and what it holds."""

    instance_id: Id
    offset: Count
    nbytes: Count
    tensors: list[TensorSpec]


class Source(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where the consumer pulls its inputs from, and with which engine."""

    slot: SlotRef
    pool: PoolInfo
    engine: Annotated[str, Meta(max_length=32)]
