"""The throughput model behind `rebalance` and `disagg plan`: how many requests per second a split of devices
between the roles serves, for a mix of requests and their measured stage times, and which split of a device
budget serves the most.

A role's instances each serve one request's worth of device time at a time (concurrent requests on one device
take turns on it; a batched forward counts each request's share). With `n` devices and `w` device-seconds per
request of the mix (the mean over its requests: sum of each request's stage seconds, plus its transfer seconds
spread over the slots that overlap them), a role serves n / w requests per second; the pipeline serves the
least of its roles'. A split is `{role: devices}`; devices of instances that cannot move (several ranks, no
launcher to restart them) still count, as `fixed`.

Devices of several classes (an H200 beside L40Ss: their instances' heartbeats name their device) are planned by
class (`plan_by_class`): a split is then `{class: {role: devices}}`, `w` is in H200-seconds, and a role serves the
speed of its devices over `w` (disagg/settings/devices.py: an H200 is 1), which is the fluid model of `disagg plan`
(disagg/orchestrator/parts/placements.py) for dedicated devices. A device then moves within its class, and two
moves can swap the roles of two classes' devices with the counts per role unchanged.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

ROLES = ("encoder", "denoiser", "decoder")


def fmt(split: dict[str, int]) -> str:
    """A split as E:D:K."""
    return ":".join(str(split.get(r, 0)) for r in ROLES)


@dataclass
class Work:
    """Device-seconds per request of the mix, per role; `requests` is how many requests the mean is over."""

    seconds: dict[str, float]
    requests: int = 0

    @classmethod
    def of(cls, requests, predict, transfer_s=None, slots=None) -> Work:
        """The mean over `requests` ((request, how many such) pairs) of `predict(role, request)` (seconds, or None
        where nothing is known yet: the role's other requests' mean stands in), plus `transfer_s[role]` seconds
        per request spread over `slots[role]` slots."""
        total = {r: 0.0 for r in ROLES}
        known = {r: 0 for r in ROLES}
        n = 0
        for req, count in requests:
            n += count
            for role in ROLES:
                s = predict(role, req)
                if s is not None:
                    total[role] += s * count
                    known[role] += count
        seconds = {}
        for role in ROLES:
            mean = total[role] / known[role] if known[role] else 0.0
            extra = (transfer_s or {}).get(role, 0.0) / max((slots or {}).get(role, 1), 1)
            seconds[role] = mean + extra
        return cls(seconds=seconds, requests=n)

    @property
    def known(self) -> bool:
        """Every role's time is measured (a role with none measured cannot be planned for)."""
        return self.requests > 0 and all(self.seconds.get(r, 0.0) > 0 for r in ROLES)


def throughput(split: dict[str, int], work: Work) -> float:
    """Requests per second `split` serves of the mix: its slowest role's (0 when a role with work has no device)."""
    rates = []
    for role in ROLES:
        w = work.seconds.get(role, 0.0)
        if w <= 0:
            continue
        rates.append(split.get(role, 0) / w)
    return min(rates) if rates else 0.0


#: budgets up to this are searched whole; larger ones near the split proportional to each role's work
SEARCH_ALL = 64
NEAR = 4


def splits(budget: int, min_per_role: int = 1, fixed: dict[str, int] | None = None, near: dict[str, int] | None = None):
    """Every split of `budget` movable devices over the roles, each role with at least `min_per_role` devices
    (its fixed ones included), as {role: devices} with the fixed devices added; with `near`, only those within
    NEAR devices of it per role."""
    fixed = fixed or {}
    if near is None:
        es = ds = range(budget + 1)
    else:
        es = range(max(near["encoder"] - NEAR, 0), min(near["encoder"] + NEAR, budget) + 1)
        ds = range(max(near["denoiser"] - NEAR, 0), min(near["denoiser"] + NEAR, budget) + 1)
    for e, d in itertools.product(es, ds):
        k = budget - e - d
        if k < 0:
            continue
        split = {"encoder": e + fixed.get("encoder", 0), "denoiser": d + fixed.get("denoiser", 0),
                 "decoder": k + fixed.get("decoder", 0)}
        if all(split[r] >= min_per_role for r in ROLES):
            yield split


def moves_between(current: dict[str, int], best: dict[str, int]) -> list[tuple[str, str]]:
    """(from role, to role) for each device that changes role from split `current` to `best`, fewest moves."""
    give = [r for r in ROLES for _ in range(max(current.get(r, 0) - best.get(r, 0), 0))]
    take = [r for r in ROLES for _ in range(max(best.get(r, 0) - current.get(r, 0), 0))]
    return list(zip(give, take))


