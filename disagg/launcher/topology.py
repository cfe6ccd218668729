"""The deployment: config file + flags -> the list of processes to start and where they run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import msgspec

from disagg.launcher.parallel import ParallelLayout, group_gpus, resolve_layouts
from disagg.roles.pipelines import ModelError, ModelSpec, model_spec
from disagg.settings import ROLE_SECTIONS, Resolved, Settings, SettingsError, resolve
from disagg.settings.choices import RebalanceMode, Transfer, TransferProtocol
from disagg.settings.devices import DeviceClass, DeviceError, parse_devices
from disagg.transport.environment import CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES
from disagg.transport.wire.messages import HEARTBEAT_INTERVAL_S

ROLE_KEYS = ROLE_SECTIONS
ConfigError = SettingsError


def load_config(path: str | Path | None, environ: Mapping[str, str] | None = None,
                flags: Mapping[str, object] | None = None) -> Settings:
    """The effective settings (flags over DISAGG_ variables over the file at `path` over the defaults; environ
    None: no variables), checked once as a whole. Raises ConfigError."""
    return resolve_checked(path, environ, flags).settings


def resolve_checked(path, environ=None, flags=None) -> Resolved:
    resolved = resolve(path, {} if environ is None else environ, flags)
    validate(resolved.settings)
    return resolved


def validate(config: Settings) -> None:
    try:  # flags were set on the struct after it was read: hold them to the same limits as the file
        msgspec.convert(msgspec.to_builtins(config), Settings)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None
    if config.timeouts.heartbeat < 2 * HEARTBEAT_INTERVAL_S:
        raise ConfigError(f"heartbeat timeout {config.timeouts.heartbeat:g} s is under twice the {HEARTBEAT_INTERVAL_S:g} s "
                          "heartbeat interval: every instance would flap between dead and ready")
    try:
        model_spec(config.model)
    except ModelError as exc:
        raise ConfigError(str(exc)) from None
    if config.transfer == Transfer.CUDA_IPC and not config.all_gpus():
        raise ConfigError("--transfer cuda-ipc needs GPUs (--gpus or a role's gpus list)")
    if config.transfer_protocol == TransferProtocol.RDMA and not config.ib_device:
        raise ConfigError("transfer_protocol rdma needs ib_device (e.g. mlx5_0)")
    if config.join:
        from disagg.launcher.hosts import parse_endpoint

        try:
            parse_endpoint(config.join)
        except ValueError as exc:
            raise ConfigError(f"join: {exc}") from None
        if not any(config.role(role).count for role in ROLE_KEYS) or config.colocated:
            raise ConfigError("a join host needs some role instances here (-e/-d/-k), and cannot be colocated")
    for role in ROLE_KEYS:
        if role != "denoiser" and config.role(role).max_batch > 1:
            raise ConfigError(f"{ROLE_KEYS[role]}.max_batch: only denoisers batch")
    if config.compile.enabled and config.loras.host_slots:
        raise ConfigError(f"loras.host_slots {config.loras.host_slots} (--lora-host-slots) with compile (--compile): a "
                          "compiled denoiser cannot move adapters between the device and host memory, so the host tier "
                          "would be off; use one or the other")
    if config.colocated and config.rebalance.mode == RebalanceMode.AUTO:
        raise ConfigError("rebalance.mode auto (--rebalance auto) with colocated (--colocated): monolith instances run "
                          "every stage, so no device has a role to change; use one or the other")
    if config.sim_slowdown and not config.model.startswith("sim:"):
        raise ConfigError("sim_slowdown applies to sim: models only")
    check_devices(config)
    if config.denoisers.max_batch > 1 and not model_spec(config.model).step_batching:
        raise ConfigError(f"denoisers.max_batch {config.denoisers.max_batch}: model {config.model!r} cannot batch "
                          "denoising steps; use max_batch 1")
    resolve_layouts(config, config.gpus_per)


def check_devices(config: Settings) -> list[DeviceClass]:
    """The declared simulated devices (`devices`), each GPU index the deployment names among them."""
    if not config.devices:
        return []
    if not config.model.startswith("sim:"):
        raise ConfigError(f"devices {config.devices!r} (--devices) declares simulated devices: sim: models only (a "
                          "real GPU's name and memory are read from it)")
    try:
        devices = parse_devices(config.devices)
    except DeviceError as exc:
        raise ConfigError(str(exc)) from None
    beyond = sorted({g for g in config.all_gpus() if g >= len(devices)})
    if beyond:
        raise ConfigError(f"GPU {', '.join(map(str, beyond))} is not among the {len(devices)} devices that devices "
                          f"{config.devices!r} declares (indices 0 to {len(devices) - 1})")
    return devices


def check_fit(config: Settings, placements: list["Placement"]) -> None:
    """A sim model on declared devices (`devices`): refuse a placement whose instances on one device would not fit
    it, before anything starts: their weights, plus the activations of the largest batch each may run at the
    profile's reference size (instances on one device take turns, so the largest of those counts once)."""
    devices = check_devices(config)
    if not devices:
        return
    from disagg.roles.pipelines.sim_profile import load_profile

    profile = load_profile(config.model[4:])
    on: dict[int, list[Placement]] = {}
    for p in placements:
        for gpu in p.rank_gpus or ([p.gpu] if p.gpu is not None else []):
            on.setdefault(gpu, []).append(p)
    for gpu, here in sorted(on.items()):
        cls = devices[gpu]
        # a colocated replica streams what it cannot keep (profile.streamed): it holds the rest
        weights = sum(profile.weights(p.role) - sum(profile.streamed(cls.memory_bytes, profile.reference_pixels).values())
                      if p.role == "monolith" else profile.weights(p.role) for p in here)
        peak = max(profile.activations(p.role, profile.reference_pixels, max(p.max_batch, 1)) for p in here)
        if weights + peak > cls.memory_bytes:
            names = ", ".join(p.instance_id for p in here)
            raise ConfigError(
                f"device {gpu} ({cls.name}, {cls.memory_bytes / 1e9:.0f} GB) cannot hold {names}: their weights "
                f"({weights / 1e9:.1f} GB) and activations ({peak / 1e9:.1f} GB at the profile's size) need "
                f"{(weights + peak) / 1e9:.1f} GB; give them more devices, or a device with more memory")


