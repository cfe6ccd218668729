"""Dispatch policies: which ready instance of a role gets the next request.

Under every policy, of two otherwise equally good instances the one on the producer's host wins
(`prefer_host`: the host of the instance holding the request's input), so fewer bytes cross the
network; `least-work` also counts a cross-host transfer's expected time."""

from __future__ import annotations

from typing import Protocol

from disagg.orchestrator.registry import Instance
from disagg.orchestrator.scheduling.loras import pick_by_affinity
from disagg.settings.choices import Dispatch
from disagg.transport.wire.params import lora_key

#: the roles whose instances hold a request's LoRA adapters in their model (encoders hold only the text
#: encoders' part, cheap to load: affinity does not pay there)
AFFINITY_ROLES = ("denoiser", "monolith")


#: what least-work assumes a cross-host pull moves per second until one is measured (10 Gb/s)
CROSS_HOST_BYTES_PER_S = 1.25e9


class DispatchPolicy(Protocol):
    #: the registry's FreeIndex (disagg/orchestrator/registry.py), when the router set it: then `indexed` picks
    #: look only at ready instances with a free slot instead of scanning the whole role
    index: object

    def pick(self, role: str, instances: list[Instance], prefer_host: str | None = None,
             nbytes: int = 0, indexed: bool = False) -> Instance | None: ...


def _free(policy, role: str, instances: list[Instance], indexed: bool) -> list[Instance]:
    """The instances worth looking at: with the index, the role's ready ones with a free slot (by id)."""
    index = getattr(policy, "index", None)
    if indexed and index is not None:
        return sorted(index.candidates(role), key=lambda i: i.id)
    return instances


class RoundRobin:
    """Next instance in turn, skipping full ones."""

    def __init__(self):
        self._cursor: dict[str, int] = {}
        self._last: dict[str, str] = {}
        self.index = None

    def pick(self, role: str, instances: list[Instance], prefer_host: str | None = None, nbytes: int = 0,
             indexed: bool = False):
        if indexed and self.index is not None:  # in id order, starting after the last one picked
            instances = _free(self, role, instances, indexed)
            last = self._last.get(role, "")
            start = next((k for k, i in enumerate(instances) if i.id > last), 0)
            instances = instances[start:] + instances[:start]
            self._cursor[role] = 0
            inst = self._scan(role, instances, prefer_host)
            if inst is not None:
                self._last[role] = inst.id
            return inst
        return self._scan(role, instances, prefer_host)

    def _scan(self, role: str, instances: list[Instance], prefer_host: str | None):
        n = len(instances)
        start = self._cursor.get(role, 0)
        first = None
        for k in range(n):
            inst = instances[(start + k) % n]
            if inst.dispatchable:
                if first is None:
                    first = k
                if prefer_host is None or inst.host == prefer_host:
                    self._cursor[role] = (start + k + 1) % n
                    return inst
        if first is None:
            return None
        self._cursor[role] = (start + first + 1) % n
        return instances[(start + first) % n]


class TieRotation:
    """Picks among equally good instances in turn, so they share the work."""

    def __init__(self):
        self._turn: dict[str, int] = {}
        self.index = None

    def rotate(self, role: str, tied: list[Instance], prefer_host: str | None = None) -> Instance:
        local = [i for i in tied if i.host == prefer_host] if prefer_host is not None else []
        tied = local or tied
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        return tied[turn % len(tied)]


class MaxFreeSlots(TieRotation):
    """The instance with the most free slots; ties rotate so equal instances share work."""

    def pick(self, role: str, instances: list[Instance], prefer_host: str | None = None, nbytes: int = 0,
             indexed: bool = False):
        if indexed and self.index is not None:
            return self._pick_indexed(role, prefer_host)
        ready = [i for i in instances if i.dispatchable]
        if not ready:
            return None
        most = max(i.free_slots for i in ready)
        return self.rotate(role, [i for i in ready if i.free_slots == most], prefer_host)

    def _pick_indexed(self, role: str, prefer_host: str | None):
        """The most free slots, the producer's host first among equals, equals in turn: from the buckets."""
        buckets = self.index.buckets.get(role)
        if not buckets:
            return None
        for free in sorted(buckets, reverse=True) if len(buckets) > 1 else buckets:
            hosts = buckets[free]
            preferred = hosts.get(prefer_host)
            for group in (preferred,) if preferred is not None else ():
                for inst in group.values():
                    if inst.pool_has_room():
                        self.index.rotate(inst)
                        return inst
            for host, group in hosts.items():
                if host == prefer_host:
                    continue
                for inst in group.values():
                    if inst.pool_has_room():
                        self.index.rotate(inst)  # changes `hosts`: the loop ends here
                        return inst
        return None


