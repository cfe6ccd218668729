"""One urgency order for requests that compete for something: the requests waiting in a role's queue for an
instance (the orchestrator, `schedule: slo`) and the requests one instance holds, for its device at each step
boundary (the roles, disagg/roles/turns.py and the batcher).

Most urgent first:

1. the higher effective priority: the request's priority plus one for every `aging_s` it has waited (none
   starves);
2. within one effective priority, those that can still meet their deadline;
3. then those without a deadline, by arrival;
4. then those that will miss their deadline anyway, least slack first (deadline - now - time still needed).

Only step 2 depends on what the requests share. In a queue that feeds several instances, each request is judged
alone, least slack first (`key`). On one device the requests run back to back: earliest deadline first, and where
one would miss, the longest so far is set aside into step 4 (Moore-Hodgson: the most deadlines met on one device;
`order`).
"""

from __future__ import annotations

import math


def effective_priority(priority: int | None, waited_s: float, aging_s: float) -> int:
    """A request's priority plus one per `aging_s` it has waited."""
    return (priority or 0) + int(waited_s // aging_s)


def key(priority: int | None, waited_s: float, aging_s: float, slack_s: float = math.inf, arrival: float = 0.0) -> tuple:
    """A request's place in a queue that feeds several instances: sort ascending (`slack_s` infinite: no deadline)."""
    return (-effective_priority(priority, waited_s, aging_s), slack_s < 0, slack_s, arrival)


def order(items: list, now: float, aging_s: float, ticket_of=lambda t: t, left_s=None) -> list:
    """`items`, requests sharing one device, most urgent first. `ticket_of(item)`: what it is known by, with
    `priority`, `deadline` (None: none), `waiting_since` (None: not waiting) and `seq` (arrival), or None (no
    priority, no deadline); `left_s(item)`: the seconds it still needs on the device."""
    groups: dict[int, list] = {}
    for item in items:  # (item, its ticket, its time left), each looked up once
        t = ticket_of(item)
        waited = now - t.waiting_since if t is not None and t.waiting_since is not None else 0.0
        level = effective_priority(t.priority if t is not None else 0, waited, aging_s)
        groups.setdefault(-level, []).append((item, t, left_s(item)))
    ranked, clock = [], now
    for _, group in sorted(groups.items(), key=lambda kv: kv[0]):
        timed = sorted((e for e in group if e[1] is not None and e[1].deadline is not None),
                       key=lambda e: (e[1].deadline, e[1].seq))
        untimed = sorted((e for e in group if e[1] is None or e[1].deadline is None),
                         key=lambda e: e[1].seq if e[1] is not None else 0)
        kept, late, at = [], [], clock
        for e in timed:
            kept.append(e)
            at += e[2]
            if at > e[1].deadline:  # one misses: set the longest so far aside
                longest = max(kept, key=lambda k: k[2])
                kept.remove(longest)
                late.append(longest)
                at -= longest[2]
        late.sort(key=lambda e: (e[1].deadline - now - e[2], e[1].seq))
        ranked += [e[0] for e in kept + untimed + late]
        clock += sum(e[2] for e in group)
    return ranked
