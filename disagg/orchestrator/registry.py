"""The orchestrator's view of every role instance: capacity, free slots, pool use, liveness."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from disagg.common.averages import ewma
from disagg.transport.wire.messages import InstanceStatus, PoolInfo, Register
from disagg.transport.wire.role_stats import BootStats, CacheStats, CompileStats, LoraStats, MemoryStats


@dataclass
class Instance:
    """One registered role instance."""

    id: str
    role: str
    pid: int
    host: str
    device: str
    capacity: int
    pool: PoolInfo
    session: int
    last_seen: float
    state: str = "starting"
    free_slots: int = 0
    #: request id -> attempt of each request computing here (holds a compute slot)
    running: dict[str, int] = field(default_factory=dict)
    #: slot offset -> bytes, for outputs staged here that no consumer has fetched yet
    staged: dict[int, int] = field(default_factory=dict)
    completed: int = 0
    failed: int = 0
    #: where it takes Forwards (Register.peer_lane); empty: it takes none
    peer_lane: str = ""
    engine: str = ""
    #: producer id -> (its session, the engine and warning of choose_engine for its outputs to this instance): the
    #: pools of one registration never change
    engines_from: dict[str, tuple] = field(default_factory=dict)
    pool_free_bytes: int = 0
    progress: int = 0
    progress_at: float = 0.0
    largest_input: int = 0
    largest_output: int = 0
    busy_s: float = 0.0
    #: moving average of its stage time (the least-work policy's estimate)
    stage_s_avg: float = 0.0
    #: moving average of the stage time of requests it ran alone (nothing else assigned to it meanwhile): what
    #: one request costs its device, the LoRA cost rule's unit (disagg/orchestrator/scheduling/loras.py); `alone` is the request
    #: it runs alone now, if any
    solo_s: float = 0.0
    alone: str | None = None
    restarts: int = 0
    max_batch: int = 1
    components: dict[str, int] = field(default_factory=dict)
    #: its device's memory (Register.memory_bytes; 0 unknown); its free memory and weights' bytes are `memory` below
    memory_bytes: int = 0
    #: the GPUs it was given, as its host numbers them (Register.visible_gpus)
    visible_gpus: str = ""
    #: engines that apply to its pool but could not start there, and why (Register.unavailable_engines)
    unavailable_engines: dict[str, str] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)
    parallel: str = ""
    lane: bool = False
    model: str = ""
    #: the launcher that started it (Register.launcher)
    launcher: str = ""
    #: request id -> [done, total] denoising steps, as its last heartbeat said
    steps: dict[str, list[int]] = field(default_factory=dict)
    batch_steps: dict[int, int] = field(default_factory=dict)
    #: slots taken by work it said it still ran when it registered (Register.busy): request -> attempt
    inherited: dict[str, int] = field(default_factory=dict)
    #: inherited work its heartbeat no longer lists: request -> when first missed
    vanished: dict[str, float] = field(default_factory=dict)
    #: stages the process finished since it started, by its own count (Heartbeat.computed)
    computed: int = 0
    #: what it measures about itself (disagg/transport/wire/role_stats.py): the latest of each its Register and heartbeats
    #: sent, kept as it came (a heartbeat without one keeps the last). `lora.held` and `lora.host` also take what was
    #: just sent to it (disagg/orchestrator/scheduling/loras.py note_assigned) until its next heartbeat says
    lora: LoraStats = field(default_factory=LoraStats)
    conditioning: CacheStats = field(default_factory=CacheStats)
    boot: BootStats = field(default_factory=BootStats)
    compile: CompileStats = field(default_factory=CompileStats)
    memory: MemoryStats = field(default_factory=MemoryStats)
    #: its device's class, where its heartbeats name a device of a known class (disagg/settings/devices.py; "" else),
    #: and that class's speed, an H200's 1 (else 1): its stage times x this are H200-seconds (StagePredictor.at_speed_1)
    device_class: str = ""
    speed: float = 1.0
    #: the registry's free-slot index, told of every change of `state` or `free_slots` (_Indexed)
    index: "FreeIndex | None" = field(default=None, repr=False, compare=False)
    #: its status's fields that one registration fixes (status() builds it once)
    _status_base: InstanceStatus | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_register(cls, msg: Register, session: int, now: float) -> "Instance":
        return cls(
            id=msg.instance_id,
            role=msg.role,
            pid=msg.pid,
            host=msg.host_id,
            device=msg.device,
            capacity=msg.capacity,
            pool=msg.pool,
            session=session,
            last_seen=now,
            state="ready" if msg.ready else "starting",
            free_slots=msg.capacity,
            engine=msg.pool.engines[0] if msg.pool.engines else "",
            pool_free_bytes=msg.pool.pool_bytes,
            progress_at=now,
            restarts=msg.restarts,
            max_batch=msg.max_batch,
            model=msg.model,
            launcher=msg.launcher,
            devices=list(msg.devices),
            parallel=msg.parallel,
            lora=msg.lora if msg.lora is not None else LoraStats(),
            memory_bytes=msg.memory_bytes,
            visible_gpus=msg.visible_gpus,
            unavailable_engines=dict(msg.unavailable_engines),
            peer_lane=msg.peer_lane,
        )

    def record_stage_time(self, seconds: float, device_s: float | None = None, request_id: str = "") -> None:
        """`device_s`: the request's share of a batched forward; it then counts as busy time, and
        x capacity as the stage time, since requests in a batch finish together rather than side by side."""
        if request_id and request_id == self.alone:
            self.solo_s = ewma(self.solo_s or None, seconds)
            self.alone = None
        if device_s is not None:
            self.busy_s += device_s
            seconds = device_s * self.capacity
        else:
            self.busy_s += seconds
        self.stage_s_avg = ewma(self.stage_s_avg or None, seconds)

    @property
    def dispatchable(self) -> bool:
        return self.state == "ready" and self.free_slots > 0 and self.pool_has_room()

    def pool_has_room(self) -> bool:
        """Backpressure: room in the pool for one more request's input and output, judged by the
        largest seen so far, next to unfetched outputs and the inputs of the work in progress.
        A fast stage thus waits for its consumers instead of filling its pool and failing."""
        if not self.running and not self.staged:
            return True  # an empty pool always gets a try: estimates must never lock it out
        per_request = self.largest_input + self.largest_output
        need = sum(self.staged.values()) + (len(self.running) + 1) * per_request
        return need <= self.pool.pool_bytes

    def status(self, now: float) -> InstanceStatus:
        """What `disagg status` shows of it: the fields one registration fixes are built once (`_status_base`), the
        rest replaced in a copy (a status of 1,024 instances per role is asked for often)."""
        base = self._status_base
        if base is None:
            base = self._status_base = InstanceStatus(
                id=self.id, role=self.role, pid=self.pid, host=self.host, device=self.device, state=self.state,
                capacity=self.capacity, free_slots=0, in_flight=0, completed=0, failed=0,
                engines=list(self.pool.engines), pool_bytes=self.pool.pool_bytes, session_id=self.pool.session_id,
                base_addr=self.pool.base_addr, visible_gpus=self.visible_gpus, model=self.model,
                devices=list(self.devices), parallel=self.parallel,
            )
        return msgspec.structs.replace(
            base,
            state=self.state,
            capacity=self.capacity,
            free_slots=self.free_slots,
            in_flight=len(self.running),
            completed=self.completed,
            failed=self.failed,
            engine=self.engine,
            pool_used_bytes=sum(self.staged.values()),
            pool_free_bytes=self.pool_free_bytes,
            unavailable_engines=dict(self.unavailable_engines),
            last_seen_s=round(max(0.0, now - self.last_seen), 3),
            restarts=self.restarts,
            busy_s=round(self.busy_s, 6),
            max_batch=self.max_batch,
            components=self.components,
            batch_steps=self.batch_steps,
            lane=self.lane,
            computed=self.computed,
            lora=self.lora,
            conditioning=self.conditioning,
            boot=self.boot,
            compile=self.compile,
            memory=self.memory,
        )


class _Indexed:
    """An Instance attribute whose every change the registry's free-slot index hears of. It has no __get__: a
    read finds the value in the instance's __dict__ under the attribute's own name, at a plain attribute's speed
    (dispatch reads `state` and `free_slots` some thirty times per request)."""

    def __init__(self, name: str):
        self.key = name

    def __set__(self, obj, value) -> None:
        d = obj.__dict__
        d[self.key] = value
        index = d.get("index")
        if index is not None:
            index.update(obj)


# after the dataclass is made: its __init__ (defaults included) then sets them through these
Instance.state = _Indexed("state")
Instance.free_slots = _Indexed("free_slots")


class FreeIndex:
    """Ready instances with a free slot, per role, bucketed by free slots and then by host, each bucket in
    the order its instances last changed: dispatch finds the best candidate without scanning the role."""

    def __init__(self):
        #: role -> free slots -> host -> instance id -> instance
        self.buckets: dict[str, dict[int, dict[str, dict[str, Instance]]]] = {}
        self._where: dict[int, tuple[str, int, str]] = {}

    def update(self, inst: Instance) -> None:
        key = id(inst)
        old = self._where.pop(key, None)
        if old is not None:
            role, free, host = old
            by_free = self.buckets[role]
            hosts = by_free[free]
            group = hosts[host]
            del group[inst.id]
            if not group:
                del hosts[host]
                if not hosts:
                    del by_free[free]
        d = inst.__dict__  # (the values _Indexed keeps: read without the class's attribute lookup)
        free = d["free_slots"]
        if free > 0 and d["state"] == "ready":
            role, host = inst.role, inst.host
            by_free = self.buckets.get(role)
            if by_free is None:
                by_free = self.buckets[role] = {}
            hosts = by_free.get(free)
            if hosts is None:
                hosts = by_free[free] = {}
            group = hosts.get(host)
            if group is None:
                group = hosts[host] = {}
            group[inst.id] = inst
            self._where[key] = (role, free, host)

    def remove(self, inst: Instance) -> None:
        inst.__dict__["state"] = "gone"
        self.update(inst)

    def any_room(self, role: str) -> bool:
        """Whether some instance of the role is dispatchable (ready, a free slot, room in its pool)."""
        buckets = self.buckets.get(role)  # (loops, not a generator: dispatch asks after every message)
        if buckets:
            for hosts in buckets.values():
                for group in hosts.values():
                    for i in group.values():
                        if i.pool_has_room():
                            return True
        return False

    def by_free(self, role: str) -> list[tuple[int, dict[str, dict[str, Instance]]]]:
        """(free slots, host -> instances) of the role, most free first."""
        buckets = self.buckets.get(role, {})
        return [(free, buckets[free]) for free in sorted(buckets, reverse=True)]

    def candidates(self, role: str) -> list[Instance]:
        """Every ready instance of the role with a free slot (most free first)."""
        return [i for _, hosts in self.by_free(role) for group in hosts.values() for i in group.values()]

    def rotate(self, inst: Instance) -> None:
        """Put `inst` last among its equals (it was just picked)."""
        role, free, host = self._where[id(inst)]
        hosts = self.buckets[role][free]
        group = hosts[host]
        del group[inst.id]
        group[inst.id] = inst
        hosts[host] = hosts.pop(host)  # and its host after the others: equal hosts share the work too


class Registry:
    """All instances by id, with per-role lists in registration order, and the free-slot index."""

    def __init__(self):
        self.by_id: dict[str, Instance] = {}
        self._by_role: dict[str, list[Instance]] = {}
        self._batching: dict[str, bool] = {}
        self._host_tier: dict[str, bool] = {}
        self._sessions = 0
        self.free = FreeIndex()

    def register(self, msg: Register, now: float) -> Instance:
        self._sessions += 1
        inst = Instance.from_register(msg, self._sessions, now)
        old = self.by_id.get(inst.id)
        if old is not None:
            self.free.remove(old)
        self.by_id[inst.id] = inst
        inst.index = self.free
        self.free.update(inst)
        self._by_role.clear()
        self._batching.clear()
        self._host_tier.clear()
        return inst

    def batching(self, role: str) -> bool:
        """Whether some instance of the role batches requests (max_batch > 1)."""
        cached = self._batching.get(role)
        if cached is None:
            cached = self._batching[role] = any(i.max_batch > 1 for i in self.of_role(role))
        return cached

    def host_tier(self, role: str) -> bool:
        """Whether some instance of the role keeps unloaded LoRA adapters in host memory (lora_host_slots > 0)."""
        cached = self._host_tier.get(role)
        if cached is None:
            cached = self._host_tier[role] = any(i.lora.host_slots > 0 for i in self.of_role(role))
        return cached

    def set_lora(self, inst: Instance, stats: LoraStats) -> None:
        """A heartbeat's LoRA statistics (its `host_slots` come after registration: the role's host tier may change)."""
        if stats.host_slots != inst.lora.host_slots:
            self._host_tier.pop(inst.role, None)
        inst.lora = stats

    def get(self, instance_id: str) -> Instance | None:
        return self.by_id.get(instance_id)

    def of_role(self, role: str) -> list[Instance]:
        """The role's instances sorted by id (cached: dispatch asks on every message)."""
        cached = self._by_role.get(role)
        if cached is None:
            cached = self._by_role[role] = sorted((i for i in self.by_id.values() if i.role == role), key=lambda i: i.id)
        return cached

    def alive(self) -> list[Instance]:
        return [i for i in self.by_id.values() if i.state != "dead"]
