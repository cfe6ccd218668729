"""What the Router returns: messages to send, and the settings it runs with."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from orchestrator.requests import ROLES
from transport.messages import ModelIdentity


@dataclass
class RouterConfig:
    """Settings of the router (from the deployment config)."""

    heartbeat_timeout_s: float = 3.0
    request_timeout_s: float = 600.0
    dispatch: str = "max-free-slots"
    transfer: str = "auto"
    #: an instance holding work whose progress counter stands still this long is dead for it
    stall_timeout_s: float = 120.0
    #: new attempts after an instance dies under a request; then the request fails
    max_retries: int = 2
    #: per role: a Submit is refused while that role's to-be-assigned queue is this long
    max_queue: dict[str, int] = field(default_factory=lambda: {r: 4096 for r in ROLES})
    #: colocated deployment: requests go to monolithic instances instead of the three pools
    colocated: bool = False
    #: the deployment this orchestrator serves; instances registering with another id are refused
    #: (empty: any)
    deployment_id: str = ""
    #: role -> warm standbys to keep: loaded, registered instances that get no work until an instance of
    #: their role dies, then take over at once (--standby)
    standby: dict[str, int] = field(default_factory=dict)
    #: of equally good consumers, prefer the one on the producer's host (false: host-blind, to compare)
    host_aware: bool = True
    #: a role with no instance (none registered, or all dead or draining) for this long makes the deployment
    #: refuse Submits at once as "not ready", and fail the requests waiting for that role
    join_wait_s: float = 30.0
    #: the model the deployment serves (transport.messages.ModelIdentity); None: the first registered
    #: instance's. An instance serving another is refused at Register
    model: "ModelIdentity | None" = None
    #: the host the orchestrator runs on (as launchers name hosts): `disagg stop --host` warns for it
    host_id: str = ""


@dataclass
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
