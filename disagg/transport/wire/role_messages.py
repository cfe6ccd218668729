"""The messages between role instances and the orchestrator (the backend socket and the lane): registration,
heartbeats, work (Run) and its reports. Part of disagg/transport/wire/messages.py's wire schema, which re-exports them."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from disagg.transport.wire.codes import ErrorCode
from disagg.transport.wire.descriptors import Count, Held, Id, ModelIdentity, PoolInfo, Role, SlotRef, Source
from disagg.transport.wire.params import GenerationParams, LoraName
from disagg.transport.wire.role_stats import BootStats, CacheStats, CompileStats, LoraStats, MemoryStats
from disagg.transport.wire.wire import Seconds, _Msg

# --- role <-> orchestrator ----------------------------------------------------------------


class Register(_Msg, tag="register", kw_only=True):
    """A role instance introduces itself (again, after a restart)."""

    role: Role
    instance_id: Id
    pid: Count
    host_id: Annotated[str, Meta(max_length=256)]
    device: Annotated[str, Meta(max_length=64)]
    capacity: Annotated[int, Meta(ge=1, le=4096)]
    #: requests that may share one batched forward (denoisers with continuous batching)
    max_batch: Annotated[int, Meta(ge=1, le=4096)] = 1
    pool: PoolInfo
    ready: bool = False
    #: work still computing from before this registration: request id -> attempt
    busy: dict[Id, Count] = {}
    #: outputs staged in its pool and not yet released (a decoder sends its recent Done messages again
    #: right after registering with an orchestrator that restarted)
    held: Annotated[list[Held], Meta(max_length=65_536)] = []
    #: where it takes Forward messages from the instances before it in the pipeline (a Unix socket on its host,
    #: disagg/roles/peers.py); empty: it takes none (lane off), and the orchestrator sends it every Run itself
    peer_lane: Annotated[str, Meta(max_length=1024)] = ""
    #: how often the launcher restarted this instance
    restarts: Count = 0
    #: the deployment this instance belongs to; an orchestrator refuses instances of another one
    deployment_id: Annotated[str, Meta(max_length=64, pattern=r"^[A-Za-z0-9_.-]*$")] = ""
    #: what the model can make, so the orchestrator refuses larger requests at Submit (0 = no limit)
    max_width: Count = 0
    max_height: Count = 0
    max_frames: Count = 0
    #: the model it serves (`--model`): what the HTTP gateway lists under /v1/models
    model: Annotated[str, Meta(max_length=1024)] = ""
    #: an instance over several devices (ranks): their devices, and its layout ("ulysses 2", "cfg 2")
    devices: Annotated[list[Annotated[str, Meta(max_length=64)]], Meta(max_length=64)] = []
    parallel: Annotated[str, Meta(max_length=64)] = ""
    #: the model it serves, as an orchestrator compares it with the deployment's (a different one is refused)
    identity: ModelIdentity | None = None
    #: the launcher that started it (host id and pid): what a join launcher's StopHost names
    launcher: Annotated[str, Meta(max_length=128)] = ""
    #: its LoRA adapters (None: it applies none): its slots, and adapters it still holds from before
    lora: LoraStats | None = None
    #: its device's memory in bytes (a GPU's total; the host's RAM on the CPU; 0: unknown): what `rebalance`
    #: checks before it gives this device another role
    memory_bytes: Count = 0
    #: the GPUs it was given, as its host numbers them (its CUDA_VISIBLE_DEVICES: what a scheduler such as Slurm
    #: allocated, narrowed to this instance's; "" where none)
    visible_gpus: Annotated[str, Meta(max_length=1024)] = ""
    #: engines that apply to its pool but could not start, and why (a GPU pool Mooncake cannot register: without
    #: GPUDirect RDMA its hand-offs to other hosts go inline through the orchestrator); status shows them loudly
    unavailable_engines: dict[Annotated[str, Meta(max_length=32)], Annotated[str, Meta(max_length=1024)]] = {}


class Registered(_Msg, tag="registered", kw_only=True):
    """Orchestrator accepts a registration."""

    session: Count
    heartbeat_interval_s: Seconds
    #: changes when the orchestrator restarts: staged outputs from before are nobody's
    orchestrator_id: str = ""
    #: the orchestrator's same-host fast lane (disagg/transport/wire/lane.py); empty = none, use ZeroMQ only
    lane: str = ""


class Heartbeat(_Msg, tag="heartbeat", kw_only=True):
    """A role is alive; `ready` turns true once its model is loaded."""

    instance_id: Id
    ready: bool = True
    in_flight: Count = 0
    pool_free_bytes: Count = 0
    #: grows while the role makes progress (stages started and finished, denoising steps)
    progress: Count = 0
    #: once loaded: parameters held per model component (the role loads only its own)
    components: dict[Annotated[str, Meta(max_length=64)], Count] = {}
    #: denoising steps of each request it runs: request id -> [done, total]
    steps: dict[Id, Annotated[list[Count], Meta(min_length=2, max_length=2)]] = {}
    #: continuous batching: batch size -> denoising steps run at that size since it started
    batch_steps: dict[Annotated[int, Meta(ge=1, le=4096)], Count] = {}
    #: requests computing here now (the orchestrator frees slots it inherited from a Register's
    #: `busy` once their request is no longer among them: their report may have been lost)
    running: Annotated[list[Id], Meta(max_length=4096)] = []
    #: stages this process finished since it started, by its own count (an orchestrator's count
    #: starts again when it restarts; this one shows whether work was done twice)
    computed: Count = 0
    #: the peers' pools it holds mapped (cuda-ipc, shm), by pool name: the orchestrator answers which are gone
    peer_pools: Annotated[list[Annotated[str, Meta(max_length=256)]], Meta(max_length=4096)] = []
    #: what it measures about itself (disagg/transport/wire/role_stats.py), each as its own struct, which the orchestrator
    #: keeps as it comes and `status` reports as it is; None: it has none (no LoRA bank, no conditioning cache, not
    #: compiled), or says nothing new: the orchestrator keeps the last it had
    lora: LoraStats | None = None
    conditioning: CacheStats | None = None
    boot: BootStats | None = None
    compile: CompileStats | None = None
    memory: MemoryStats | None = None


class Alive(_Msg, tag="alive", kw_only=True):
    """Orchestrator answers a Heartbeat, so roles can tell when the orchestrator is gone."""

    orchestrator_id: str
    #: of the Heartbeat's `peer_pools`, those no live instance owns (it died, restarted, or moved to another role
    #: under a new id): the role closes its mappings of them, which frees their memory
    forget_pools: Annotated[list[Annotated[str, Meta(max_length=256)]], Meta(max_length=4096)] = []


class Run(_Msg, tag="run", kw_only=True):
    """Orchestrator gives a role one stage of one request."""

    request_id: Id
    attempt: Count
    params: GenerationParams
    source: Source | None = None
    #: send the output's bytes along with Staged (a consumer may only be reachable inline)
    inline_output: bool = False
    #: where each of the request's LoRA adapters lies (a file or folder on the role's host, or a hub id):
    #: name -> source; empty for a sim model's adapters
    lora_sources: dict[LoraName, Annotated[str, Meta(max_length=4096)]] = {}
    #: `schedule: slo`: seconds from now by which this stage should end for the request to meet its deadline
    #: (its slo_ms, less the time already spent and the later stages' predicted time); None: no deadline. A
    #: denoiser steps its least-slack request first (disagg/roles/turns.py)
    stage_deadline_s: float | None = None
    #: what the request's result reports of earlier stages (its denoiser's step cache: `cache`, `steps_computed`,
    #: `steps_skipped`): a decoder returns it in its Done's `resolved`, so a result that outlives the orchestrator
    #: that sent this Run still reports it
    carry: dict[Annotated[str, Meta(max_length=64)], str | int | float] = {}
    #: the next stage's Run, for the instance the orchestrator reserved for it: this role sends it there itself
    #: (its `run.source` naming the slot it staged) as soon as its output is staged, and tells so in Staged
    #: (`forwarded`), so the request goes on without a round trip through the orchestrator
    then: Forward | None = None


class Forward(_Msg, tag="forward", kw_only=True):
    """A stage's Run handed from the instance before it in the pipeline straight to the instance the orchestrator
    reserved for it, on that instance's peer lane. Made by the orchestrator (inside the producer's Run: `Run.then`);
    the producer fills in the slot it staged. The instance runs it only while it is still the registration the
    orchestrator reserved it with (`orchestrator_id`, `session`) and the orchestrator has not withdrawn it."""

    instance_id: Id
    #: the instance's peer lane (Register.peer_lane)
    lane: Annotated[str, Meta(max_length=1024)]
    #: the orchestrator that reserved it, and the instance's registration there (Registered.session)
    orchestrator_id: Annotated[str, Meta(max_length=64)]
    session: Count
    run: Run


class Withdraw(_Msg, tag="withdraw", kw_only=True):
    """The orchestrator takes back a Forward it reserved this instance for (its request ended or went on to another
    attempt first). The instance answers with one report: if it runs that attempt, it stops it (Failed, cancelled);
    if it has not, it will not run it, and says so (Failed, cancelled); either way its slot comes back."""

    request_id: Id
    attempt: Count


class Fetched(_Msg, tag="fetched", kw_only=True):
    """The consumer has copied its inputs; the producer's slot may be released."""

    request_id: Id
    attempt: Count
    fetch_s: Seconds = 0.0