def check_gpus(config: Settings) -> None:
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
    env = {CUDA_DEVICE_ORDER: parent.get(CUDA_DEVICE_ORDER) or "PCI_BUS_ID"}
    if not gpus:
        env[CUDA_VISIBLE_DEVICES] = ""
        return env
    listed = parent.get(CUDA_VISIBLE_DEVICES)
    if listed is None:
        env[CUDA_VISIBLE_DEVICES] = ",".join(map(str, gpus))
        return env
    entries = [e.strip() for e in listed.split(",") if e.strip()]
    missing = [g for g in gpus if g >= len(entries)]
    if missing:
        raise ConfigError(f"GPU {', '.join(map(str, missing))} not found: CUDA_VISIBLE_DEVICES={listed!r} "
                          f"leaves this launcher {len(entries)} device(s), and --gpus counts those")
    env[CUDA_VISIBLE_DEVICES] = ",".join(entries[g] for g in gpus)
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


def shared_gpu_warnings(placements: list[Placement]) -> list[str]:
    """One warning per GPU that holds more than one instance of a role (standbys and ranks counted): each process
    holds the role's weights on it, and without MPS they take turns on the device, so they add no throughput."""
    on: dict[tuple[int, str], list[str]] = {}
    for p in placements:
        if p.simulated:
            continue
        for gpu in dict.fromkeys(p.rank_gpus or ([p.gpu] if p.gpu is not None else [])):
            on.setdefault((gpu, p.role), []).append(p.instance_id)
    return [f"GPU {gpu} holds {len(ids)} {role} instances ({', '.join(ids)}): each holds the {role}'s weights there, "
            f"and they take turns on the device (no throughput gained without MPS); give each its own GPU (--gpus, "
            f"or the role's gpus list) or run fewer"
            for (gpu, role), ids in sorted(on.items()) if len(ids) > 1]


def rerole(config: Settings, p: Placement, role: str, instance_id: str) -> Placement:
    """The placement of instance `instance_id` of `role` on `p`'s device and CPUs (rebalance moves a device to
    another role): that role's capacity, batching and pool, as launch gives its instances."""
    rc = config.role(role)
    capacity = max(rc.capacity, rc.max_batch)
    pool_bytes = rc.pool_mib * 1024 * 1024 if rc.pool_mib else default_pool_bytes(model_spec(config.model), role, capacity)
    return Placement(role, instance_id, capacity, pool_bytes, p.gpu, list(p.cpus), threads=p.threads,
                     max_batch=rc.max_batch, simulated=p.simulated)


def place(config: Settings, cpu_ids: list[int] | None = None) -> list[Placement]:
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
