"""The settings schema's parts below the top level: the processes a setting is for, how a field says so (`use`),
and the sections (encoders / denoisers / decoders, http, loras, rebalance, parallel layouts). disagg/settings/schema.py
assembles them into Settings and re-exports them."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from disagg.settings.choices import (
    CompileMode,
    CompileScope,
    Dispatch,
    LoraAffinity,
    RebalanceMode,
    Role,
    Schedule,
    Transfer,
)
from disagg.transport.wire.params import (
    LoraName,  # one adapter-name rule: requests' and the registry's
)

#: the processes a setting may be for
PROCESSES = ("launcher", "orchestrator", "role", "gateway")
#: how one instance may span devices, in mesh order (disagg/roles/layout.py re-exports it)
PARALLEL_KINDS = ("cfg", "ring", "ulysses")
#: dispatch policies (disagg/orchestrator/scheduling/dispatch.py implements each; a test checks the two agree)
DISPATCH_POLICIES = Dispatch.values()
#: transfer engines (disagg/transport/data/selection.py's CHOICES; a test checks the two agree)
TRANSFERS = Transfer.values()
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


def use(*processes: str, flag: str | None = "", legacy: str | tuple[str, ...] = "", metavar: str = "") -> dict:
    """A field's `extra`: the processes that read it; its flag ("" = --NAME, None = config file and environment
    only); the older key it had (its whole path: compile_mode for compile.mode), which still works in a config
    file and as a DISAGG_ variable, with a warning."""
    assert set(processes) <= set(PROCESSES), processes
    return {"for": processes, "flag": flag, "legacy": legacy, "metavar": metavar}


Degree = Annotated[int, Meta(ge=1, le=64)]
RoleName = Role


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


#: a key's priority (http.api_keys)
ApiKeyPriority = Annotated[int, Meta(ge=-1000, le=1000)]


class ApiKey(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An http.api_keys entry written out: the priority its requests get (null: any they name) and whether it
    sees every key's work (admin)."""

    priority: ApiKeyPriority | None = None
    admin: bool = False


class HttpSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The OpenAI-compatible HTTP gateway (disagg/gateway/): `disagg launch` starts one beside the orchestrator when
    http.port is set; `disagg serve-http` runs one for a deployment already running."""

    port: Annotated[int, Meta(ge=0, le=65535, description=(
        f"Port of the HTTP gateway. 0: launch starts none (serve-http then serves on {SERVE_HTTP_PORT})."),
        extra=use("launcher", "gateway", flag="--http-port"))] = 0
    host: Annotated[str, Meta(description="Address the HTTP gateway binds.",
                              extra=use("gateway", flag="--http-host"))] = "127.0.0.1"
    api_key: Annotated[str, Meta(description=(
        "When set, every route but /, /health, /liveness, /metrics and the unguessable image URLs needs "
        "`Authorization: Bearer KEY`. It is the admin key: it sees what every key made (http.api_keys). Prefer the "
        "environment (DISAGG_HTTP_API_KEY) to a file or a flag."),
        extra=use("gateway", flag="--api-key"))] = ""
    api_keys: Annotated[dict[str, ApiKeyPriority | ApiKey], Meta(description=(
        "More API keys, each a tenant of its own: KEY -> the priority its requests get (-1000..1000), or KEY -> "
        "{priority, admin}. A request sent with such a key runs at that priority unless it names a lower one; "
        "naming a higher one is refused (403, param priority); {priority: null} names any. What the gateway keeps "
        "(answers kept for X-Request-Id, video jobs, /recent) each key sees of its own only; http.api_key and keys "
        "with admin: true see every key's. Prefer the environment (DISAGG_HTTP_API_KEYS, YAML: '{KEY: 5}' or "
        "'{KEY: {priority: 5, admin: true}}') to a file."),
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
    read_timeout: Annotated[float, Meta(gt=0, le=3600, description=(
        "Seconds a client has to send a request's headers, and the most it may stay silent while sending its body: "
        "past it the connection is closed (headers) or the request answered 408 (body)."),
        extra=use("gateway", flag=None))] = 30.0
    body_timeout: Annotated[float, Meta(gt=0, le=86400, description=(
        "Seconds a client has to send a whole request body (408 past it), however it trickles in."),
        extra=use("gateway", flag=None))] = 300.0
    body_budget_mib: Annotated[int, Meta(ge=1, le=1 << 20, description=(
        "MiB of request bodies the gateway holds at once, every request together, from their first byte until "
        "they are answered (each body is also limited by its route: 1 MiB, 33 MiB for uploads). A body that would "
        "pass it is refused with 503 and Retry-After."),
        extra=use("gateway", flag=None))] = 512


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
        "Adapters each instance keeps loaded at once; for a new one it unloads the one its latest requests used "
        "least (the least recently used among equals)."),
        extra=use("role", flag="--lora-slots"))] = 8
    host_slots: Annotated[int, Meta(ge=0, le=65536, description=(
        "Adapters each instance keeps in host memory once unloaded from its device (0: none, an unloaded adapter "
        "is forgotten). A request for one copies it back (a restore: diffusers' set_lora_device) instead of "
        "reading and installing its file again (a load); the least recently unloaded is forgotten first. Refused "
        "with compile (a compiled denoiser keeps every adapter it holds active)."),
        extra=use("role", flag="--lora-host-slots"))] = 0
    max_mib: Annotated[int, Meta(ge=1, description=(
        "MiB of adapter weights each instance keeps loaded at most (besides slots)."),
        extra=use("role", flag=None))] = 4096
    affinity: Annotated[LoraAffinity, Meta(description=(
        "auto: cost where a denoiser keeps adapters in host memory (host_slots), else on: each where it was "
        "measured best (BENCHMARKS.md, LoRA affinity). on: of the free denoisers, one that holds all of a "
        "request's adapters gets it; when only busy ones hold them, the request waits for one at most as long as "
        "a load takes, then goes elsewhere (the load rule). cost: the free denoiser where the request is expected "
        "to finish first, counting the work each holds, a load where its adapters are not held (a restore where it "
        "keeps them in host memory) and half a load more when it evicts one (half a restore with host_slots, unless "
        "host memory is full); without host memory it loads more than on for no shorter tail (BENCHMARKS.md has the "
        "numbers). off: adapters play no part in dispatch. slack (a holder unless another has more than one "
        "free slot more) and two-choices (the freer of two holders drawn at random) are rules it was measured "
        "against, kept to compare."),
        extra=use("orchestrator", flag="--lora-affinity"))] = LoraAffinity.AUTO


class CompileSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Compiled denoisers (disagg/roles/extensions/compile.py): torch.compile on the transformer, warmed up at boot. Before this
    section these were the top-level compile, compile_mode, compile_scope, compile_sizes and compile_cache_dir
    (still read from a config file and DISAGG_COMPILE, with a warning)."""

    enabled: Annotated[bool, Meta(description=(
        "Denoisers: torch.compile the transformer (diffusers models' own compile, in place) and warm it up at "
        "boot at each of compile.sizes, and at batch sizes 1, 2 and max_batch when it batches, before the instance "
        "reports ready (the live table shows it compiling; status its compile.seconds), so no request pays the compile."),
        extra=use("role", flag="--compile/--no-compile", legacy="compile"))] = False
    mode: Annotated[CompileMode, Meta(description=(
        "torch.compile's mode. reduce-overhead and max-autotune replay CUDA graphs: refused on a GPU "
        "with torch < 2.13, which crashes them on a request's thread (pytorch#123177)."),
        extra=use("role", legacy="compile_mode"))] = CompileMode.DEFAULT
    scope: Annotated[CompileScope, Meta(description=(
        "blocks compiles each repeated transformer block class once (diffusers' "
        "compile_repeated_blocks: a shorter cold start; the whole model where it names no repeated blocks); "
        "model compiles the whole transformer."),
        extra=use("role", legacy="compile_scope"))] = CompileScope.BLOCKS
    sizes: Annotated[list[Annotated[str, Meta(pattern=r"^[1-9][0-9]*x[1-9][0-9]*$")]], Meta(description=(
        "The WIDTHxHEIGHT sizes warmed up at boot (each compiles its own graphs); [] = the model's "
        "default size."),
        extra=use("role", flag=None, legacy="compile_sizes"))] = []
    cache_dir: Annotated[str, Meta(description=(
        "Where inductor keeps its caches (TORCHINDUCTOR_CACHE_DIR), so an instance restarted or started "
        "from a spare skips most of the compile. '' = <run dir>/inductor (this deployment's)."),
        extra=use("role", legacy="compile_cache_dir"))] = ""


class BusyPollSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The orchestrator's busy polling (disagg/orchestrator/server.py). Before this section these were the top-level
    busy_poll (now busy_poll.seconds) and busy_poll_max_in_flight (still read from a config file and DISAGG_BUSY_POLL,
    with a warning)."""

    seconds: Annotated[float, Meta(ge=0, le=0.01, description=(
        "Seconds the orchestrator polls without sleeping after each event while few requests are in flight "
        "(busy_poll.max_in_flight; none while none is: an idle deployment's heartbeats do not): the next message "
        "is taken without a thread wake-up, for about a core's CPU while it lasts. 0: always sleep in poll."),
        extra=use("orchestrator", flag="--busy-poll", legacy="busy_poll"))] = 0.0003
    max_in_flight: Annotated[int, Meta(ge=0, le=1 << 20, description=(
        "Busy polling stops while more requests than this are in flight (then messages arrive close together "
        "and a poll never sleeps long)."),
        extra=use("orchestrator", legacy="busy_poll_max_in_flight"))] = 4


class ForwardSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Stages that hand the next stage's Run on themselves (disagg/orchestrator/forwards.py)."""

    max_wait_ms: Annotated[float, Meta(ge=0, le=60_000, description=(
        "When a stage is placed and an instance of the next role on the same host is free with nothing queued "
        "for it, the orchestrator reserves it and the stage's instance sends it the next Run itself (a Forward "
        "on its peer lane) as soon as its output is staged: a request goes on without a round trip through "
        "the orchestrator (about a fifth of a zero-compute request's latency on one host). Only while the "
        "stages before the reserved one are predicted, from measured stage times, to take at most this many "
        "milliseconds: the reserved slot waits idle that long at most. 0: the orchestrator sends every Run."),
        extra=use("orchestrator"))] = 5.0
    max_in_flight: Annotated[int, Meta(ge=0, le=1 << 20, description=(
        "Stages forward only while at most this many requests are in flight. Beyond, the orchestrator's turns "
        "carry many messages each and wake each role once for several Runs, which costs less CPU than one "
        "Forward per request, and a reserved slot is one that a request arriving meanwhile cannot take."),
        extra=use("orchestrator"))] = 4


class RebalanceSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Pools that size themselves: the orchestrator works out which split of the devices between the roles serves
    the recent traffic best (disagg/orchestrator/parts/planner.py), shows it, and with mode auto moves devices to it."""

    mode: Annotated[RebalanceMode, Meta(description=(
        "advise: every interval_s, from the last window_s of requests (their mix) and the measured stage times, "
        "the split of the devices (E:D:K) that serves the most requests per second is recommended, with what the "
        "current and the recommended splits are predicted to serve (status, the live table, /metrics). auto: "
        "devices also move to it: an instance of a role with too many drains (it takes no new work and finishes "
        "what it holds), exits, and its launcher starts it again on the same device as the role with too few "
        "(forked from the launcher's fork server, or a spare interpreter). off: neither."),
        extra=use("orchestrator", flag="--rebalance"))] = RebalanceMode.ADVISE
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


class ScheduleSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Which request goes next (disagg/orchestrator/scheduling/, disagg/roles/turns.py). Before this section these were
    the top-level schedule (now schedule.order: `schedule: slo` in a config file still works) and schedule_aging_s
    (still read from a config file and DISAGG_SCHEDULE, DISAGG_SCHEDULE_AGING_S, with a warning)."""

    order: Annotated[Schedule, Meta(description=(
        "Which request goes next. fifo: each role's queue in arrival order, and a denoiser's held requests take "
        "turns in arrival order. slo: queues by priority, then least slack (the deadline, slo_ms after arrival, "
        "less now and less the predicted remaining time, from measured stage times), and a request goes to the "
        "instance where it gets the device soonest; a denoiser holding several requests picks after every step "
        "which one steps next, earliest deadline first, setting aside the longest where one would miss, so a long "
        "request yields at step boundaries to a short one (its latents stay in memory); encoders and decoders "
        "order their computes the same way (a video's decode yields between latent frames). Aging "
        "(schedule.aging_s) bounds how long any request waits."),
        extra=use("orchestrator", "role", flag="--schedule", legacy="schedule"))] = Schedule.SLO
    aging_s: Annotated[float, Meta(gt=0, le=86400, description=(
        "slo: every this many seconds a request waits (in a queue, or held and not stepping), it counts "
        "one priority higher, so no request starves."),
        extra=use("orchestrator", "role", flag="--schedule-aging-s", legacy="schedule_aging_s"))] = 10.0


class TimeoutSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How long the deployment waits before it gives up on something. Before this section these were the top-level
    heartbeat_timeout, stall_timeout, request_timeout and ready_timeout (and, before those, the same with _s): all
    still read from a config file and their DISAGG_ variables, with a warning."""

    heartbeat: Annotated[float, Meta(gt=0, description=(
        "Seconds of silence after which an instance is dead and the requests it held get new attempts; a role "
        "that hears nothing from the orchestrator this long reconnects. At least 2: twice the 1 s heartbeat."),
        extra=use("orchestrator", "role", flag="--heartbeat-timeout", legacy=("heartbeat_timeout", "heartbeat_timeout_s")))] = 3.0
    stall: Annotated[float, Meta(gt=0, description=(
        "Seconds an instance holding work may make no progress (stage starts and ends, denoising steps) before "
        "it is dead for that work."),
        extra=use("orchestrator", flag="--stall-timeout", legacy=("stall_timeout", "stall_timeout_s")))] = 120.0
    request: Annotated[float, Meta(gt=0, description=(
        "Seconds a request may take before it fails with a timeout error (a Submit may set its own)."),
        extra=use("orchestrator", flag="--request-timeout", legacy=("request_timeout", "request_timeout_s")))] = 600.0
    ready: Annotated[float, Meta(gt=0, description=(
        "Seconds an instance may go without progress while it boots before `disagg launch` gives up on it (a "
        "stall, not the whole boot: downloading weights, loading them and compiling go on for as long as they "
        "progress; `disagg status` shows each instance's phase and bytes so far)."),
        extra=use("launcher", flag="--ready-timeout", legacy=("ready_timeout", "ready_timeout_s")))] = 180.0
