"""The deployment: config file + flags -> the list of processes to start and where they run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml
from msgspec import Meta

from launcher.parallel import ParallelLayout, group_gpus, resolve_layouts
from roles.pipelines import ModelError, ModelSpec, model_spec
from transport.messages import HEARTBEAT_INTERVAL_S
from transport.selection import CHOICES as TRANSFER_CHOICES

ROLE_KEYS = {"encoder": "encoders", "denoiser": "denoisers", "decoder": "decoders"}


class ConfigError(ValueError):
    """A config file or flag combination that cannot describe a deployment."""


class RoleConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One role's pool of instances."""

    count: Annotated[int, Meta(ge=0, le=256)] = 1
    capacity: Annotated[int, Meta(ge=1, le=1024)] = 1
    #: None: sized from the model's largest payload (see default_pool_bytes)
    pool_mib: Annotated[int, Meta(ge=1, le=1 << 20)] | None = None
    gpus: list[Annotated[int, Meta(ge=0)]] | None = None
    #: denoisers only: requests of one shape that share a forward, joining at step boundaries
    #: (continuous batching); capacity is raised to at least this
    max_batch: Annotated[int, Meta(ge=1, le=256)] = 1
    #: warm standbys besides `count`: loaded and registered, given no work until an instance of this
    #: role dies, then serving at once (a standby costs a whole instance: on a GPU, its device's memory)
    standby: Annotated[int, Meta(ge=0, le=256)] = 0


class HttpConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The HTTP gateway `disagg launch` starts beside the orchestrator (gateway/)."""

    #: 0 = no gateway
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    host: str = "127.0.0.1"
    #: when set, every route but /health, /liveness and /metrics needs `Authorization: Bearer KEY`
    #: ($DISAGG_API_KEY is used when this is empty)
    api_key: str = ""


class DeploymentConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything `disagg launch` needs; configs/tiny.yaml holds these defaults, commented."""

    model: str = "demo"
    #: checkpoints: auto (bf16 on a GPU, fp32 on the CPU), float32, bfloat16 or float16
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65534)] = 5555
    #: join host: tcp://HEAD:PORT of another host's orchestrator; only role processes start here and
    #: register with it (empty: this host runs the orchestrator)
    join: str = ""
    #: the address other hosts reach this host's roles at (Mooncake); empty: `host` if it is a real
    #: address, else the interface that routes to the head (join) or out of this host
    advertise_host: str = ""
    transfer: str = "auto"
    #: mooncake: tcp or rdma; empty = rdma when ib_device is named, else tcp
    transfer_protocol: str = ""
    ib_device: str = ""
    dispatch: str = "max-free-slots"
    #: of two equally good consumers, the one on the producer's host wins (false: host-blind, to compare)
    host_aware: bool = True
    gpus: list[Annotated[int, Meta(ge=0)]] = []
    heartbeat_timeout_s: Annotated[float, Meta(gt=0)] = 3.0
    stall_timeout_s: Annotated[float, Meta(gt=0)] = 120.0
    request_timeout_s: Annotated[float, Meta(gt=0)] = 600.0
    #: a role with no instance (none registered yet, or all stopped) for this long: Submits are refused at once
    #: as "not ready" (HTTP 503 with Retry-After) and the requests waiting for it fail, instead of waiting
    #: for their timeout. Room for a join host's roles to register
    join_wait_s: Annotated[float, Meta(gt=0)] = 30.0
    max_retries: Annotated[int, Meta(ge=0, le=100)] = 2
    max_queue: Annotated[int, Meta(ge=1)] = 4096
    #: CurveZMQ keys directory (`disagg keys generate`); empty = no authentication
    keys: str = ""
    #: control messages between processes on one host take a Unix-socket fast lane instead of
    #: ZeroMQ (about 100 µs less per hop on a small VM); false = ZeroMQ for everything
    lane: bool = True
    ready_timeout_s: Annotated[float, Meta(gt=0)] = 180.0
    #: interpreters kept with torch and diffusers imported, each ready to become any role whose process
    #: died: its replacement then loads only its model (about 1 s for the tiny one instead of 5)
    spares: Annotated[int, Meta(ge=0, le=64)] = 1
    encoders: RoleConfig = msgspec.field(default_factory=lambda: RoleConfig(count=1))
    denoisers: RoleConfig = msgspec.field(default_factory=lambda: RoleConfig(count=2))
    decoders: RoleConfig = msgspec.field(default_factory=lambda: RoleConfig(count=1))
    #: > 0: the colocated baseline instead: this many monolithic instances, each running all
    #: three stages in one process (capacity from denoisers, devices from `gpus`)
    colocated: Annotated[int, Meta(ge=0, le=256)] = 0
    #: the OpenAI-compatible HTTP gateway (off unless http.port is set)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    #: sim models only: instance id -> factor on its simulated times, e.g. {denoiser-0: 3.0} for
    #: one denoiser three times slower than the others (dispatch policy experiments)
    sim_slowdown: dict[str, Annotated[float, Meta(gt=0)]] = {}
    #: instances over several devices: role -> {cfg, ulysses, ring} degrees (launcher/parallel.py); e.g.
    #: {denoiser: {ulysses: 2}}. With --gpus each instance takes that many contiguous GPUs
    parallel: dict[Literal["encoder", "denoiser", "decoder"], ParallelLayout] = {}
    #: --gpus-per-<role>: GPUs per instance (the layout's degrees multiply to it)
    gpus_per: dict[Literal["encoder", "denoiser", "decoder"], Annotated[int, Meta(ge=1, le=64)]] = {}

    def role(self, role: str) -> RoleConfig:
        return getattr(self, ROLE_KEYS[role])

    @property
    def protocol(self) -> str:
        return self.transfer_protocol or ("rdma" if self.ib_device else "tcp")

    def all_gpus(self) -> list[int]:
        gpus = list(self.gpus)
        for role in ROLE_KEYS:
            for g in self.role(role).gpus or []:
                if g not in gpus:
                    gpus.append(g)
        return gpus


