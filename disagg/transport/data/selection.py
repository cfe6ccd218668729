"""Which transfer engine moves a stage's tensors between two instances (torch-free)."""

from __future__ import annotations

from disagg.transport.wire.choice import Choice
from disagg.transport.wire.messages import PoolInfo


class Transfer(Choice):
    """The `transfer` setting: an engine, or auto (per pair of instances, the fastest both serve)."""

    AUTO = "auto"
    CUDA_IPC = "cuda-ipc"
    SHM = "shm"
    MOONCAKE = "mooncake"
    INLINE = "inline"


#: fastest first
ENGINES = tuple(t.value for t in Transfer if t != Transfer.AUTO)
CHOICES = Transfer.values()


def choose_engine(forced: str, producer: PoolInfo, consumer: PoolInfo) -> tuple[Transfer, str | None]:
    """The engine for one producer->consumer hop, and a warning when it is a poor fallback.

    auto: same host -> cuda-ipc (GPU pools) or shm (host pools); other host -> mooncake;
    inline only when nothing else is shared by both ends.
    """
    forced = Transfer(forced)
    common = [e for e in ENGINES if e in producer.engines and e in consumer.engines]
    if forced != Transfer.AUTO:
        if forced in common:
            return forced, None
        return Transfer.INLINE, (
            f"--transfer {forced} is not served by both {producer.pool_name} ({', '.join(producer.engines)}) "
            f"and {consumer.pool_name} ({', '.join(consumer.engines)}); using inline"
        )
    same_host = producer.host_id == consumer.host_id
    if same_host:
        for engine in (Transfer.CUDA_IPC, Transfer.SHM):
            if engine in common:
                return engine, None
    if Transfer.MOONCAKE in common:
        return Transfer.MOONCAKE, None
    if not same_host:
        why = "they are on different hosts and do not both serve mooncake"
    else:
        why = f"they share no faster engine ({producer.device} pool -> {consumer.device} pool)"
    return Transfer.INLINE, f"tensors from {producer.pool_name} to {consumer.pool_name} go inline through the orchestrator: {why}"
