"""Every setting of a deployment, declared once: name, type, default, bounds, help and the processes that need it.

Each field's `Meta(description=...)` is its help text (the first paragraph is `--help`'s; the whole text is the
comment above it in configs/tiny.yaml); `extra=use(...)` names the processes that read it, its flag where that
is not `--NAME`, and the older key names a config file may still use. Everything else is derived from this
module: the launch flags (launcher/options.py), config-file keys, DISAGG_<NAME> environment variables
(settings/sources.py), each process's own settings object (settings/process.py), configs/tiny.yaml and the
README's settings table (settings/render.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from transport.params import CacheSpec, LoraName  # one adapter-name and one cache rule: requests' and the settings'

#: the processes a setting may be for
PROCESSES = ("launcher", "orchestrator", "role", "gateway")
#: how one instance may span devices, in mesh order (roles/layout.py re-exports it)
PARALLEL_KINDS = ("cfg", "ring", "ulysses")
#: dispatch policies (orchestrator/dispatch.py implements each; a test checks the two agree)
DISPATCH_POLICIES = ("max-free-slots", "round-robin", "least-work")
#: transfer engines (transport/selection.py's CHOICES; a test checks the two agree)
TRANSFERS = ("auto", "cuda-ipc", "shm", "mooncake", "inline")
#: `disagg serve-http` serves here when http.port is 0 (launch then starts no gateway)
SERVE_HTTP_PORT = 8000
ROLE_SECTIONS = {"encoder": "encoders", "denoiser": "denoisers", "decoder": "decoders"}
#: flags of section fields: one section's (-e sets encoders.count) or every role's at once (--capacity E,D,K sets
#: encoders.capacity, denoisers.capacity and decoders.capacity); gpus_per's (--gpus-per-ROLE N) are per role
SECTION_FLAGS = {
    "encoders.count": "-e/--encoders", "denoisers.count": "-d/--denoisers", "decoders.count": "-k/--decoders",
    "denoisers.max_batch": "--max-batch",
    **{f"{section}.{name}": f"--{name}" for section in ROLE_SECTIONS.values() for name in ("capacity", "standby")},
}


def world_of(layout: dict[str, int]) -> int:
    """The ranks of an instance of this layout ({cfg, ulysses, ring} degrees, missing ones 1)."""
    n = 1
    for k in PARALLEL_KINDS:
        n *= layout.get(k, 1)
    return n


def use(*processes: str, flag: str | None = "", legacy: str = "", metavar: str = "") -> dict:
    """A field's `extra`: the processes that read it; its flag ("" = --NAME, None = config file and environment
    only); an older key name that still works, with a warning."""
    assert set(processes) <= set(PROCESSES), processes
    return {"for": processes, "flag": flag, "legacy": legacy, "metavar": metavar}


Degree = Annotated[int, Meta(ge=1, le=64)]
RoleName = Literal["encoder", "denoiser", "decoder"]


class ParallelLayout(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How one instance spans devices; the product of the degrees is its ranks (GPUs, with --gpus).

    cfg: classifier-free guidance's negative and positive rows on different ranks (SD3, SDXL);
    ulysses / ring: diffusers' context parallelism over the sequence (Flux, Wan, Qwen-Image)."""

    cfg: Degree = 1
    ulysses: Degree = 1
    ring: Degree = 1

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in PARALLEL_KINDS}

    @property
    def world(self) -> int:
        return world_of(self.as_dict())