class Staged(_Msg, tag="staged", kw_only=True):
    """A role's outputs for a request lie in a slot of its pool (raw frame follows if inline)."""

    request_id: Id
    attempt: Count
    slot: SlotRef
    compute_s: Seconds = 0.0
    #: set when the role pulled its input and sent no Fetched for it (short computes fold it in here)
    fetch_s: Seconds | None = None
    #: its share of the instance's device time when it shared a batched forward; None = compute_s
    device_s: Seconds | None = None
    #: seconds it waited for its LoRA adapters to load here (0: they were loaded, or it has none)
    lora_s: Seconds = 0.0
    #: a denoiser that ran a step cache (disagg/roles/extensions/step_cache.py): the steps every attention ran in, and the steps
    #: the cache stood in for some; None without one. `cache`: its label ("first_block threshold=0.2")
    cache: Annotated[str, Meta(max_length=1024)] | None = None
    steps_computed: Count | None = None
    steps_skipped: Count | None = None
    #: it sent the next stage's Run on to the instance reserved for it (Run.then): the orchestrator sends none
    forwarded: bool = False


def cache_report(report: Held | Staged) -> dict:
    """A denoiser output's step-cache report (its Staged, or its Held in a Register: the same fields), as a Result's
    resolved parameters and a decoder's Run.carry spell it; empty without one."""
    if report.steps_computed is None:
        return {}
    return {"cache": report.cache or "", "steps_computed": report.steps_computed,
            "steps_skipped": report.steps_skipped or 0}


