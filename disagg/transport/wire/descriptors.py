"""What the control messages describe: a role's pool, a staged slot and the tensors in it, where a consumer
pulls its input from, what an instance holds (Held) and which model it serves (ModelIdentity). Part of the
wire schema (disagg/transport/wire/messages.py re-exports them)."""

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

#: a role's name, as every message spells it
Role = Annotated[str, Meta(pattern="^(encoder|denoiser|decoder|monolith)$")]


class HeldPreview(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a held preview copy is (its Preview message's fields): an orchestrator that restarted sends it
    to a decoder again, never resumes its request from it."""

    index: Annotated[int, Meta(ge=0, le=2)]
    step: Count
    steps: Count = 0
    staged_at: float = 0.0


class Held(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An output a role holds in its pool (its Staged, or a Preview's copy of the latents), told again in
    every Register: an orchestrator that restarted resumes the request from it instead of starting over,
    or releases it."""

    request_id: Id
    attempt: Count
    #: the role that made it (the stage it ends)
    role: Role
    slot: SlotRef
    #: the request's seed (the first orchestrator may have chosen it): the rest of its stages use it too
    seed: int | None = None
    #: set for a preview's copy of the latents (a step before the last): never the stage's output
    preview: HeldPreview | None = None
    #: a denoiser's step cache, as its Staged said (label, steps computed and skipped): the request's result
    #: reports them even when it resumes from this output after a restart
    cache: Annotated[str, Meta(max_length=1024)] | None = None
    steps_computed: Count | None = None
    steps_skipped: Count | None = None


class ModelIdentity(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What makes two instances serve the same model: the name as given (`--model`), the checkpoint's family,
    the weights' dtype as configured, and a digest of its configs (model_index.json and each component's)."""

    name: Annotated[str, Meta(max_length=1024)]
    family: Annotated[str, Meta(max_length=64)] = ""
    dtype: Annotated[str, Meta(max_length=32)] = ""
    digest: Annotated[str, Meta(max_length=64)] = ""

    def same_model(self, other: "ModelIdentity") -> bool:
        return (self.family, self.dtype, self.digest) == (other.family, other.dtype, other.digest)

    def describe(self) -> str:
        details = ", ".join(x for x in (self.family, self.dtype, self.digest and f"digest {self.digest}") if x)
        return f"{self.name!r} ({details})" if details else repr(self.name)
