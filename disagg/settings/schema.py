"""Every setting of a deployment, declared once: name, type, default, bounds, help and the processes that need it.

Each field's `Meta(description=...)` is its help text (the first paragraph is `--help`'s; the whole text is the
comment above it in configs/tiny.yaml); `extra=use(...)` names the processes that read it, its flag where that
is not `--NAME`, and the older key names a config file may still use. Everything else is derived from this
module: the launch flags (disagg/launcher/cli/options.py), config-file keys, DISAGG_<NAME> environment variables
(disagg/settings/sources.py), each process's own settings object (disagg/settings/process.py), configs/tiny.yaml and the
settings tables of docs/guide/settings.md and docs/reference/settings.md (disagg/settings/render.py).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from disagg.settings.choices import Admission, Dispatch, Dtype, Transfer, TransferProtocol
from disagg.settings.devices import PATTERN as DEVICES_PATTERN
from disagg.settings.sections import (  # noqa: F401 - the schema's parts, imported from here too
    DISPATCH_POLICIES,
    PARALLEL_KINDS,
    PROCESSES,
    ROLE_SECTIONS,
    SECTION_FLAGS,
    SERVE_HTTP_PORT,
    TRANSFERS,
    ApiKey,
    BusyPollSettings,
    CompileSettings,
    Degree,
    ForwardSettings,
    HttpSettings,
    LoraSettings,
    ParallelLayout,
    RebalanceSettings,
    RoleName,
    RolePool,
    ScheduleSettings,
    TimeoutSettings,
    use,
    world_of,
)
from disagg.transport.wire.params import CacheSpec  # one cache rule: requests' and the settings'


class Settings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything a deployment is: `disagg launch` merges flags over DISAGG_ variables over a config file over
    these defaults, checks the result once, and gives each process its own part (disagg/settings/process.py)."""

    model: Annotated[str, Meta(min_length=1, max_length=1024, description=(
        "Which model every role serves: demo (a tiny Flux trained on coloured shapes: \"a red circle on the left\", "
        "64x64), tiny (the same architecture with random weights: noise, any size; the parity tests use it), a "
        "diffusers checkpoint (a local folder or a Hugging Face id: Flux, SD3/3.5, SDXL, Wan 2.1/2.2, Qwen-Image) "
        "or sim:PROFILE (disagg/roles/pipelines/sim_profiles/PROFILE.yaml, no compute)."),
        extra=use("launcher", "role"))] = "demo"
    dtype: Annotated[Dtype, Meta(description=(
        "Checkpoints' weight dtype: auto (bfloat16 on a GPU, float32 on the CPU), float32, bfloat16, float16."),
        extra=use("role"))] = Dtype.AUTO
    host: Annotated[str, Meta(description=(
        "Address the orchestrator binds. Clients use port, roles register on port + 1. Keep 127.0.0.1 unless "
        "other hosts must reach it (then with keys)."),
        extra=use("launcher", "orchestrator"))] = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65534, description="Client port of the orchestrator; roles use port + 1.",
                              extra=use("launcher", "orchestrator"))] = 5555
    join: Annotated[str, Meta(description=(
        "Join host: tcp://HEAD:PORT of an orchestrator on another host. Only the role processes start here; they "
        "register with it and this launcher supervises them. Empty: this host runs the orchestrator."),
        extra=use("launcher", metavar="tcp://HEAD:PORT"))] = ""
    advertise_host: Annotated[str, Meta(description=(
        "The address other hosts reach this host's roles at (Mooncake's local_hostname). Empty: host when it is "
        "a real address, else the interface that routes to the head (or out of this host)."),
        extra=use("launcher"))] = ""
    transfer: Annotated[Transfer, Meta(description=(
        "How tensors move between stages.\n\n"
        "auto: per pair of instances, the fastest engine both serve: same host -> cuda-ipc (GPU pools) or shm "
        "(host pools); other host -> mooncake; inline only as a last resort. cuda-ipc: same host, GPU: the "
        "consumer opens the producer pool's IPC handle once. shm: same host, CPU: the consumer maps the "
        "producer's shared memory once. mooncake: any host: Mooncake Transfer Engine reads the producer's "
        "registered pool (the mooncake or mooncake-cpu extra). inline: tensors ride in ZeroMQ frames through "
        "the orchestrator."),
        extra=use("orchestrator", "role"))] = Transfer.AUTO
    transfer_protocol: Annotated[TransferProtocol, Meta(description=(
        "Mooncake's protocol: tcp or rdma (empty: rdma when ib_device names a NIC, else tcp)."),
        extra=use("role"))] = TransferProtocol.DEFAULT
    ib_device: Annotated[str, Meta(description="The RDMA NIC Mooncake uses, e.g. mlx5_0.", extra=use("role"))] = ""
    dispatch: Annotated[Dispatch, Meta(description=(
        "Which ready instance gets a role's next request: max-free-slots, round-robin, or least-work (the least "
        "predicted work from measured stage times)."),
        extra=use("orchestrator"))] = Dispatch.MAX_FREE_SLOTS
    host_aware: Annotated[bool, Meta(description=(
        "Of two otherwise equally good instances, the one on the producer's host gets the request, so fewer "
        "bytes cross the network (under every policy). false (--host-blind): only to compare."),
        extra=use("orchestrator", flag="--host-aware/--host-blind"))] = True
    gpus: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(description=(
        "GPUs to spread every instance over, round-robin (each instance sees its own GPU as cuda:0). Empty: the "
        "CPU. A role's own gpus list takes precedence."),
        extra=use("launcher", metavar="0,1,..."))] = []
    devices: Annotated[str, Meta(pattern=DEVICES_PATTERN, description=(
        "Simulated devices (sim: models): COUNTxCLASS,... in order, e.g. 8xH200,4xL40S: the GPU index i that gpus "
        "(or a role's gpus) names is the i-th of these, and its class gives the device its memory and speed "
        "(H200, H100, L40S, L4: disagg/settings/devices.py, with their sources). Empty: simulated devices are as "
        "fast as the profile says, with no memory limit. A real GPU's name and memory are read from it."),
        extra=use("launcher", metavar="NxCLASS,..."))] = ""
    join_wait: Annotated[float, Meta(gt=0, description=(
        "Seconds a role may have no instance (none registered yet, or every one stopped or dead) before Submits "
        "are refused at once as not ready (HTTP 503 with Retry-After) and the requests waiting for it fail. "
        "It is the room a join host's roles get to register."),
        extra=use("orchestrator", legacy="join_wait_s"))] = 30.0
    max_retries: Annotated[int, Meta(ge=0, le=100, description=(
        "New attempts a request gets when an instance dies under it; then it fails, naming the cause."),
        extra=use("orchestrator"))] = 2
    max_queue: Annotated[int, Meta(ge=1, description=(
        "Admission control: while this many requests wait in a role's queue, Submit is refused at once as "
        "overloaded (HTTP 429)."),
        extra=use("orchestrator"))] = 4096
    schedule: ScheduleSettings = msgspec.field(default_factory=ScheduleSettings)
    timeouts: TimeoutSettings = msgspec.field(default_factory=TimeoutSettings)
    cache: Annotated[CacheSpec, Meta(description=(
        "Denoisers: the step cache of every request that names none, as a request's `cache` field: "
        "{type: first_block, threshold: 0.3} (types first_block, mag, taylorseer, faster, "
        "pyramid_attention_broadcast, sea; the other keys are the diffusers config's own fields, with its bounds). "
        "A request's {type: none} runs without. {} = none. Models without a diffusers transformer (sim, payload) "
        "ignore it."),
        extra=use("role", flag=None))] = {}
    compile: CompileSettings = msgspec.field(default_factory=CompileSettings)
    conditioning_cache_mib: Annotated[int, Meta(ge=0, le=1 << 20, description=(
        "Encoders: MiB of recent text encodings each keeps (an LRU on its device). A request whose prompt, "
        "negative prompt, guidance and adapters equal a kept one reuses it and the encoder computes nothing; "
        "the orchestrator sends a repeat to the encoder that holds it when that one has a free slot. 0 = off."),
        extra=use("role"))] = 256
    admission: Annotated[Admission, Meta(description=(
        "slo: a request whose deadline (slo_ms) cannot be met even if it ran at once, by the measured stage "
        "times, is refused at Submit (deadline_unmeetable, HTTP 429 with Retry-After); before the first "
        "measurements nothing is refused. off: every request is taken."),
        extra=use("orchestrator"))] = Admission.OFF
    busy_poll: BusyPollSettings = msgspec.field(default_factory=BusyPollSettings)
    forward: ForwardSettings = msgspec.field(default_factory=ForwardSettings)
    keys: Annotated[str, Meta(description=(
        "CurveZMQ keys directory (`disagg keys generate DIR`): only holders of the client key may submit or "
        "register. Empty: no authentication (keep host on 127.0.0.1 then)."),
        extra=use("launcher", "orchestrator", "role", "gateway", metavar="DIR"))] = ""
    lane: Annotated[bool, Meta(description=(
        "Control messages between processes on one host take a Unix-socket fast lane instead of ZeroMQ: one "
        "thread wake per hop instead of several (about 100 us less per hop on a small VM). ZeroMQ still carries "
        "registration, other hosts and big messages. false: everything over ZeroMQ."),
        extra=use("orchestrator", "role", flag="--lane/--no-lane"))] = True
    fork_server: Annotated[bool, Meta(description=(
        "Roles without a GPU start (where there are two or more) as forks of one process that imported torch, diffusers and the model's "
        "adapter once, instead of each importing them (~5 s of CPU for a diffusers model here): a role then "
        "costs only its model's load, and the imports' memory is shared. Roles on a GPU always start a fresh "
        "interpreter (CUDA's state must not be inherited). false (--no-fork-server): every role its own."),
        extra=use("launcher", flag="--fork-server/--no-fork-server"))] = True
    spares: Annotated[int, Meta(ge=0, le=64, description=(
        "Spare interpreters kept with torch, diffusers and every adapter imported (about 4 s of a role's start "
        "here): a role process that dies is replaced by one, which loads only the model (well under a second "
        "for the tiny model). Each costs the memory of those imports (~400 MB), no GPU. 0 = none."),
        extra=use("launcher"))] = 1
    # capacities 4, 2, 4: at concurrency 64 on sim:zero, 1.65x the throughput of 1, 1, 1 at 0.6x the p50, and the
    # same at concurrency 1 (benchmarks/defaults_ab.py, BENCHMARKS.md); a denoiser holds the next request's
    # inputs while it computes one
    encoders: RolePool = msgspec.field(default_factory=lambda: RolePool(count=1, capacity=4))
    denoisers: RolePool = msgspec.field(default_factory=lambda: RolePool(count=2, capacity=2))
    decoders: RolePool = msgspec.field(default_factory=lambda: RolePool(count=1, capacity=4))
    colocated: Annotated[int, Meta(ge=0, le=256, description=(
        "> 0: the colocated baseline instead of the pools: this many monolithic instances, each running all "
        "three stages in one process (capacity from denoisers, devices from gpus)."),
        extra=use("launcher", "orchestrator"))] = 0
    http: HttpSettings = msgspec.field(default_factory=HttpSettings)
    loras: LoraSettings = msgspec.field(default_factory=LoraSettings)
    rebalance: RebalanceSettings = msgspec.field(default_factory=RebalanceSettings)
    sim_slowdown: Annotated[dict[str, Annotated[float, Meta(gt=0)]], Meta(description=(
        "sim: models only: instance id -> factor on its simulated times, e.g. {denoiser-0: 3.0} for one denoiser "
        "three times slower than the others (dispatch experiments)."),
        extra=use("launcher", flag=None))] = {}
    parallel: Annotated[dict[RoleName, ParallelLayout], Meta(description=(
        "Instances over several devices: role -> {cfg, ulysses, ring} degrees, e.g. {denoiser: {ulysses: 2}}. "
        "cfg splits classifier-free guidance's negative and positive rows over ranks (SD3, SDXL); ulysses and "
        "ring are diffusers' context parallelism over the sequence (Flux, Wan, Qwen-Image, tiny; ring needs "
        "GPUs). With gpus each instance takes that many contiguous GPUs; without, its ranks share the CPU "
        "(gloo). No continuous batching (max_batch 1). Only denoisers."),
        extra=use("launcher", flag=None))] = {}
    gpus_per: Annotated[dict[RoleName, Annotated[int, Meta(ge=1, le=64)]], Meta(description=(
        "GPUs (ranks) per instance, per role (--gpus-per-denoiser N): the layout's degrees multiply to it; with "
        "no layout named, the model's own kind at that degree (ulysses N, or cfg 2 for SD3 and SDXL). Encoders "
        "and decoders take only 1."),
        extra=use("launcher", flag=None))] = {}

    def role(self, role: str) -> RolePool:
        return getattr(self, ROLE_SECTIONS[role])

    @property
    def protocol(self) -> str:
        return self.transfer_protocol or (TransferProtocol.RDMA if self.ib_device else TransferProtocol.TCP)

    def all_gpus(self) -> list[int]:
        gpus = list(self.gpus)
        for role in ROLE_SECTIONS:
            for g in self.role(role).gpus or []:
                if g not in gpus:
                    gpus.append(g)
        return gpus