class RolePool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One role's pool of instances (the sections encoders, denoisers, decoders)."""

    count: Annotated[int, Meta(ge=0, le=256, description=(
        "Instances of this role on this host (0: none here; other hosts may join)."),
        extra=use("launcher", flag=None))] = 1
    capacity: Annotated[int, Meta(ge=1, le=1024, description=(
        "Requests each instance holds at once (their transfers overlap; a diffusers pipeline's computes take "
        "turns, so a denoiser that should compute several at once batches them: max_batch). Defaults: encoders "
        "4, denoisers 2, decoders 4 (measured: BENCHMARKS.md, defaults)."),
        extra=use("launcher", flag=None))] = 1
    pool_mib: Annotated[Annotated[int, Meta(ge=1, le=1 << 20)] | None, Meta(description=(
        "MiB of each instance's buffer pool: staged outputs waiting for the next stage plus the inputs it pulled "
        "(shared memory on the CPU, GPU memory on a GPU). null = sized from the model's largest payload at its "
        "maximum resolution: (3 x capacity + 1) payloads, at least 16 MiB."),
        extra=use("launcher", flag=None))] = None
    gpus: Annotated[list[Annotated[int, Meta(ge=0)]] | None, Meta(description=(
        "GPUs of this role's instances, round-robin (null: the global gpus list)."),
        extra=use("launcher", flag=None))] = None
    max_batch: Annotated[int, Meta(ge=1, le=256, description=(
        "Denoisers only: requests of one shape sharing each forward, joining the running batch at step boundaries "
        "(continuous batching; capacity is raised to at least this). 1 = no batching; models with step-level "
        "batching take more (demo, tiny, Flux checkpoints, sim:*)."),
        extra=use("launcher", flag=None))] = 1
    standby: Annotated[int, Meta(ge=0, le=256, description=(
        "Warm standbys besides count: loaded and registered, given no work (state standby) until an instance of "
        "this role dies; then one takes over at once. A standby costs what an instance costs: on a GPU, a device "
        "holding the role's weights and pool."),
        extra=use("launcher", "orchestrator", flag=None))] = 0


class HttpSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The OpenAI-compatible HTTP gateway (gateway/): `disagg launch` starts one beside the orchestrator when
    http.port is set; `disagg serve-http` runs one for a deployment already running."""

    port: Annotated[int, Meta(ge=0, le=65535, description=(
        f"Port of the HTTP gateway. 0: launch starts none (serve-http then serves on {SERVE_HTTP_PORT})."),
        extra=use("launcher", "gateway", flag="--http-port"))] = 0
    host: Annotated[str, Meta(description="Address the HTTP gateway binds.",
                              extra=use("gateway", flag="--http-host"))] = "127.0.0.1"
    api_key: Annotated[str, Meta(description=(
        "When set, every route but /, /health, /liveness, /metrics and the unguessable image URLs needs "
        "`Authorization: Bearer KEY`. Prefer the environment (DISAGG_HTTP_API_KEY) to a file or a flag."),
        extra=use("gateway", flag="--api-key"))] = ""
    api_keys: Annotated[dict[str, Annotated[int, Meta(ge=-1000, le=1000)]], Meta(description=(
        "More API keys, each with the priority its requests get: KEY -> priority (-1000..1000). A request sent "
        "with such a key runs at that priority unless it names a lower one; naming a higher one is refused (403, "
        "param priority). Requests with http.api_key name any priority. Prefer the environment "
        "(DISAGG_HTTP_API_KEYS, YAML: '{KEY: 5}') to a file."),
        extra=use("gateway", flag=None))] = {}
    image_ttl: Annotated[float, Meta(gt=0, description=(
        "response_format=url: seconds an image stays fetchable at its URL."), extra=use("gateway", flag=None))] = 600.0
    image_store_max: Annotated[int, Meta(ge=1, description="response_format=url: the most images kept.",
                                         extra=use("gateway", flag=None))] = 256
    image_store_mib: Annotated[int, Meta(ge=1, description="response_format=url: the most MiB of images kept.",
                                         extra=use("gateway", flag=None))] = 512
    recent_max: Annotated[int, Meta(ge=0, description=(
        "Completed answers kept for a client that sends the same X-Request-Id again (answered without computing "
        "again)."), extra=use("gateway", flag=None))] = 1024
    recent_mib: Annotated[int, Meta(ge=1, description="MiB of images those kept answers may hold.",
                                    extra=use("gateway", flag=None))] = 128


class LoraSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """LoRA adapters requests may apply (a request's `loras: [{name, scale}]`), loaded by the roles with diffusers'
    own LoRA support and dispatched to the denoisers that already hold them."""

    dir: Annotated[str, Meta(description=(
        "A folder of adapters: each *.safetensors file or diffusers LoRA folder in it is one, named by its stem. "
        "Adapters added later are picked up without a restart. The same path must hold them on every host."),
        extra=use("orchestrator", flag="--lora-dir", metavar="DIR"))] = ""
    adapters: Annotated[dict[LoraName, str], Meta(description=(
        "More adapters by name: name -> a file, a folder or a Hugging Face id. A request names adapters only by "
        "name, never by path."),
        extra=use("orchestrator", flag=None))] = {}
    max_per_request: Annotated[int, Meta(ge=1, le=16, description="The most adapters one request may apply.",
                                         extra=use("orchestrator", flag=None))] = 4
    slots: Annotated[int, Meta(ge=1, le=1024, description=(
        "Adapters each instance keeps loaded at once; the least recently used one is unloaded for a new one."),
        extra=use("role", flag="--lora-slots"))] = 8
    max_mib: Annotated[int, Meta(ge=1, description=(
        "MiB of adapter weights each instance keeps loaded at most (besides slots)."),
        extra=use("role", flag=None))] = 4096
    affinity: Annotated[Literal["on", "off", "cost", "slack", "two-choices"], Meta(description=(
        "on: of the free denoisers, one that holds all of a request's adapters gets it; when only busy ones hold "
        "them, the request waits for one at most as long as a load takes, then goes elsewhere (the load rule, "
        "BENCHMARKS.md). cost: the free denoiser where the request is expected to finish first, counting the "
        "work each holds, a load where its adapters are not held (and half a load more when it evicts one); measured, "
        "not chosen: it loads more and its tail is no shorter. "
        "off: adapters play no part in dispatch. slack (a holder unless another has more than one free slot "
        "more) and two-choices (the freer of two holders drawn at random) are rules it was measured against, "
        "kept to compare."),
        extra=use("orchestrator", flag="--lora-affinity"))] = "on"


class RebalanceSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Pools that size themselves: the orchestrator works out which split of the devices between the roles serves
    the recent traffic best (orchestrator/planner.py), shows it, and with mode auto moves devices to it."""

    mode: Annotated[Literal["off", "advise", "auto"], Meta(description=(
        "advise: every interval_s, from the last window_s of requests (their mix) and the measured stage times, "
        "the split of the devices (E:D:K) that serves the most requests per second is recommended, with what the "
        "current and the recommended splits are predicted to serve (status, the live table, /metrics). auto: "
        "devices also move to it: an instance of a role with too many drains (it takes no new work and finishes "
        "what it holds), exits, and its launcher starts it again on the same device as the role with too few "
        "(forked from the launcher's fork server, or a spare interpreter). off: neither."),
        extra=use("orchestrator", flag="--rebalance"))] = "advise"
    window_s: Annotated[float, Meta(ge=1, le=86400, description=(
        "Seconds of recent requests the traffic mix is taken from."),
        extra=use("orchestrator", flag=None))] = 10.0
    interval_s: Annotated[float, Meta(ge=0.1, le=3600, description="Seconds between two plans.",
                                      extra=use("orchestrator", flag=None))] = 1.0
    cooldown_s: Annotated[float, Meta(ge=0, le=86400, description=(
        "auto: seconds after a move finished during which no move undoes it (a device back to the role it left); "
        "moves onward in the same direction follow at once. With min_gain and window_s, the hysteresis that keeps "
        "a traffic mix that alternates quickly from moving devices to and fro."),
        extra=use("orchestrator", flag=None))] = 15.0
    min_per_role: Annotated[int, Meta(ge=1, le=256, description="auto: the fewest devices a role keeps.",
                                      extra=use("orchestrator", flag=None))] = 1
    min_gain: Annotated[float, Meta(ge=0, le=10, description=(
        "auto: a move is made only when the recommended split is predicted to serve this much more than the "
        "current one (0.05: 5% more requests per second)."),
        extra=use("orchestrator", flag=None))] = 0.05
    min_requests: Annotated[int, Meta(ge=1, le=1 << 20, description=(
        "The fewest requests in the window for a recommendation (fewer say too little about the mix)."),
        extra=use("orchestrator", flag=None))] = 8


class Settings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything a deployment is: `disagg launch` merges flags over DISAGG_ variables over a config file over
    these defaults, checks the result once, and gives each process its own part (settings/process.py)."""

    model: Annotated[str, Meta(min_length=1, max_length=1024, description=(
        "Which model every role serves: demo (a tiny Flux trained on coloured shapes: \"a red circle on the left\", "
        "64x64), tiny (the same architecture with random weights: noise, any size; the parity tests use it), a "
        "diffusers checkpoint (a local folder or a Hugging Face id: Flux, SD3/3.5, SDXL, Wan 2.1/2.2, Qwen-Image) "
        "or sim:PROFILE (configs/sim/PROFILE.yaml, no compute)."),
        extra=use("launcher", "role"))] = "demo"
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], Meta(description=(
        "Checkpoints' weight dtype: auto (bfloat16 on a GPU, float32 on the CPU), float32, bfloat16, float16."),
        extra=use("role"))] = "auto"
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
    transfer: Annotated[Literal[TRANSFERS], Meta(description=(
        "How tensors move between stages.\n\n"
        "auto: per pair of instances, the fastest engine both serve: same host -> cuda-ipc (GPU pools) or shm "
        "(host pools); other host -> mooncake; inline only as a last resort. cuda-ipc: same host, GPU: the "
        "consumer opens the producer pool's IPC handle once. shm: same host, CPU: the consumer maps the "
        "producer's shared memory once. mooncake: any host: Mooncake Transfer Engine reads the producer's "
        "registered pool (the mooncake or mooncake-cpu extra). inline: tensors ride in ZeroMQ frames through "
        "the orchestrator."),
        extra=use("orchestrator", "role"))] = "auto"
    transfer_protocol: Annotated[Literal["", "tcp", "rdma"], Meta(description=(
        "Mooncake's protocol: tcp or rdma (empty: rdma when ib_device names a NIC, else tcp)."),
        extra=use("role"))] = ""
    ib_device: Annotated[str, Meta(description="The RDMA NIC Mooncake uses, e.g. mlx5_0.", extra=use("role"))] = ""
    dispatch: Annotated[Literal[DISPATCH_POLICIES], Meta(description=(
        "Which ready instance gets a role's next request: max-free-slots, round-robin, or least-work (the least "
        "predicted work from measured stage times)."),
        extra=use("orchestrator"))] = "max-free-slots"
    host_aware: Annotated[bool, Meta(description=(
        "Of two otherwise equally good instances, the one on the producer's host gets the request, so fewer "
        "bytes cross the network (under every policy). false (--host-blind): only to compare."),
        extra=use("orchestrator", flag="--host-aware/--host-blind"))] = True
    gpus: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(description=(
        "GPUs to spread every instance over, round-robin (each instance sees its own GPU as cuda:0). Empty: the "
        "CPU. A role's own gpus list takes precedence."),
        extra=use("launcher", metavar="0,1,..."))] = []
    heartbeat_timeout: Annotated[float, Meta(gt=0, description=(
        "Seconds of silence after which an instance is dead and the requests it held get new attempts; a role "
        "that hears nothing from the orchestrator this long reconnects. At least 2: twice the 1 s heartbeat."),
        extra=use("orchestrator", "role", legacy="heartbeat_timeout_s"))] = 3.0
    stall_timeout: Annotated[float, Meta(gt=0, description=(
        "Seconds an instance holding work may make no progress (stage starts and ends, denoising steps) before "
        "it is dead for that work."),
        extra=use("orchestrator", legacy="stall_timeout_s"))] = 120.0
    request_timeout: Annotated[float, Meta(gt=0, description=(
        "Seconds a request may take before it fails with a timeout error (a Submit may set its own)."),
        extra=use("orchestrator", legacy="request_timeout_s"))] = 600.0
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
    schedule: Annotated[Literal["fifo", "slo"], Meta(description=(
        "Which request goes next. fifo: each role's queue in arrival order, and a denoiser's held requests take "
        "turns in arrival order. slo: queues by priority, then least slack (the deadline, slo_ms after arrival, "
        "less now and less the predicted remaining time, from measured stage times), and a request goes to the "
        "instance where it gets the device soonest; a denoiser holding several requests picks after every step "
        "which one steps next, earliest deadline first, setting aside the longest where one would miss, so a long "
        "request yields at step boundaries to a short one (its latents stay in memory); encoders and decoders "
        "order their computes the same way (a video's decode yields between latent frames). Aging "
        "(schedule_aging_s) bounds how long any request waits."),
        extra=use("orchestrator", "role"))] = "slo"
    schedule_aging_s: Annotated[float, Meta(gt=0, le=86400, description=(
        "schedule slo: every this many seconds a request waits (in a queue, or held and not stepping), it counts "
        "one priority higher, so no request starves."),
        extra=use("orchestrator", "role"))] = 10.0
    cache: Annotated[CacheSpec, Meta(description=(
        "Denoisers: the step cache of every request that names none, as a request's `cache` field: "
        "{type: first_block, threshold: 0.3} (types first_block, mag, taylorseer, faster, "
        "pyramid_attention_broadcast, sea; the other keys are the diffusers config's own fields, with its bounds). "
        "A request's {type: none} runs without. {} = none. Models without a diffusers transformer (sim, payload) "
        "ignore it."),
        extra=use("role", flag=None))] = {}
    compile: Annotated[bool, Meta(description=(
        "Denoisers: torch.compile the transformer (diffusers models' own compile, in place) and warm it up at "
        "boot at each of compile_sizes before the instance reports ready (the live table shows it compiling; "
        "status its compile_s), so no request pays the compile."),
        extra=use("role", flag="--compile/--no-compile"))] = False
    compile_mode: Annotated[Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                            Meta(description="compile: torch.compile's mode.", extra=use("role"))] = "default"
    compile_sizes: Annotated[list[Annotated[str, Meta(pattern=r"^[1-9][0-9]*x[1-9][0-9]*$")]], Meta(description=(
        "compile: the WIDTHxHEIGHT sizes warmed up at boot (each compiles its own graphs); [] = the model's "
        "default size."),
        extra=use("role", flag=None))] = []
    compile_cache_dir: Annotated[str, Meta(description=(
        "compile: where inductor keeps its caches (TORCHINDUCTOR_CACHE_DIR), so an instance restarted or started "
        "from a spare skips most of the compile. '' = <run dir>/inductor (this deployment's)."),
        extra=use("role"))] = ""
    conditioning_cache_mib: Annotated[int, Meta(ge=0, le=1 << 20, description=(
        "Encoders: MiB of recent text encodings each keeps (an LRU on its device). A request whose prompt, "
        "negative prompt, guidance and adapters equal a kept one reuses it and the encoder computes nothing; "
        "the orchestrator sends a repeat to the encoder that holds it when that one has a free slot. 0 = off."),
        extra=use("role"))] = 256
    admission: Annotated[Literal["off", "slo"], Meta(description=(
        "slo: a request whose deadline (slo_ms) cannot be met even if it ran at once, by the measured stage "
        "times, is refused at Submit (deadline_unmeetable, HTTP 429 with Retry-After); before the first "
        "measurements nothing is refused. off: every request is taken."),
        extra=use("orchestrator"))] = "off"
    busy_poll: Annotated[float, Meta(ge=0, le=0.01, description=(
        "Seconds the orchestrator polls without sleeping after each event while few requests are in flight "
        "(busy_poll_max_in_flight): the next message is taken without a thread wake-up, for about a core's "
        "CPU while it lasts. 0: always sleep in poll."),
        extra=use("orchestrator"))] = 0.0003
    busy_poll_max_in_flight: Annotated[int, Meta(ge=0, le=1 << 20, description=(
        "Busy polling stops while more requests than this are in flight (then messages arrive close together "
        "and a poll never sleeps long)."),
        extra=use("orchestrator"))] = 4
    keys: Annotated[str, Meta(description=(
        "CurveZMQ keys directory (`disagg keys generate DIR`): only holders of the client key may submit or "
        "register. Empty: no authentication (keep host on 127.0.0.1 then)."),
        extra=use("launcher", "orchestrator", "role", "gateway", metavar="DIR"))] = ""
    lane: Annotated[bool, Meta(description=(
        "Control messages between processes on one host take a Unix-socket fast lane instead of ZeroMQ: one "
        "thread wake per hop instead of several (about 100 us less per hop on a small VM). ZeroMQ still carries "
        "registration, other hosts and big messages. false: everything over ZeroMQ."),
        extra=use("orchestrator", "role", flag="--lane/--no-lane"))] = True
    ready_timeout: Annotated[float, Meta(gt=0, description=(
        "Seconds `disagg launch` waits for every instance to load its model and report ready."),
        extra=use("launcher", legacy="ready_timeout_s"))] = 180.0
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
        return self.transfer_protocol or ("rdma" if self.ib_device else "tcp")

    def all_gpus(self) -> list[int]:
        gpus = list(self.gpus)
        for role in ROLE_SECTIONS:
            for g in self.role(role).gpus or []:
                if g not in gpus:
                    gpus.append(g)
        return gpus
