"""What `disagg status` reports about instances, requests, transfers and gateways: plain structs
inside the StatusReport message (disagg/transport/wire/messages.py re-exports them)."""

from __future__ import annotations

from typing import Literal

import msgspec

from disagg.transport.wire.role_stats import BootStats, CacheStats, CompileStats, LoraStats, MemoryStats


class InstanceStatus(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One role instance as `disagg status` shows it."""

    id: str
    role: str
    pid: int
    host: str
    device: str
    state: str
    capacity: int
    free_slots: int
    in_flight: int
    completed: int
    failed: int
    #: the engine of its last pull (else the fastest it serves), and every engine it serves
    engine: str = ""
    engines: list[str] = []
    pool_bytes: int = 0
    #: staged outputs not yet fetched (orchestrator's count) / free bytes the role last reported
    pool_used_bytes: int = 0
    pool_free_bytes: int = 0
    #: mooncake registration: peer id and registered base address of the pool
    session_id: str = ""
    base_addr: int = 0
    #: engines that apply to its pool but could not start here, and why (Register.unavailable_engines)
    unavailable_engines: dict[str, str] = {}
    last_seen_s: float = 0.0
    restarts: int = 0
    #: seconds spent computing (fetch + stage) since registration, for utilization
    busy_s: float = 0.0
    #: requests that may share one forward (continuous batching); 1 = no batching
    max_batch: int = 1
    #: model components this instance loaded -> parameters (0: tokenizer, scheduler)
    components: dict[str, int] = {}
    #: its control messages take the same-host fast lane (disagg/transport/wire/lane.py), not ZeroMQ
    lane: bool = False
    #: the model it serves, as given to `disagg launch --model`
    model: str = ""
    #: continuous batching: batch size -> denoising steps run at that size
    batch_steps: dict[int, int] = {}
    #: an instance over several devices: each rank's device, and the layout ("ulysses 2", "cfg 2 x ulysses 2")
    devices: list[str] = []
    parallel: str = ""
    #: the GPUs it was given, as its host numbers them (its CUDA_VISIBLE_DEVICES; "" where none)
    visible_gpus: str = ""
    #: stages this process finished since it started, as it counts them (survives an orchestrator restart)
    computed: int = 0
    #: what it measures about itself, as its latest heartbeat said (disagg/transport/wire/role_stats.py): its LoRA
    #: adapters, an encoder's conditioning cache, its boot while state is starting, a compiled denoiser's compile, its
    #: device's free memory and its weights' bytes
    lora: LoraStats = msgspec.field(default_factory=LoraStats)
    conditioning: CacheStats = msgspec.field(default_factory=CacheStats)
    boot: BootStats = msgspec.field(default_factory=BootStats)
    compile: CompileStats = msgspec.field(default_factory=CompileStats)
    memory: MemoryStats = msgspec.field(default_factory=MemoryStats)

class RequestCounts(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Request totals since the orchestrator started."""

    in_flight: int = 0
    completed: int = 0
    failed: int = 0
    #: given up by their clients (Cancel)
    cancelled: int = 0
    #: failed for the request's own fault (an input or format the model cannot take): client errors, not
    #: counted in `failed`
    invalid: int = 0

class TransferCount(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Handoffs along one edge (producer role -> consumer role) with one engine, since start."""

    source: str
    target: str
    engine: str
    count: int
    bytes: int

class PairEngine(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Handoffs from one instance to another since start, and the engine they took (hosts: where each runs). Status
    lists the 1,024 pairs that handed over most recently (disagg/orchestrator/stats.py MAX_PAIRS)."""

    source: str
    target: str
    engine: str
    count: int
    source_host: str = ""
    target_host: str = ""

class GatewayStatus(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A gateway heard from in the last few seconds."""

    url: str
    pid: int
    restarts: int = 0
    last_seen_s: float = 0.0

class StageTime(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Requests that finished a phase of a stage since start, and the seconds they spent in it."""

    role: str
    phase: str
    count: int
    sum_s: float


class SloCount(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Requests of one priority that had a deadline (slo_ms) and ended since start: met it or missed it
    (a failure counts as missed); `slack_s` sums their slack at finish (deadline - finish, negative when
    missed); `buckets`: how many finished with slack <= each of SLACK_BUCKETS_S (cumulative, Prometheus-style)."""

    priority: int
    met: int = 0
    missed: int = 0
    slack_s: float = 0.0
    buckets: list[int] = []


#: the slack-at-finish histogram's upper bounds, seconds (the last bucket, +Inf, is met + missed)
SLACK_BUCKETS_S = (-10.0, -1.0, -0.1, 0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class SplitRate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One split of the device budget (E:D:K) and the requests per second the throughput model predicts for it."""

    split: str
    rps: float


class RoleMove(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One device changing role (`rebalance: auto`): its instance drains (`draining`), then its launcher starts
    it again as `new_id` of `to_role` (`restarting`), which registers and serves (then the move is over)."""

    instance_id: str
    new_id: str
    from_role: str
    to_role: str
    state: Literal["draining", "restarting"]
    #: seconds since the move began
    age_s: float = 0.0


class RebalanceStatus(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`rebalance` (advise, auto): the split the throughput model recommends for the last window's requests, and
    what it predicts the current and the recommended splits serve. `window_requests` 0: nothing to plan from yet
    (or a role not measured), and then no recommendation."""

    mode: str
    #: the devices being split (instances that can change role) and those that cannot (several ranks, or no
    #: launcher that takes orders), per role
    budget: int = 0
    fixed: dict[str, int] = {}
    current: str = ""
    current_rps: float = 0.0
    recommended: str = ""
    recommended_rps: float = 0.0
    window_requests: int = 0
    #: device-seconds per request of the window's mix, per role (the model's input)
    work_s: dict[str, float] = {}
    #: the best splits considered, best first (at most 8)
    considered: list[SplitRate] = []
    #: moves in progress, moves finished since start, and seconds since the last one finished (-1: none yet)
    moving: list[RoleMove] = []
    moves: int = 0
    last_move_s: float = -1.0
    #: why no move is made now (cooldown, gain under min_gain, ...), empty when one is
    holding: str = ""
    #: devices of several classes (H200s beside L40Ss): the split the plan was made on and the recommended one, per
    #: class ("H200 1:3:0, L40S 1:1:2"; empty where the devices are of one class, or of none known). `work_s` is
    #: then in H200-seconds
    current_classes: str = ""
    recommended_classes: str = ""
