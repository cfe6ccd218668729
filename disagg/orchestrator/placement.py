"""The Router's placement of queued work: which instance takes the request at the head of each role's
queue, and the Run that tells it where its input is and how to hand its output on. A mixin of Router
(disagg/orchestrator/router.py): it works on the Router's queues, registry, policy and requests."""

from __future__ import annotations

import logging

import msgspec

from disagg.orchestrator.dispatch import AFFINITY_ROLES, pick_joining_batch
from disagg.orchestrator.loras import evicts, expected_finish, holds, in_host, note_assigned, reload_s
from disagg.orchestrator.outbox import Out, to_instance
from disagg.orchestrator.registry import Instance
from disagg.orchestrator.requests import ROLES, Request, next_stage
from disagg.settings.choices import LoraAffinity, Schedule, Transfer
from disagg.transport.averages import ewma
from disagg.transport.messages import Run
from disagg.transport.selection import choose_engine

log = logging.getLogger("disagg.orchestrator")

#: requests with adapters that wait for their holder at most at once per role (the queue behind them moves on)
MAX_DEFERRED = 256
#: the most prompts whose encoder the orchestrator remembers (conditioning_holders)
MAX_CONDITIONING_HOLDERS = 65536


class InlineCache(dict):
    """needs_inline's answers, and the consumers' kinds of pool they were computed from: cleared together."""

    def __init__(self):
        super().__init__()
        self.kinds: dict[str, dict] = {}

    def clear(self) -> None:
        super().clear()
        self.kinds.clear()


