"""Placement: which instance takes the request at the head of a role's queue. An ordered chain of steps (STEPS),
each a class built from the settings (a step the settings turn off is left out), ending in the dispatch policy
(disagg/orchestrator/scheduling/dispatch.py). A step may choose (return an instance), narrow the candidates for the steps after
it (`Placing.candidates`, `narrowed`), adjust what they chose, or have the request wait (DEFER: the requests behind
it are placed meanwhile). Steps are parts (disagg/orchestrator/parts/base.py): they hear the request events they learn
from. A new rule is a new step in STEPS; the Router does not change.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from disagg.common.averages import ewma
from disagg.orchestrator.parts.base import Part
from disagg.orchestrator.registry import Instance
from disagg.orchestrator.requests import NAMES, ROLES, Request
from disagg.orchestrator.scheduling.dispatch import AFFINITY_ROLES, _free
from disagg.orchestrator.scheduling.loras import evicts, expected_finish, holds, in_host, pick_by_affinity, reload_s
from disagg.settings.choices import LoraAffinity, Schedule
from disagg.transport.wire.params import lora_key

#: the most prompts whose encoder the orchestrator remembers (ConditioningAffinity)
MAX_CONDITIONING_HOLDERS = 65536

#: what a step returns to have the request wait in the queue (its place kept) while the ones behind it are placed
DEFER = object()


@dataclass(slots=True)
class Placing:
    """One request being placed."""

    req: Request
    role: str
    #: the instances to choose from (the role's, until a step narrows them)
    candidates: list[Instance]
    #: the role's instances (what a step that narrowed can still look at)
    role_instances: list[Instance]
    #: the host of the instance holding its input (the policy prefers it), and the input's bytes
    prefer: str | None
    nbytes: int
    now: float
    #: candidates were narrowed to a chosen few: the policy picks among them, not from its index of free ones
    narrowed: bool = False


class Step(Part):
    """A placement step; `place(p, next)` returns an instance, None (none can take it now) or DEFER, calling
    `next(p)` for the steps after it."""

    #: the roles whose placement it takes part in (None: every role)
    roles: tuple[str, ...] | None = None
    #: whether it takes part only for requests with LoRA adapters
    adapters_only = False

    def __init__(self, core, chain: "Placement"):
        self.core = core

    @classmethod
    def wanted(cls, config) -> bool:
        """Whether the settings call for this step."""
        return True

    def place(self, p: Placing, next):
        return next(p)


def affinity_rule(config, registry) -> LoraAffinity | None:
    """The adapter-affinity load rule (disagg/orchestrator/scheduling/loras.py), None when loras.affinity is off; under auto, cost
    where a denoiser keeps adapters in host memory, else on."""
    setting = config.loras.affinity
    if setting == LoraAffinity.AUTO:
        hosted = registry.host_tier("denoiser") or registry.host_tier("monolith")
        return LoraAffinity.COST if hosted else LoraAffinity.ON
    return None if setting == LoraAffinity.OFF else setting


class LoraLoads(Part):
    """role -> moving average of the seconds its adapter loads took, as the requests' reports tell them."""

    def __init__(self):
        self.load_s: dict[str, float] = {}

    def staged(self, inst, req, msg, now: float) -> None:
        if msg.lora_s:
            self.load_s[inst.role] = ewma(self.load_s.get(inst.role), msg.lora_s)

    done = staged


class LoraPatience(Step):
    """Affinity's patience: the instance chosen lacks some of the request's adapters, and an instance that holds
    them all is busy. Loading costs about what the role's loads took so far, so the request waits for the holder
    that long at most, then takes the cold instance (and the adapter spreads); where the chosen instance keeps the
    adapters in host memory, as long as its restores take. Not under the `cost` rule (it weighs waiting itself)."""

    roles = AFFINITY_ROLES
    adapters_only = True

    def __init__(self, core, chain):
        super().__init__(core, chain)
        self.loads = chain.lora_loads

    @classmethod
    def wanted(cls, config) -> bool:
        return config.loras.affinity not in (LoraAffinity.OFF, LoraAffinity.COST)

    def place(self, p: Placing, next):
        inst = next(p)
        if inst is None or inst is DEFER or not p.req.params.loras:
            return inst
        return DEFER if self.worth_waiting(p.req, inst, p.role_instances, p.now) else inst

    def worth_waiting(self, req: Request, inst: Instance, candidates: list[Instance], now: float) -> bool:
        if not req.params.loras or affinity_rule(self.core.config, self.core.registry) in (None, LoraAffinity.COST) \
                or inst.role not in AFFINITY_ROLES:
            return False
        names = [r.name for r in req.params.loras]
        if holds(inst, names):
            return False
        patience = self.loads.load_s.get(inst.role, 0.0)
        if in_host(inst, names):
            patience = min(patience, inst.lora.restore_s or patience)
        if now - req.marks.get(NAMES[inst.role].queued, now) >= patience:
            return False
        return any(i.state == "ready" and holds(i, names) for i in candidates)


