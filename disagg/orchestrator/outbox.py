"""What the Router returns: messages to send, and the settings it runs with."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from disagg.settings.process import OrchestratorSettings as RouterConfig  # noqa: F401 - the router's settings


@dataclass(slots=True)
class Out:
    """One message to send: to a client (by socket identity) or to an instance (by id)."""

    to_client: bytes | None
    to_instance: str | None
    msg: msgspec.Struct
    frames: list[bytes] = field(default_factory=list)


def to_client(identity: bytes, msg, frames=()) -> Out:
    return Out(identity, None, msg, list(frames))


def to_instance(instance_id: str, msg, frames=()) -> Out:
    return Out(None, instance_id, msg, list(frames))