class Preview(_Msg, tag="preview", kw_only=True):
    """A denoiser staged a copy of a request's latents after step `step`: its `index`th preview (0-based). The
    orchestrator has a free decoder decode it (Run under `preview_id`), or releases it when none is free."""

    request_id: Id
    attempt: Count
    index: Annotated[int, Meta(ge=0, le=2)]
    step: Count
    #: the request's denoising steps in all
    steps: Count = 0
    slot: SlotRef
    #: when it was staged (Unix time, the denoiser's clock): how old a preview is when it arrives
    staged_at: float = 0.0


class Release(_Msg, tag="release", kw_only=True):
    """Orchestrator tells a producer that a slot of its pool may be reused."""

    request_id: Id
    offset: Count


class Done(_Msg, tag="done", kw_only=True):
    """The decoder finished a request; one raw frame per encoded image follows."""

    request_id: Id
    attempt: Count
    num_images: Count
    image_format: str = "png"
    compute_s: Seconds = 0.0
    #: as in Staged
    fetch_s: Seconds | None = None
    #: as in Staged
    device_s: Seconds | None = None
    lora_s: Seconds = 0.0
    #: as in Result
    resolved: dict[Annotated[str, Meta(max_length=64)], str | int | float] = {}


class Failed(_Msg, tag="failed", kw_only=True):
    """A stage of a request failed on a role; the role keeps serving."""

    request_id: Id
    attempt: Count
    error: Annotated[str, Meta(max_length=65_536)]
    #: the failure may not repeat on another try (a transfer from a dead peer, a full pool)
    retryable: bool = False
    #: GENERATION_FAILED, or INVALID_INPUT when the request is at fault, not the instance (an input or format the
    #: model cannot take, tensors too large for a pool): a client error, not retried, not counted against the
    #: instance; `param`: the request field at fault
    code: ErrorCode = ErrorCode.GENERATION_FAILED
    param: str | None = None
    #: its input could not be read from the instance that staged it (a transfer error while pulling it: that
    #: instance may be gone, not yet declared dead): another attempt does not read it again, it starts over
    source_lost: bool = False


class Shutdown(_Msg, tag="shutdown", kw_only=True):
    """Orchestrator tells a role to exit."""

    #: it exits so that its device serves another role (rebalance): with status MOVE_EXIT, which tells its
    #: launcher to keep the device for the Rerole order, whichever orchestrator gives it
    move: bool = False


class Dead(_Msg, tag="dead", kw_only=True):
    """A role reports, best effort, that it is exiting on an error."""

    instance_id: Id
    reason: Annotated[str, Meta(max_length=65_536)]