class ConditioningAffinity(Step):
    """An encoder: the one that encoded this request's prompts last (its conditioning cache holds them, unless it
    evicted them since), when it has a free slot; else what the steps after chose: a repeat never waits."""

    roles = ("encoder",)

    def __init__(self, core, chain):
        super().__init__(core, chain)
        #: prompts' conditioning key -> the encoder that encoded them last (bounded, oldest out)
        self.holders: dict[int, str] = {}

    def place(self, p: Placing, next):
        inst = next(p)
        if p.role != "encoder" or inst is None or inst is DEFER:
            return inst
        key = p.req.conditioning_key
        holder_id = self.holders.get(key) if key else None
        if holder_id is None or holder_id == inst.id:
            return inst
        holder = self.core.registry.get(holder_id)
        if holder is None or holder.role != "encoder" or holder.state != "ready" or holder.free_slots <= 0:
            return inst
        return holder

    def staged(self, inst, req, msg, now: float) -> None:
        key = req.conditioning_key
        if inst.role != "encoder" or not key:
            return
        self.holders.pop(key, None)
        self.holders[key] = inst.id
        if len(self.holders) > MAX_CONDITIONING_HOLDERS:
            del self.holders[next(iter(self.holders))]


class SloPlacement(Step):
    """schedule slo, a request with a deadline, where neither batching nor adapter affinity decides: the instances
    where it should get the device soonest. An instance's requests step by urgency (disagg/roles/turns.py), so the
    request waits for what the more urgent ones it would join still need, and for one step of a less urgent one
    (the device is handed over at step boundaries). Ties are left to the dispatch policy."""

    @classmethod
    def wanted(cls, config) -> bool:
        return config.schedule.order == Schedule.SLO

    def place(self, p: Placing, next):
        if p.req.slo_deadline is not None and self.decides(p.req, p.role):
            p.candidates, p.narrowed = self.soonest(p.req, p.role, p.candidates, p.now), True
        return next(p)

    def decides(self, req: Request, role: str) -> bool:
        core = self.core
        return not core.registry.batching(role) and not (
            req.params.loras and affinity_rule(core.config, core.registry) and role in AFFINITY_ROLES)

    def soonest(self, req, role: str, candidates: list, now: float) -> list:
        """Of `candidates`, where `req` gets the device of `role` soonest (`role`: its stage, or the next one for
        an instance reserved ahead of it: disagg/orchestrator/forwards.py)."""
        deadlines, requests = self.core.deadlines, self.core.requests
        mine = deadlines.urgency(req, now)
        best, chosen = float("inf"), []
        for inst in candidates:
            if not inst.dispatchable:
                continue
            ahead, step = 0.0, 0.0
            for rid in inst.running:
                other = requests.get(rid)
                if other is None:
                    continue
                left = deadlines.stage_left(other, role, now)
                if deadlines.urgency(other, now) < mine:
                    ahead += left
                else:
                    steps = other.params.num_inference_steps or 1
                    step = max(step, min(left, (deadlines.predictor.predict(role, other.params) or 0.0) / steps))
            wait = ahead + step
            if wait < best - 1e-6:
                best, chosen = wait, [inst]
            elif wait <= best + 1e-6:
                chosen.append(inst)
        return chosen


class BatchJoin(Step):
    """Where denoisers batch (max_batch > 1), an instance whose running batch the request can join (or that runs
    nothing) comes first: a batch holds one shape and one set of LoRA adapters; others wait behind it."""

    roles = ("denoiser",)

    def place(self, p: Placing, next):
        if p.role != "denoiser" or p.narrowed or not self.core.registry.batching(p.role):
            return next(p)
        req, requests = p.req, self.core.requests
        key = (req.params.width, req.params.height, lora_key(req.params.loras))

        def joinable(inst: Instance) -> bool:
            keys = ((r.params.width, r.params.height, lora_key(r.params.loras))
                    for r in map(requests.get, inst.running) if r is not None)
            return all(k == key for k in keys)

        joining = Placing(req, p.role, [i for i in p.candidates if joinable(i)], p.role_instances, p.prefer,
                          p.nbytes, p.now, narrowed=True)
        inst = next(joining)
        return inst if inst is not None else next(p)