@dataclass
class Plan:
    """The current split, the best one, and what each considered split serves (req/s), best first."""

    current: dict[str, int]
    current_rps: float
    best: dict[str, int]
    best_rps: float
    considered: list[tuple[dict[str, int], float]] = field(default_factory=list)
    #: planned by class (plan_by_class): the current and the best split per device class ({} otherwise)
    current_classes: dict[str, dict[str, int]] = field(default_factory=dict)
    best_classes: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def gain(self) -> float:
        """The best split's throughput over the current one's, less 1 (inf when the current serves nothing)."""
        if self.current_rps <= 0:
            return float("inf") if self.best_rps > 0 else 0.0
        return self.best_rps / self.current_rps - 1

    def moves(self) -> list[tuple[str, str]]:
        """(from role, to role) for each device that changes role, fewest moves."""
        return moves_between(self.current, self.best)

    def class_moves(self) -> list[tuple[str, str, str]]:
        """(from role, to role, device class) for each device that changes role, fewest moves in each class ("":
        not planned by class)."""
        if not self.best_classes:
            return [(a, b, "") for a, b in self.moves()]
        out = []
        for cls, best in self.best_classes.items():
            out += [(a, b, cls) for a, b in moves_between(self.current_classes.get(cls, {}), best)]
        return out

    def lacking(self, cls: str = "") -> str | None:
        """The role the plan wants most devices more of (in class `cls` where planned by class), if any."""
        now, best = self.current, self.best
        if self.best_classes and cls in self.best_classes:
            now, best = self.current_classes.get(cls, {}), self.best_classes[cls]
        short = {r: best.get(r, 0) - now.get(r, 0) for r in ROLES}
        role = max(ROLES, key=lambda r: short[r])
        return role if short[role] > 0 else None


def plan(work: Work, current: dict[str, int], min_per_role: int = 1, fixed: dict[str, int] | None = None) -> Plan:
    """The split of the current split's movable devices that serves the most of `work`'s mix. Of splits serving
    equally much, the one fewest moves away wins (then the one with the most denoisers: the stage that bounds most
    mixes)."""
    fixed = fixed or {}
    budget = sum(current.values()) - sum(fixed.values())
    now = throughput(current, work)

    def distance(split):
        return sum(abs(split[r] - current.get(r, 0)) for r in ROLES)

    near = None
    if budget > SEARCH_ALL:  # the best split of a large budget lies near the one proportional to the work
        total = sum(work.seconds.get(r, 0.0) for r in ROLES) or 1.0
        near = {r: round(budget * work.seconds.get(r, 0.0) / total) for r in ROLES}
    considered = [(s, throughput(s, work)) for s in splits(budget, min_per_role, fixed, near)]
    if not considered:
        return Plan(current=dict(current), current_rps=now, best=dict(current), best_rps=now)
    considered.sort(key=lambda sr: (-round(sr[1], 9), distance(sr[0]), -sr[0]["denoiser"]))
    best, rps = considered[0]
    return Plan(current=dict(current), current_rps=now, best=best, best_rps=rps, considered=considered)


def fmt_classes(split: dict[str, dict[str, int]]) -> str:
    """A split by class as `H200 1:3:0, L40S 1:1:2` ("" when not by class)."""
    return ", ".join(f"{cls} {fmt(roles)}" for cls, roles in sorted(split.items()))


def class_throughput(split: dict[str, dict[str, int]], speeds: dict[str, float], work: Work) -> float:
    """Requests per second a split by device class serves of the mix (`work` in H200-seconds): each role serves the
    speed of its devices over its seconds per request; the slowest role bounds (0 when a role with work has no
    device)."""
    rates = []
    for role in ROLES:
        w = work.seconds.get(role, 0.0)
        if w <= 0:
            continue
        rates.append(sum(roles.get(role, 0) * speeds[cls] for cls, roles in split.items()) / w)
    return min(rates) if rates else 0.0


#: past this many splits by class in all, each class's splits are searched only near its current one
SEARCH_ALL_CLASSES = 20_000


def plan_by_class(work: Work, current: dict[str, dict[str, int]], speeds: dict[str, float], min_per_role: int = 1,
                  fixed: dict[str, dict[str, int]] | None = None) -> Plan:
    """`plan` for devices of several classes: the split of each class's movable devices that serves the most of
    `work`'s mix (in H200-seconds), each role with at least `min_per_role` devices over all classes. Of splits serving
    equally much, the fewest moves away wins (then the most denoising speed)."""
    fixed = fixed or {}
    classes = sorted(current)

    def total(split):
        return {r: sum(split[c].get(r, 0) for c in split) for r in ROLES}

    def distance(split):
        return sum(abs(split[c][r] - current[c].get(r, 0)) for c in classes for r in ROLES)

    options = []
    for cls in classes:
        budget = sum(current[cls].values()) - sum(fixed.get(cls, {}).values())
        options.append(list(splits(budget, 0, fixed.get(cls))))
    if math.prod(len(o) for o in options) > SEARCH_ALL_CLASSES:  # near each class's current split
        options = [[s for s in o if all(abs(s[r] - current[c].get(r, 0)) <= NEAR for r in ROLES)]
                   for c, o in zip(classes, options)]
    now = class_throughput(current, speeds, work)
    considered = []
    for choice in itertools.product(*options):
        split = dict(zip(classes, choice))
        if all(n >= min_per_role for n in total(split).values()):
            considered.append((split, class_throughput(split, speeds, work)))
    base = Plan(current=total(current), current_rps=now, best=total(current), best_rps=now,
                current_classes={c: dict(current[c]) for c in classes}, best_classes={c: dict(current[c]) for c in classes})
    if not considered:
        return base
    considered.sort(key=lambda sr: (-round(sr[1], 9), distance(sr[0]),
                                    -sum(sr[0][c]["denoiser"] * speeds[c] for c in classes)))
    best, rps = considered[0]
    base.best, base.best_rps, base.best_classes = total(best), rps, best
    # what status lists: the best splits, as totals with their classes
    base.considered = [(total(s), r) for s, r in considered]
    return base