class LeastWork(TieRotation):
    """Earliest expected finish: (work it holds + this one) x its measured stage time / capacity.

    Instances without a measurement yet are tried first (their speed is unknown, and learning
    it is the only way to use them well); ties rotate.
    """

    def pick(self, role: str, instances: list[Instance], prefer_host: str | None = None, nbytes: int = 0,
             indexed: bool = False):
        ready = [i for i in _free(self, role, instances, indexed) if i.dispatchable]
        if not ready:
            return None

        def finish(i: Instance) -> float:
            remote = prefer_host is not None and i.host != prefer_host
            return (len(i.running) + 1) * i.stage_s_avg / i.capacity + (nbytes / CROSS_HOST_BYTES_PER_S if remote else 0.0)

        best = min(finish(i) for i in ready)
        return self.rotate(role, [i for i in ready if finish(i) <= best * 1.0001], prefer_host)


def pick_joining_batch(policy: DispatchPolicy, role: str, instances: list[Instance], req, requests: dict,
                       prefer_host: str | None = None, batching: bool | None = None, affinity: str | None = None,
                       rng=None, cost=None):
    """The policy's pick, but where denoisers batch (max_batch > 1) an instance whose running batch `req`
    can join (or that runs nothing) comes first: a batch holds one shape and one set of LoRA adapters, others
    wait behind it. With `affinity` (a load rule of disagg/orchestrator/scheduling/loras.py) an instance that holds the request's
    adapters comes first, within that rule (`cost`: the `cost` rule's estimate, instance, warm -> seconds).
    `requests`: request id -> request, to read what each instance runs."""
    nbytes = req.source.slot.nbytes if req.source is not None else 0
    if batching is None:
        batching = any(i.max_batch > 1 for i in instances)
    names = [r.name for r in req.params.loras] if affinity and req.params.loras and role in AFFINITY_ROLES else ()
    if role == "denoiser" and batching:
        key = (req.params.width, req.params.height, lora_key(req.params.loras))

        def joinable(inst: Instance) -> bool:
            keys = ((r.params.width, r.params.height, lora_key(r.params.loras))
                    for r in map(requests.get, inst.running) if r is not None)
            return all(k == key for k in keys)

        joining = [i for i in instances if joinable(i)]
        inst = _pick(policy, role, joining, names, affinity, prefer_host, nbytes, rng, cost)
        if inst is not None:
            return inst
    if names:
        return _pick(policy, role, _free(policy, role, instances, True), names, affinity, prefer_host, nbytes, rng,
                     cost)
    return policy.pick(role, instances, prefer_host, nbytes, indexed=True)


def _pick(policy, role, instances, names, affinity, prefer_host, nbytes, rng, cost=None):
    if names:
        chosen = pick_by_affinity([i for i in instances if i.dispatchable], names, affinity, rng, cost)
        if chosen:
            return policy.pick(role, chosen, prefer_host, nbytes)
    return policy.pick(role, instances, prefer_host, nbytes)


#: the `dispatch` setting -> its policy
POLICIES = {Dispatch.ROUND_ROBIN: RoundRobin, Dispatch.MAX_FREE_SLOTS: MaxFreeSlots, Dispatch.LEAST_WORK: LeastWork}


def make_policy(name: Dispatch) -> DispatchPolicy:
    try:
        return POLICIES[Dispatch(name)]()
    except ValueError:
        raise ValueError(f"unknown dispatch policy {name!r}; choose from {', '.join(POLICIES)}") from None
