"""What the launcher tells one role process: a WorkerSpec, passed as JSON on its command line."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


@dataclass
class WorkerSpec:
    """What the launcher tells one role process."""

    role: str
    instance_id: str
    endpoint: str  # the orchestrator's backend socket
    model: str = "demo"
    device: str = "cpu"
    capacity: int = 1
    #: denoisers: requests of one shape sharing each forward (roles/batcher.py)
    max_batch: int = 1
    pool_bytes: int = 64 * 1024 * 1024
    pool_name: str = ""
    host_id: str = ""
    threads: int = 0  # torch intra-op threads; 0 = the CPUs this process may run on
    transfer: str = "auto"  # a forced engine must start, or the role fails to boot
    transfer_protocol: str = "tcp"
    ib_device: str = ""
    data_host: str = "127.0.0.1"
    visible_gpus: list[int] = field(default_factory=list)  # physical ids, in cuda:N order
    #: silence from the orchestrator after which we reconnect and register again
    orchestrator_timeout_s: float = 3.0
    #: silence after which we give up and exit (the launcher, if alive, restarts us)
    orphan_grace_s: float = 600.0
    restarts: int = 0
    #: checkpoints: float32, bfloat16, float16 or auto (bf16 on a GPU, fp32 on the CPU)
    dtype: str = "auto"
    #: sim models: this instance's simulated times are multiplied by this (a slower device)
    sim_slowdown: float = 1.0
    #: CurveZMQ keys directory (disagg keys generate); empty = no authentication
    keys_dir: str = ""
    #: take the orchestrator's same-host fast lane when it offers one (transport/lane.py)
    use_lane: bool = True
    #: the deployment this instance belongs to (an orchestrator of another one refuses it)
    deployment_id: str = ""
    #: role -> bytes of its smallest pool: the first stage refuses a request whose tensors would not fit
    pool_limits: dict[str, int] = field(default_factory=dict)
    #: the launcher that started it (its host id and pid), told in Register: a join launcher stops only its own
    launcher_id: str = ""

    #: an instance over several ranks (roles/parallel.py): {"cfg": c, "ulysses": u, "ring": r}, this process's
    #: rank (0 talks to the orchestrator), the group's rendezvous (a torch.distributed init_method) and devices
    parallel: dict[str, int] = field(default_factory=dict)
    rank: int = 0
    dist_init: str = ""
    group_devices: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        from roles.layout import world_of

        return world_of(self.parallel)

    @property
    def identity(self) -> str:
        """The ZeroMQ identity of its socket: DEPLOYMENT/INSTANCE (the orchestrator routes by it)."""
        return f"{self.deployment_id}/{self.instance_id}" if self.deployment_id else self.instance_id


def spec_from_json(data: str) -> WorkerSpec:
    return msgspec.json.decode(data, type=WorkerSpec)
