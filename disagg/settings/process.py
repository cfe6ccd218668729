"""Each process's own settings object: its schema fields (disagg/settings/schema.py, declared once) plus what the
launcher works out for it (ids, addresses, devices). The launcher encodes one as JSON on the process's command
line (or a spare's stdin); the process decodes it, and an unknown key is an error, not silently dropped.

    python -m disagg.orchestrator SETTINGS_JSON   OrchestratorSettings
    python -m disagg.gateway SETTINGS_JSON        GatewaySettings (the API key comes in DISAGG_HTTP_API_KEY, not argv)
    python -m disagg.roles SETTINGS_JSON          RoleSettings
"""

from __future__ import annotations

import typing
from functools import cache

import msgspec

from disagg.settings.fields import sections_for, top_level_for
from disagg.settings.schema import Settings, world_of
from disagg.transport.wire.descriptors import ModelIdentity


@cache
def _hints() -> dict:
    return typing.get_type_hints(Settings, include_extras=True)


def _with_schema_fields(process: str, base: type) -> type:
    """`base` (its launcher-made fields) plus every top-level schema field `process` reads, same name, type,
    bounds and default, and every section it reads (sections_for: loras, rebalance, http), whole."""
    defaults = Settings()
    fields = [(name, _hints()[name], getattr(defaults, name)) for name in top_level_for(process)]
    fields += [(name, _hints()[name], msgspec.field(default_factory=type(getattr(defaults, name))))
               for name in sections_for(process)]
    return msgspec.defstruct(base.__name__.lstrip("_"), fields, bases=(base,), module=__name__, kw_only=True,
                             forbid_unknown_fields=True)


class _OrchestratorSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What `python -m disagg.orchestrator` is told, besides its schema fields."""

    #: the deployment it serves; instances registering with another id are refused (empty: any)
    deployment_id: str = ""
    #: the host it runs on, as launchers name hosts: `disagg stop --host` warns for it
    host_id: str = ""
    #: the model the deployment serves; None: the first registered instance's. Another is refused at Register
    model_identity: ModelIdentity | None = None
    #: role -> warm standbys to keep (the roles' `standby` settings)
    standby: dict[str, int] = {}
    #: a sim model: any adapter name is taken, with no file
    sim: bool = False


class _GatewaySettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What `python -m disagg.gateway` (and `disagg serve-http`) is told, besides its schema fields."""

    #: the orchestrator's client endpoint
    endpoint: str


class _RoleSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one role process is told, besides its schema fields (model, dtype, transfer, keys, lane, ...)."""

    role: str
    instance_id: str
    endpoint: str  # the orchestrator's backend socket
    device: str = "cpu"
    capacity: int = 1
    #: denoisers: requests of one shape sharing each forward (disagg/roles/batcher.py)
    max_batch: int = 1
    pool_bytes: int = 64 * 1024 * 1024
    pool_name: str = ""
    host_id: str = ""
    threads: int = 0  # torch intra-op threads; 0 = the CPUs this process may run on
    data_host: str = "127.0.0.1"
    visible_gpus: list[int] = []  # physical ids, in cuda:N order
    #: the GPUs it was given as its host numbers them (its CUDA_VISIBLE_DEVICES entries, its own first; for a
    #: simulated device, the entry its index names): what it reports (Register.visible_gpus)
    gpu_ids: str = ""
    #: silence after which we give up and exit (the launcher, if alive, restarts us)
    orphan_grace_s: float = 600.0
    restarts: int = 0
    #: sim models: this instance's simulated times are multiplied by this (a slower device)
    sim_slowdown: float = 1.0
    #: sim models on declared devices (`devices`): its device's class and memory (0: no limit)
    device_class: str = ""
    device_memory_bytes: int = 0
    #: the deployment this instance belongs to (an orchestrator of another one refuses it)
    deployment_id: str = ""
    #: role -> bytes of its smallest pool: the first stage refuses a request whose tensors would not fit
    pool_limits: dict[str, int] = {}
    #: the launcher that started it (its host id and pid), told in Register: a join launcher stops only its own
    launcher_id: str = ""
    #: an instance over several ranks (disagg/roles/parallel.py): {"cfg": c, "ulysses": u, "ring": r}, this process's
    #: rank (0 talks to the orchestrator), the group's rendezvous (a torch.distributed init_method) and devices
    parallel: dict[str, int] = {}
    rank: int = 0
    dist_init: str = ""
    group_devices: list[str] = []

    @property
    def world(self) -> int:
        return world_of(self.parallel)

    @property
    def identity(self) -> str:
        """The ZeroMQ identity of its socket: DEPLOYMENT/INSTANCE (the orchestrator routes by it)."""
        return f"{self.deployment_id}/{self.instance_id}" if self.deployment_id else self.instance_id


OrchestratorSettings = _with_schema_fields("orchestrator", _OrchestratorSettings)
GatewaySettings = _with_schema_fields("gateway", _GatewaySettings)
RoleSettings = _with_schema_fields("role", _RoleSettings)


def schema_part(settings: Settings, process: str) -> dict:
    """The values of the top-level settings and the sections `process` reads, from the deployment's settings."""
    return {name: getattr(settings, name) for name in (*top_level_for(process), *sections_for(process))}


def encode(settings: msgspec.Struct) -> str:
    return msgspec.json.encode(settings).decode()


def decode(data: str | bytes, kind: type):
    """A process's settings from its JSON; a msgspec.ValidationError names an unknown or bad key."""
    return msgspec.json.decode(data, type=kind)
