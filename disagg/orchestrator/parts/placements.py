"""Placements, not only splits (issue 46): which roles each device hosts, for devices of several classes, and how
many requests per second each placement serves of a mix, under the devices' memory. Pure: `disagg plan` ranks the
candidates; `rebalance` can use the same model with the memory instances report.

A placement says, per device, the roles it hosts: one (a dedicated split), several (light roles sharing a
denoiser's device: they take turns on it), or "monolith" (a colocated replica, every stage in one process).

Throughput, as a fluid: a request needs `seconds[role]` of an H200's time in each role (its stage times at speed
1, a denoiser's share of full batches), `seconds / speed` on a device of another class. A placement serves X
requests per second when the roles' work, X x seconds[role] each, can be spread over the devices that host them
without any device working more than all the time: a transportation problem, decided by a max-flow from roles
to devices and solved for the largest X by bisection. A replica's device runs all three stages per request, and
where its memory cannot hold every component, streams the ones it cannot keep from host memory for every request
(their bytes over the device's host-to-device bandwidth).

Memory: the roles a device hosts hold their weights together, and the largest of their activations (they take
turns); a placement that does not fit is left out, except replicas, which offload.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

ROLES = ("encoder", "denoiser", "decoder")
MONOLITH = "monolith"


@dataclass(frozen=True)
class Placement:
    """Per device (by index), the roles it hosts."""

    kind: str  # "split", "shared", "replicas"
    hosts: tuple[tuple[str, ...], ...]

    def describe(self, classes) -> str:
        """E.g. `8xH200 denoiser + 1 shared encoder,decoder`: per class, how many devices host each role set."""
        groups: dict[tuple[str, tuple[str, ...]], int] = {}
        for cls, roles in zip(classes, self.hosts):
            groups[(cls.name, roles)] = groups.get((cls.name, roles), 0) + 1
        return ", ".join(f"{n}x{name} {'+'.join(roles) or 'idle'}" for (name, roles), n in groups.items())


@dataclass
class Scored:
    placement: Placement
    rps: float
    #: per device: bytes its roles hold at their peak, and what it streams per request (replicas that offload)
    memory: list[int] = field(default_factory=list)
    offload_s: list[float] = field(default_factory=list)
    why_not: str = ""


def device_need(profile, roles: tuple[str, ...], pixels: int, batch: int) -> int:
    """Bytes the roles on one device hold at their peak: their weights, and the largest of their activations."""
    if not roles:
        return 0
    weights = sum(profile.weights(r) for r in roles)
    return weights + max(profile.activations(r, pixels, batch if r in ("denoiser", MONOLITH) else 1) for r in roles)


def offload_bytes(profile, memory: int, pixels: int, batch: int) -> int:
    """Bytes a replica on a device of `memory` streams in per request: the components it cannot keep
    (the profile's `streamed`, the same rule the simulated replica follows)."""
    return sum(profile.streamed(memory, pixels, batch).values())


def _max_flow(capacity: dict[tuple[str, str], float], source: str, sink: str) -> float:
    """Edmonds-Karp over a small graph given as {(u, v): capacity}."""
    graph: dict[str, dict[str, float]] = {}
    for (u, v), c in capacity.items():
        graph.setdefault(u, {})[v] = graph.setdefault(u, {}).get(v, 0.0) + c
        graph.setdefault(v, {}).setdefault(u, 0.0)
    flow = 0.0
    while True:
        parent = {source: None}
        queue = [source]
        for u in queue:
            for v, c in graph[u].items():
                if c > 1e-12 and v not in parent:
                    parent[v] = u
                    queue.append(v)
        if sink not in parent:
            return flow
        push, v = float("inf"), sink
        while parent[v] is not None:
            push, v = min(push, graph[parent[v]][v]), parent[v]
        v = sink
        while parent[v] is not None:
            u = parent[v]
            graph[u][v] -= push
            graph[v][u] += push
            v = u
        flow += push


def fluid_rps(placement: Placement, classes, seconds: dict[str, float], offload_s: list[float] | None = None,
              replica_seconds: dict[str, float] | None = None) -> float:
    """Requests per second `placement` serves (the module's docstring). `seconds`: H200-seconds per request per
    role; `offload_s`: per device, seconds a replica there streams weights per request; `replica_seconds`: a
    replica's per role, where they differ (it does not batch)."""
    offload_s = offload_s or [0.0] * len(classes)
    if any(MONOLITH in h for h in placement.hosts):  # replicas: each device serves on its own
        total = sum((replica_seconds or seconds).get(r, 0.0) for r in ROLES)
        return sum(1.0 / (total / cls.speed + off) for cls, h, off in zip(classes, placement.hosts, offload_s)
                   if MONOLITH in h and total / cls.speed + off > 0)
    roles = [r for r in ROLES if seconds.get(r, 0.0) > 0]
    if any(not any(r in h for h in placement.hosts) for r in roles):
        return 0.0  # a role with work and no device

    def feasible(x: float) -> bool:
        cap = {("s", r): x * seconds[r] for r in roles}
        for d, (cls, h) in enumerate(zip(classes, placement.hosts)):
            for r in roles:
                if r in h:
                    cap[(r, f"d{d}")] = float("inf")
            cap[(f"d{d}", "t")] = cls.speed  # H200-seconds of work it does per second
        return _max_flow(cap, "s", "t") >= x * sum(seconds[r] for r in roles) * (1 - 1e-9)

    lo, hi = 0.0, sum(cls.speed for cls in classes) / min(seconds[r] for r in roles)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
    return lo


def candidates(classes) -> list[Placement]:
    """The placements `disagg plan` weighs on these devices: every dedicated split (per class, how many devices each
    role gets; each role at least one device overall), the light roles sharing devices (encoder and decoder
    together on the first 1, 2, ... devices of one class, beside a denoiser or not, every other device denoising),
    and replicas on every device."""
    n = len(classes)
    by_class: dict[str, list[int]] = {}
    for i, cls in enumerate(classes):
        by_class.setdefault(cls.name, []).append(i)
    out: list[Placement] = []
    per_class = []
    for name, idx in by_class.items():
        k = len(idx)
        per_class.append([(idx, e, d, k - e - d) for e in range(k + 1) for d in range(k + 1 - e)])
    for choice in itertools.product(*per_class):
        hosts: list[tuple[str, ...]] = [()] * n
        for idx, e, d, k in choice:
            roles = ["encoder"] * e + ["denoiser"] * d + ["decoder"] * k
            for i, r in zip(idx, roles):
                hosts[i] = (r,)
        if all(any(r in h for h in hosts) for r in ROLES):
            out.append(Placement("split", tuple(hosts)))
    for name, idx in by_class.items():
        for m in range(1, len(idx) + 1):
            # the light roles on the first m devices of this class: beside a denoiser there, or only each other
            for light in (("encoder", "denoiser", "decoder"), ("encoder", "decoder")):
                hosts = [("denoiser",)] * n
                for i in idx[:m]:
                    hosts[i] = light
                if light == ("encoder", "decoder") and m == len(idx) == n:
                    continue  # no denoiser left
                out.append(Placement("shared", tuple(hosts)))
    out.append(Placement("replicas", tuple((MONOLITH,) for _ in range(n))))
    return out


def rank(classes, profile, seconds: dict[str, float], pixels: int, batch: int = 1,
         replica_seconds: dict[str, float] | None = None) -> list[Scored]:
    """Every candidate with what it serves, best first; those that do not fit their devices' memory come last
    with rps 0 and the reason. `replica_seconds`: a replica's seconds per role, where they differ from `seconds`
    (a replica does not batch: its denoiser's are unbatched)."""
    scored = []
    for p in candidates(classes):
        memory = [device_need(profile, h, pixels, batch) if MONOLITH not in h else 0 for h in p.hosts]
        offload = [0.0] * len(classes)
        why = ""
        if p.kind == "replicas":
            for d, cls in enumerate(classes):
                # a replica runs one request at a time (colocated instances do not batch)
                streamed = offload_bytes(profile, cls.memory_bytes, pixels, 1)
                offload[d] = streamed / cls.host_to_device * profile.time_scale
                memory[d] = min(device_need(profile, (MONOLITH,), pixels, 1), cls.memory_bytes)
                if profile.activations(MONOLITH, pixels, 1) > cls.memory_bytes:
                    why = f"device {d} ({cls.name}) cannot hold a replica's activations"
        else:
            for d, (cls, need) in enumerate(zip(classes, memory)):
                if need > cls.memory_bytes:
                    why = f"device {d} ({cls.name}, {cls.memory_bytes / 1e9:.0f} GB) cannot hold {'+'.join(p.hosts[d])} " \
                          f"({need / 1e9:.1f} GB)"
                    break
        rps = 0.0 if why else fluid_rps(p, classes, seconds, offload, replica_seconds)
        scored.append(Scored(p, rps, memory, offload, why))
    # of placements serving as much (to a millionth), the simplest: replicas (one process a device, no hand-offs),
    # then dedicated splits, then shared devices; then the fewest instances
    simpler = {"replicas": 0, "split": 1, "shared": 2}
    scored.sort(key=lambda s: (-round(s.rps, 6), simpler[s.placement.kind], sum(len(h) for h in s.placement.hosts)))
    return scored
