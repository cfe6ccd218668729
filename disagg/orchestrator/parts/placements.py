"""Placements, not only splits (issue 46): which roles each device hosts, for devices of several classes, and how
many requests per second each placement serves of a mix, under the devices' memory. Pure: `disagg plan` ranks the
candidates; `rebalance` can use the same model with the memory instances report.

A placement says, per device, the roles it hosts: one (a dedicated split), several (light roles sharing a
denoiser's device: they take turns on it), or "monolith" (a colocated replica, every stage in one process).

Throughput, as a fluid: a request needs `seconds[role]` of an H200's time in each role (its stage times at speed
1, a denoiser's share of full batches), `seconds / speed` on a device of another class. The dispatcher spreads
a role's work over its instances by their free slots, so in proportion to how fast each works, not knowing what
else its device runs: a device that hosts roles r works X x seconds[r] x speed / (the speed of all of r's devices)
for each, and a placement serves the largest X at which no device works more than all the time. For dedicated
devices that is the best any spreading can do; where light roles share a denoiser's device, that denoiser still
takes its full share of denoising, so the shared device bounds X (an optimal spreading would give it less; the
dispatcher does not: BENCHMARKS.md, Placements). A replica's device runs all three stages per request, and
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
#: a more complex kind of placement wins only when predicted to serve more than this much over a simpler one
#: (shared over split over replicas): about the model's error on shared devices (BENCHMARKS.md, Placements)
MARGIN = 0.05


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
    # each role's work spread over its devices in proportion to their speed: a device then works, per request
    # served, seconds[r] / (the speed of all r's devices) for each role r it hosts; the busiest bounds the rate
    speed = {r: sum(cls.speed for cls, h in zip(classes, placement.hosts) if r in h) for r in roles}
    if any(speed[r] <= 0 for r in roles):
        return 0.0  # a role with work and no device
    busiest = max(sum(seconds[r] / speed[r] for r in roles if r in h) for h in placement.hosts)
    return 1.0 / busiest if busiest > 0 else 0.0


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
    # the winner: the simplest kind within MARGIN of the best prediction (a shared device's roles lose time taking
    # turns, which the fluid model does not count: a placement only that much better on paper is not chosen)
    if scored and scored[0].rps > 0:
        close = [s for s in scored if s.rps >= (1 - MARGIN) * scored[0].rps]
        winner = min(close, key=lambda s: simpler[s.placement.kind])
        scored.remove(winner)
        scored.insert(0, winner)
    return scored