def load_config(path: str | Path | None) -> DeploymentConfig:
    """Built-in defaults, overridden by the YAML file at `path` if given."""
    if path is None:
        return DeploymentConfig()
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    try:
        config = msgspec.convert(data, DeploymentConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"config {path}: {exc}") from None
    validate(config)
    return config


def validate(config: DeploymentConfig) -> None:
    try:  # flags were set on the struct after it was read: hold them to the same limits as the file
        msgspec.convert(msgspec.to_builtins(config), DeploymentConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None
    if config.heartbeat_timeout_s < 2 * HEARTBEAT_INTERVAL_S:
        raise ConfigError(f"heartbeat timeout {config.heartbeat_timeout_s:g} s is under twice the {HEARTBEAT_INTERVAL_S:g} s "
                          "heartbeat interval: every instance would flap between dead and ready")
    if config.transfer not in TRANSFER_CHOICES:
        raise ConfigError(f"transfer must be one of {', '.join(TRANSFER_CHOICES)}, got {config.transfer!r}")
    if config.transfer_protocol not in ("", "tcp", "rdma"):
        raise ConfigError(f"transfer_protocol must be tcp or rdma, got {config.transfer_protocol!r}")
    try:
        model_spec(config.model)
    except ModelError as exc:
        raise ConfigError(str(exc)) from None
    if config.transfer == "cuda-ipc" and not config.all_gpus():
        raise ConfigError("--transfer cuda-ipc needs GPUs (--gpus or a role's gpus list)")
    if config.transfer_protocol == "rdma" and not config.ib_device:
        raise ConfigError("transfer_protocol rdma needs ib_device (e.g. mlx5_0)")
    if config.join:
        from launcher.hosts import parse_endpoint

        try:
            parse_endpoint(config.join)
        except ValueError as exc:
            raise ConfigError(f"join: {exc}") from None
        if not any(config.role(role).count for role in ROLE_KEYS) or config.colocated:
            raise ConfigError("a join host needs some role instances here (-e/-d/-k), and cannot be colocated")
    for role in ROLE_KEYS:
        if role != "denoiser" and config.role(role).max_batch > 1:
            raise ConfigError(f"{ROLE_KEYS[role]}.max_batch: only denoisers batch")
    if config.sim_slowdown and not config.model.startswith("sim:"):
        raise ConfigError("sim_slowdown applies to sim: models only")
    if config.denoisers.max_batch > 1 and not model_spec(config.model).step_batching:
        raise ConfigError(f"denoisers.max_batch {config.denoisers.max_batch}: model {config.model!r} cannot batch "
                          "denoising steps; use max_batch 1")
    resolve_layouts(config, config.gpus_per)


def check_gpus(config: DeploymentConfig) -> None:
    """Every GPU the deployment names must be here (sim models' GPUs are simulated)."""
    wanted = config.all_gpus()
    if not wanted or config.model.startswith("sim:"):
        return
    import torch  # only a GPU launch pays for the import

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [g for g in wanted if g >= count]
    if missing:
        raise ConfigError(f"GPU {', '.join(map(str, missing))} not found: this machine has {count} CUDA device(s) "
                          f"visible{'' if count else ' (torch: ' + _no_cuda_reason(torch) + ')'}")


def cuda_env(gpus: list[int], parent: dict[str, str]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER for a child that sees `gpus` (its own first).

    `--gpus` counts the devices this launcher sees. Where a scheduler already narrowed them (Slurm's
    or Kubernetes' CUDA_VISIBLE_DEVICES=4,5, or GPU UUIDs), index i is the parent list's i-th entry,
    so the child's list is made of those entries. Devices are numbered in PCI bus order unless the
    parent chose an order: the default (fastest first) can differ between processes' views."""
    env = {"CUDA_DEVICE_ORDER": parent.get("CUDA_DEVICE_ORDER") or "PCI_BUS_ID"}
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
        return env
    listed = parent.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        return env
    entries = [e.strip() for e in listed.split(",") if e.strip()]
    missing = [g for g in gpus if g >= len(entries)]
    if missing:
        raise ConfigError(f"GPU {', '.join(map(str, missing))} not found: CUDA_VISIBLE_DEVICES={listed!r} "
                          f"leaves this launcher {len(entries)} device(s), and --gpus counts those")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(entries[g] for g in gpus)
    return env


def _no_cuda_reason(torch) -> str:
    return "not compiled with CUDA" if torch.version.cuda is None else "no device"


@dataclass
class Placement:
    """One role instance and where it runs."""

    role: str
    instance_id: str
    capacity: int
    pool_bytes: int
    gpu: int | None
    cpus: list[int]
    threads: int = 1  # torch compute threads
    max_batch: int = 1

    simulated: bool = False  # a sim: model: the "GPU" is a simulated device on the CPU
    #: an instance over several ranks: its layout ({cfg, ring, ulysses} degrees) and each rank's GPU
    layout: dict | None = None
    rank_gpus: list[int] | None = None

    @property
    def world(self) -> int:
        return ParallelLayout(**self.layout).world if self.layout else 1

    @property
    def device(self) -> str:
        if self.gpu is None:
            return "cpu"
        # CUDA_VISIBLE_DEVICES puts the child's own GPU first, so it is cuda:0 there
        return f"sim:{self.gpu}" if self.simulated else "cuda:0"


MIN_POOL_BYTES = 16 * 1024 * 1024


def default_pool_bytes(spec: ModelSpec, role: str, capacity: int) -> int:
    """Room for each compute slot's input plus two staged outputs per slot awaiting their fetch."""
    need = (3 * capacity + 1) * spec.largest_payload(role)
    mib = 1024 * 1024
    return max(MIN_POOL_BYTES, (need + mib - 1) // mib * mib)


def place(config: DeploymentConfig, cpu_ids: list[int] | None = None) -> list[Placement]:
    """Every role instance, with its GPU (round-robin over the role's or the global list) and CPUs."""
    cpu_ids = cpu_ids if cpu_ids is not None else sorted(os.sched_getaffinity(0))
    placements: list[Placement] = []
    spec = model_spec(config.model)
    simulated = config.model.startswith("sim:")
    if config.colocated:
        gpus = config.gpus
        for i in range(config.colocated):
            gpu = gpus[i % len(gpus)] if gpus else None
            pool_bytes = default_pool_bytes(spec, "monolith", config.denoisers.capacity)
            placements.append(Placement("monolith", f"monolith-{i}", config.denoisers.capacity, pool_bytes, gpu, [],
                                        simulated=simulated))
    layouts = resolve_layouts(config, config.gpus_per)
    for role in ROLE_KEYS if not config.colocated else ():
        rc = config.role(role)
        capacity = max(rc.capacity, rc.max_batch)
        pool_bytes = rc.pool_mib * 1024 * 1024 if rc.pool_mib else default_pool_bytes(spec, role, capacity)
        gpus = rc.gpus if rc.gpus is not None else config.gpus
        layout = layouts.get(role)
        for i in range(rc.count + rc.standby):
            gpu = gpus[(len(placements) if rc.gpus is None else i) % len(gpus)] if gpus else None
            p = Placement(role, f"{role}-{i}", capacity, pool_bytes, gpu, [], simulated=simulated,
                          max_batch=rc.max_batch)
            if layout is not None:  # its ranks: a contiguous group of GPUs, or the host's CPUs
                p.layout = layout.as_dict()
                p.rank_gpus = group_gpus(gpus, i, layout.world) if gpus else None
                p.gpu = p.rank_gpus[0] if p.rank_gpus else None
            placements.append(p)
    # spread instances over the CPUs: each gets an equal share, or one CPU when there are fewer
    # Spread: with more CPUs than instances each gets its own equal share; with fewer, pinning
    # one instance per CPU would stack several on one CPU while another idles, so each may run
    # anywhere and uses one compute thread (the kernel balances them).
    n, k = len(placements), len(cpu_ids)
    for idx, p in enumerate(placements):
        if n > k:
            p.cpus, p.threads = list(cpu_ids), 1
        else:
            share = k // n
            p.cpus = cpu_ids[idx * share : (idx + 1) * share]
            p.threads = len(p.cpus)
    return placements
