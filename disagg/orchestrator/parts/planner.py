"""The throughput model behind `rebalance` and `disagg plan`: how many requests per second a split of devices
between the roles serves, for a mix of requests and their measured stage times, and which split of a device
budget serves the most.

A role's instances each serve one request's worth of device time at a time (concurrent requests on one device
take turns on it; a batched forward counts each request's share). With `n` devices and `w` device-seconds per
request of the mix (the mean over its requests: sum of each request's stage seconds, plus its transfer seconds
spread over the slots that overlap them), a role serves n / w requests per second; the pipeline serves the
least of its roles'. A split is `{role: devices}`; devices of instances that cannot move (several ranks, no
launcher to restart them) still count, as `fixed`.
"""

from __future__ import annotations

import itertools
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


@dataclass
class Plan:
    """The current split, the best one, and what each considered split serves (req/s), best first."""

    current: dict[str, int]
    current_rps: float
    best: dict[str, int]
    best_rps: float
    considered: list[tuple[dict[str, int], float]] = field(default_factory=list)

    @property
    def gain(self) -> float:
        """The best split's throughput over the current one's, less 1 (inf when the current serves nothing)."""
        if self.current_rps <= 0:
            return float("inf") if self.best_rps > 0 else 0.0
        return self.best_rps / self.current_rps - 1

    def moves(self) -> list[tuple[str, str]]:
        """(from role, to role) for each device that changes role, fewest moves."""
        give = [r for r in ROLES for _ in range(max(self.current.get(r, 0) - self.best.get(r, 0), 0))]
        take = [r for r in ROLES for _ in range(max(self.best.get(r, 0) - self.current.get(r, 0), 0))]
        return list(zip(give, take))


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