class Placement:
    """Methods of Router; see disagg/orchestrator/router.py for the state they use."""

    @property
    def affinity_rule(self) -> LoraAffinity | None:
        """The adapter-affinity load rule (disagg/orchestrator/loras.py), None when loras.affinity is off; under auto, cost
        where a denoiser keeps adapters in host memory, else on."""
        setting = self.config.loras.affinity
        if setting == LoraAffinity.AUTO:
            hosted = self.registry.host_tier("denoiser") or self.registry.host_tier("monolith")
            return LoraAffinity.COST if hosted else LoraAffinity.ON
        return None if setting == LoraAffinity.OFF else setting

    def dispatch_queued(self, now: float, out: list[Out]) -> None:
        for role in ROLES:
            queue = self.queues[role]
            if not queue:
                continue
            candidates = None
            #: requests with LoRA adapters that wait for a busy instance holding them (worth_waiting); the
            #: requests behind them are placed meanwhile, and they go back to the queue's front in order
            deferred: list[str] = []
            if self.config.schedule == Schedule.SLO:
                self.order_queue(role, now)  # priority, then least slack (disagg/orchestrator/slo.py)
            while queue:
                req = self.requests.get(queue[0])
                if req is None or req.state != "queued" or req.stage != role:  # (an ended one is not queued)
                    queue.popleft()  # ended or moved on while waiting
                    continue
                if candidates is None:
                    candidates = self.registry.of_role(role)
                producer = (self.registry.by_id.get(req.source.slot.instance_id)
                            if req.source is not None and self.config.host_aware else None)
                prefer = producer.host if producer is not None else None
                if req.slo_deadline is not None and self.slo_placed(req, role):  # where it gets the device soonest (disagg/orchestrator/slo.py)
                    inst = self.policy.pick(role, self.slo_pick(req, candidates, now), prefer,
                                            req.source.slot.nbytes if req.source is not None else 0)
                else:
                    cost = self.lora_cost(req, now) if req.params.loras and self.affinity_rule == LoraAffinity.COST else None
                    inst = pick_joining_batch(self.policy, role, candidates, req, self.requests, prefer,
                                              batching=self.registry.batching(role),
                                              affinity=self.affinity_rule if req.params.loras else None,
                                              rng=self.lora_rng, cost=cost)
                if inst is None:
                    break
                if role == "encoder":
                    inst = self.conditioning_holder(req, inst)
                if req.params.loras and self.worth_waiting(req, inst, candidates, now):
                    deferred.append(queue.popleft())
                    if len(deferred) >= MAX_DEFERRED:
                        break
                    continue
                queue.popleft()
                self.assign(req, inst, now, out)
            queue.extendleft(reversed(deferred))

    def slo_placed(self, req: Request, role: str) -> bool:
        """Placed by slo_pick: under schedule slo, a request with a deadline, where neither batching nor adapter
        affinity decides."""
        return (self.config.schedule == Schedule.SLO and req.slo_deadline is not None and not self.registry.batching(role)
                and not (req.params.loras and self.affinity_rule and role in AFFINITY_ROLES))

    def conditioning_holder(self, req: Request, inst: Instance) -> Instance:
        """The encoder that encoded this request's prompts last (its conditioning cache holds them, unless it
        evicted them since), when it has a free slot; else `inst`, the policy's pick: a repeat never waits."""
        key = req.conditioning_key
        holder_id = self.conditioning_holders.get(key) if key else None
        if holder_id is None or holder_id == inst.id:
            return inst
        holder = self.registry.get(holder_id)
        if holder is None or holder.role != "encoder" or holder.state != "ready" or holder.free_slots <= 0:
            return inst
        return holder

    def note_conditioning(self, req: Request, inst: Instance) -> None:
        """`inst` encoded `req`: a repeat of its prompts goes there while it has room (bounded, oldest out)."""
        key = req.conditioning_key
        if not key:
            return
        holders = self.conditioning_holders
        holders.pop(key, None)
        holders[key] = inst.id
        if len(holders) > MAX_CONDITIONING_HOLDERS:
            del holders[next(iter(holders))]

    def lora_cost(self, req: Request, now: float):
        """The `cost` rule's estimate (disagg/orchestrator/loras.py) for `req`: instance, warm -> seconds until it would
        finish there. Device times come from what the role measured (StagePredictor: each request the instance
        holds, less the steps its heartbeats say it did; the request's own; before any, what one request alone
        took it), a load from what the instance's loads took (its heartbeats), else from the role's loads as the
        requests' timings saw them; where the instance keeps the adapters in host memory, a restore (what its
        restores took; before its first, a load)."""
        names = [r.name for r in req.params.loras or ()]

        def cost(inst: Instance, warm: bool) -> float:
            fallback = inst.solo_s or inst.stage_s_avg
            own = self.predictor.predict(inst.role, req.params) or fallback
            held = 0.0
            for rid in inst.running:
                other = self.requests.get(rid)
                alone = (self.predictor.predict(inst.role, other.params) if other is not None else None) or fallback
                done, total = inst.steps.get(rid, (0, 0))
                held += alone * (1.0 - done / total if total else 1.0)
            load = inst.lora.load_s or self.lora_load_s.get(inst.role, 0.0)
            restore = inst.lora.restore_s or load
            kept = in_host(inst, names)
            reload = reload_s(load, restore, inst.lora.host_slots, len(inst.lora.host) >= inst.lora.host_slots, not kept)
            return expected_finish(warm, held, own, restore if kept else load, evicts(inst, names), reload)

        return cost

    def note_lora_load(self, role: str, seconds: float) -> None:
        self.lora_load_s[role] = ewma(self.lora_load_s.get(role), seconds)

    def worth_waiting(self, req: Request, inst: Instance, candidates: list[Instance], now: float) -> bool:
        """Affinity's patience: `inst` lacks some of the request's adapters, and an instance that holds them all
        is busy. Loading costs about what the role's loads took so far (their moving average), so the request
        waits for the holder that long at most, then takes the cold instance (and the adapter spreads); where
        `inst` keeps the adapters in host memory, as long as its restores take."""
        if not req.params.loras or self.affinity_rule in (None, LoraAffinity.COST) or inst.role not in AFFINITY_ROLES:
            return False
        names = [r.name for r in req.params.loras]
        if holds(inst, names):
            return False
        patience = self.lora_load_s.get(inst.role, 0.0)
        if in_host(inst, names):
            patience = min(patience, inst.lora.restore_s or patience)
        if now - req.marks.get(f"queued_{inst.role}", now) >= patience:
            return False
        return any(i.state == "ready" and holds(i, names) for i in candidates)

    def enqueue(self, req: Request, role: str, now: float, front: bool = False) -> None:
        req.stage, req.state, req.assigned = role, "queued", None
        mark = f"queued_{role}"
        fresh = mark not in req.marks
        req.marks[mark] = now
        # a retry already waited its turn once
        (self.queues[role].appendleft if front else self.queues[role].append)(req.id)
        if role in self.queue_order.known:  # is the queue still in urgency order (disagg/orchestrator/slo.py)
            self.note_enqueued(req, role, now, front, fresh)

    def assign(self, req: Request, inst: Instance, now: float, out: list[Out]) -> None:
        source, frames = None, []
        if req.source is not None:
            producer = self.registry.get(req.source.slot.instance_id)
            engine, warning = choose_engine(self.config.transfer, producer.pool, inst.pool)
            if engine == Transfer.INLINE and not req.source_frames:
                self.release_source(req, out)
                self.fail(req, f"no transfer engine can move tensors from {producer.id} to {inst.id}: {warning}", now, out)
                return
            if warning and (producer.id, inst.id) not in self._warned_pairs:
                self._warned_pairs.add((producer.id, inst.id))
                log.warning("%s", warning)
                self.warnings.append(warning)
            inst.engine = engine
            self.stats.transferred(producer, inst, engine, req.source.slot.nbytes)
            source = msgspec.structs.replace(req.source, engine=engine)
            frames = req.source_frames if engine == Transfer.INLINE else []
        if not inst.running:
            inst.progress_at = now  # an idle instance's progress clock starts with its work
        inst.alone = req.id if not inst.running else None  # a request that runs alone measures solo_s
        inst.free_slots -= 1
        inst.running[req.id] = req.attempt
        req.state, req.assigned = "running", inst.id
        req.mark(f"run_{inst.role}", now)
        req.span(f"queue_{inst.role}", f"queued_{inst.role}", f"run_{inst.role}")
        if req.params.loras and not req.lora_sources:  # resumed by a restarted orchestrator
            req.lora_sources = self.lora_catalog.resolve(req.params.loras)[0]
        if req.params.loras and inst.role in AFFINITY_ROLES:
            note_assigned(inst, [r.name for r in req.params.loras])
        run = Run(request_id=req.id, attempt=req.attempt, params=req.params_for(inst.role), source=source,
                  inline_output=self.needs_inline(inst), lora_sources=req.lora_sources,
                  stage_deadline_s=self.stage_deadline(req, inst.role, now) if req.slo_deadline is not None else None,
                  carry=req.cache_steps if inst.role == "decoder" else {})
        out.append(to_instance(inst.id, run, frames))

    def needs_inline(self, producer: Instance) -> bool:
        """Whether some ready consumer of `producer`'s output can only be reached inline. Cached per kind of
        pool (host, engines, device) on both ends, so a role of a thousand instances costs a few checks."""
        role = next_stage(producer.role)
        if role is None:
            return False
        key = (role, producer.pool.host_id, tuple(producer.pool.engines), producer.pool.device)
        cached = self._inline_cache.get(key)
        if cached is None:
            kinds = self._consumer_kinds.get(role)
            if kinds is None:
                kinds = self._consumer_kinds[role] = {
                    (c.pool.host_id, tuple(c.pool.engines), c.pool.device): c.pool
                    for c in self.registry.of_role(role) if c.state == "ready"}
            cached = any(choose_engine(self.config.transfer, producer.pool, pool)[0] == Transfer.INLINE
                         for pool in kinds.values())
            self._inline_cache[key] = cached
        return cached