class LoraAffinityStep(Step):
    """A request with adapters, in a role whose instances hold them: the instances its affinity rule
    (loras.affinity; disagg/orchestrator/scheduling/loras.py) chooses, for the policy to pick from."""

    roles = AFFINITY_ROLES
    adapters_only = True

    def __init__(self, core, chain):
        super().__init__(core, chain)
        self.loads = chain.lora_loads
        self.rng = core.rng_for("loras")  # the two-choices rule's draws

    @classmethod
    def wanted(cls, config) -> bool:
        return config.loras.affinity != LoraAffinity.OFF

    def place(self, p: Placing, next):
        rule = affinity_rule(self.core.config, self.core.registry) if p.req.params.loras else None
        if not rule or p.role not in AFFINITY_ROLES:
            return next(p)
        names = [r.name for r in p.req.params.loras]
        pool = p.candidates if p.narrowed else _free(self.core.policy, p.role, p.candidates, True)
        cost = self.cost(p.req) if rule == LoraAffinity.COST else None
        chosen = pick_by_affinity([i for i in pool if i.dispatchable], names, rule, self.rng, cost)
        p.candidates, p.narrowed = (chosen or pool), True
        return next(p)

    def cost(self, req: Request):
        """The `cost` rule's estimate for `req`: instance, warm -> seconds until it would finish there. Device times
        come from what the role measured (StagePredictor: each request the instance holds, less the steps its
        heartbeats say it did; the request's own; before any, what one request alone took it), a load from what the
        instance's loads took (its heartbeats), else from the role's loads as the requests' timings saw them; where
        the instance keeps the adapters in host memory, a restore (what its restores took; before its first, a
        load)."""
        names = [r.name for r in req.params.loras or ()]
        predictor, requests, loads = self.core.deadlines.predictor, self.core.requests, self.loads.load_s

        def cost(inst: Instance, warm: bool) -> float:
            fallback = inst.solo_s or inst.stage_s_avg
            own = predictor.predict(inst.role, req.params) or fallback
            held = 0.0
            for rid in inst.running:
                other = requests.get(rid)
                alone = (predictor.predict(inst.role, other.params) if other is not None else None) or fallback
                done, total = inst.steps.get(rid, (0, 0))
                held += alone * (1.0 - done / total if total else 1.0)
            load = inst.lora.load_s or loads.get(inst.role, 0.0)
            restore = inst.lora.restore_s or load
            kept = in_host(inst, names)
            reload = reload_s(load, restore, inst.lora.host_slots, len(inst.lora.host) >= inst.lora.host_slots, not kept)
            return expected_finish(warm, held, own, restore if kept else load, evicts(inst, names), reload)

        return cost


#: the chain, outermost first: each step sees what the steps after it chose
STEPS = (LoraPatience, ConditioningAffinity, SloPlacement, BatchJoin, LoraAffinityStep)


class Placement:
    """The chain of the steps the settings call for, ending in the dispatch policy."""

    def __init__(self, core, policy, steps=STEPS):
        self.policy = policy
        self.lora_loads = LoraLoads()
        self.steps = [cls(core, self) for cls in steps if cls.wanted(core.config)]
        #: the parts that hear the Router's events
        self.parts = [self.lora_loads, *self.steps]
        #: role -> its chain for requests without adapters, and with: chain(p) -> the instance, None or DEFER
        #: (Router.dispatch_queued picks the chain)
        self.chains = {role: self._chain(role, False) for role in ROLES}
        self.adapter_chains = {role: self._chain(role, True) for role in ROLES}

    def _chain(self, role: str, adapters: bool):
        call = self._pick
        for step in reversed(self.steps):
            if (step.roles is None or role in step.roles) and (adapters or not step.adapters_only):
                call = functools.partial(step.place, next=call)
        return call

    def _pick(self, p: Placing):
        return self.policy.pick(p.role, p.candidates, p.prefer, p.nbytes, indexed=not p.narrowed)

    def step(self, cls):
        """The chain's step of that class (None: the settings leave it out)."""
        return next((s for s in self.steps if isinstance(s, cls)), None)
