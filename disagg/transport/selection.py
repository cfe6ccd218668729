"""Which transfer engine moves a stage's tensors between two instances (torch-free)."""

from __future__ import annotations

from disagg.transport.choice import Choice
from disagg.transport.messages import PoolInfo


class Transfer(Choice):
    """The `transfer` setting: an engine, or auto (per pair of instances, the fastest both serve)."""

    AUTO = "auto"
    CUDA_IPC = "cuda-ipc"
    SHM = "shm"
    MOONCAKE = "mooncake"
    INLINE = "inline"


#: fastest first
ENGINES = tuple(t.value for t in Transfer if t is not Transfer.AUTO)
CHOICES = Transfer.values()


def choose_engine(forced: str, producer: PoolInfo, consumer: PoolInfo) -> tuple[str, str | None]:
    """The engine for one producer->consumer hop, and a warning when it is a poor fallback.

    auto: same host -> cuda-ipc (GPU pools) or shm (host pools); other host -> mooncake;
    inline only when nothing else is shared by both ends.
    """
    common = [e for e in ENGINES if e in producer.engines and e in consumer.engines]
    if Transfer(forced) is not Transfer.AUTO:
        if forced in common:
            return forced, None
        return "inline", (
            f"--transfer {forced} is not served by both {producer.pool_name} ({', '.join(producer.engines)}) "
            f"and {consumer.pool_name} ({', '.join(consumer.engines)}); using inline"
        )
    same_host = producer.host_id == consumer.host_id
    if same_host:
        for engine in ("cuda-ipc", "shm"):
            if engine in common:
                return engine, None
    if "mooncake" in common:
        return "mooncake", None
    if not same_host:
        why = "they are on different hosts and do not both serve mooncake"
    else:
        why = f"they share no faster engine ({producer.device} pool -> {consumer.device} pool)"
    return "inline", f"tensors from {producer.pool_name} to {consumer.pool_name} go inline through the orchestrator: {why}"
