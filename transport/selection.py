"""Which transfer engine moves a stage's tensors between two instances (torch-free)."""

from __future__ import annotations

from transport.messages import PoolInfo

ENGINES = ("shm", "inline")
CHOICES = ("auto",) + ENGINES


def choose_engine(forced: str, producer: PoolInfo, consumer: PoolInfo) -> tuple[str, str | None]:
    """The engine for one producer->consumer hop, and a warning when it is a poor fallback."""
    common = [e for e in producer.engines if e in consumer.engines]
    if forced != "auto":
        if forced not in common:
            return "inline", (
                f"--transfer {forced} is not supported by both {producer.pool_name} and "
                f"{consumer.pool_name} (they share {common}); using inline"
            )
        return forced, None
    same_host = producer.host_id == consumer.host_id
    if same_host and "shm" in common:
        return "shm", None
    why = "they are on different hosts" if not same_host else "they share no shared-memory engine"
    return "inline", f"tensors between {producer.pool_name} and {consumer.pool_name} go inline: {why}"
