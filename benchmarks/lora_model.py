"""A queueing model of the LoRA affinity benchmark: what p95 each load rule can reach, over many requests.

    python benchmarks/lora_model.py                 # 20,000 requests per case, ~1 min
    python benchmarks/lora_model.py --requests 5000
    python benchmarks/lora_model.py --host-slots 32 --restore-ms 50   # with a host-memory tier

This is not the system: it is a discrete-event model of `benchmarks/lora_affinity.py`'s setup, to tell what
the rules could reach at all, free of the 200-request runs' noise. 4 denoisers, capacity 4, 4 adapter slots
each; Poisson arrivals at 70% of the devices' capacity; 4 steps of 170 ms; encode 24 ms and decode 85 ms
added; 32 adapters drawn with Zipf 1.1; a load takes 800 ms beside the device's other work. A device runs a
request to its end, then the next one ready, drawn at random (as the role's lock hands it over), or (`--order
admitted`) the earliest admitted. Rules as disagg/orchestrator/scheduling/loras.py defines them: `off`; `on` (a free holder, else
wait up to a load's time for one); `cost` (the earliest expected finish, EVICTION_COST loads more where a load
evicts). Eviction: least recently used, or least used over the instance's latest 32 x slots acquires (`lfu`,
disagg/roles/extensions/loras.py). `--host-slots N`: an unloaded adapter waits in host memory (N per instance) and comes back in
`--restore-ms` instead of a load; `on`'s cold pick then prefers an instance keeping it there, and `cost` prices a
restore. It also prints the bound the issue's p95 target meets: the share of requests whose adapter is
not among the 16 most popular (16 slots cannot hold more), each of which costs at least a load plus its compute.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from disagg.launcher.bench.load import adapter_rng
from disagg.orchestrator.scheduling.loras import expected_finish, reload_s  # the cost rule's own formulas
from disagg.roles.extensions.loras import USE_WINDOW as WINDOW  # the role's window of uses

STEP_S, STEPS, LOAD_S, ENCODE_S, DECODE_S = 0.17, 4, 0.8, 0.024, 0.085
DENOISERS, CAPACITY, SLOTS, ADAPTERS, ZIPF = 4, 4, 4, 32, 1.1
HOST_SLOTS, RESTORE_S = 0, 0.05  # the host-memory tier (--host-slots, --restore-ms)


def zipf(n: int, s: float) -> list[float]:
    w = [1 / k**s for k in range(1, n + 1)]
    return [x / sum(w) for x in w]


def simulate(rule: str, evict: str, order: str, n: int, seed: int, adapters: bool = True) -> dict:
    rng = random.Random(seed)
    draw = adapter_rng(seed)  # the adapters' own stream, as disagg bench draws them: the same arrivals as without
    p = zipf(ADAPTERS, ZIPF)
    rate = 0.7 * DENOISERS / (STEPS * STEP_S)
    inst = [{"adm": {}, "held": collections.OrderedDict(), "pins": collections.Counter(), "uses": collections.Counter(),
             "recent": collections.deque(), "host": collections.OrderedDict(), "free_at": 0.0, "cur": None}
            for _ in range(DENOISERS)]
    reqs, done, queue, events, seq = {}, {}, collections.deque(), [], itertools.count()
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        heapq.heappush(events, (t + ENCODE_S, next(seq), "arrive", i, draw.choices(range(ADAPTERS), p)[0] if adapters else None))
    loads = hits = restores = 0

    def backlog(k):
        return sum(r["steps"] for r in inst[k]["adm"].values()) * STEP_S

    def holds(k, a):
        return a is None or a in inst[k]["held"]

    def in_host(k, a):
        return a in inst[k]["host"]

    def use(I, a):
        I["uses"][a] += 1
        I["recent"].append(a)
        if len(I["recent"]) > WINDOW * SLOTS:
            I["uses"][I["recent"].popleft()] -= 1

    def admit(k, r, now):
        nonlocal loads, hits, restores
        I, a = inst[k], r["a"]
        I["adm"][r["i"]], r["admitted"] = r, now
        r["ready"] = now
        if a is not None:
            if a in I["held"]:
                I["held"].move_to_end(a)
                hits += 1
                r["ready"] = max(now, I["held"][a])  # its load may still run
            else:
                took = LOAD_S
                if I["host"].pop(a, None) is not None:
                    restores, took = restores + 1, RESTORE_S
                else:
                    loads += 1
                if len(I["held"]) >= SLOTS:
                    free = [x for x in I["held"] if I["pins"][x] == 0]
                    rank = {x: j for j, x in enumerate(I["held"])}
                    victim = min(free, key=lambda x: (I["uses"][x], rank[x])) if evict == "lfu" else free[0]
                    del I["held"][victim]
                    if HOST_SLOTS:
                        I["host"][victim] = True
                        if len(I["host"]) > HOST_SLOTS:
                            I["host"].popitem(last=False)
                I["held"][a] = r["ready"] = now + took
            I["pins"][a] += 1
            use(I, a)
        heapq.heappush(events, (r["ready"], next(seq), "ready", k, None))
        run_next(k, now)

    def run_next(k, now):
        I = inst[k]
        if I["free_at"] > now + 1e-12:
            return
        ready = [r for r in I["adm"].values() if r["ready"] <= now + 1e-12]
        if not ready:
            return
        r = I["cur"] if I["cur"] in ready else (
            min(ready, key=lambda r: r["admitted"]) if order == "admitted" else rng.choice(ready))
        r["steps"] -= 1
        I["free_at"], I["cur"] = now + STEP_S, (r if r["steps"] else None)
        heapq.heappush(events, (now + STEP_S, next(seq), "step", k, r["i"]))

    def place(now):
        deferred = []
        while queue:
            r = reqs[queue[0]]
            a, free = r["a"], [k for k in range(DENOISERS) if len(inst[k]["adm"]) < CAPACITY]
            if not free:
                break
            if a is None or rule == "off":
                pick = min(free, key=lambda k: (len(inst[k]["adm"]), rng.random()))
            elif rule == "cost":
                def finish(k, a=a):
                    warm = holds(k, a)
                    return expected_finish(warm, backlog(k), STEPS * STEP_S, RESTORE_S if in_host(k, a) else LOAD_S,
                                           not warm and len(inst[k]["held"]) >= SLOTS,
                                           reload_s(LOAD_S, RESTORE_S, HOST_SLOTS,
                                                    len(inst[k]["host"]) >= HOST_SLOTS, not in_host(k, a)))
                pick = min(free, key=lambda k: (finish(k), not holds(k, a), len(inst[k]["adm"])))
            else:  # on
                warm = [k for k in free if holds(k, a)]
                if warm:
                    pick = min(warm, key=lambda k: len(inst[k]["adm"]))
                elif any(holds(k, a) for k in range(DENOISERS)) and now - r["arrived"] < (
                        RESTORE_S if any(in_host(k, a) for k in free) else LOAD_S):
                    deferred.append(queue.popleft())
                    if not r.get("retry"):
                        r["retry"] = True
                        heapq.heappush(events, (r["arrived"] + LOAD_S, next(seq), "retry", None, None))
                    continue
                else:
                    roomy = [k for k in free if in_host(k, a)] or [k for k in free if len(inst[k]["held"]) < SLOTS]
                    pick = min(roomy or free, key=lambda k: len(inst[k]["adm"]))
            queue.popleft()
            admit(pick, r, now)
        queue.extendleft(reversed(deferred))

    while events:
        now, _, kind, x, y = heapq.heappop(events)
        if kind == "arrive":
            reqs[x] = {"i": x, "a": y, "arrived": now, "steps": STEPS}
            queue.append(x)
            place(now)
        elif kind == "ready":
            run_next(x, now)
        elif kind == "retry":
            place(now)
        else:  # a step ended
            I = inst[x]
            r = I["adm"][y]
            if r["steps"] == 0:
                del I["adm"][y]
                if r["a"] is not None:
                    I["pins"][r["a"]] -= 1
                done[y] = now - r["arrived"] + ENCODE_S + DECODE_S
                place(now)
            run_next(x, now)
    lat = sorted(done[i] for i in range(n // 10, n))  # the first tenth warms the slots up
    return {"p50": lat[len(lat) // 2], "p95": lat[int(0.95 * len(lat))], "loads": loads, "restores": restores}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--order", choices=("random", "admitted"), default="random")
    ap.add_argument("--host-slots", type=int, default=0, help="adapters each instance keeps in host memory")
    ap.add_argument("--restore-ms", type=float, default=50.0, help="a restore from host memory")
    args = ap.parse_args()
    global HOST_SLOTS, RESTORE_S
    HOST_SLOTS, RESTORE_S = args.host_slots, args.restore_ms / 1000
    top = sum(sorted(zipf(ADAPTERS, ZIPF), reverse=True)[:DENOISERS * SLOTS])
    floor = ENCODE_S + LOAD_S + STEPS * STEP_S + DECODE_S
    base = simulate("off", "lru", args.order, args.requests, args.seed, adapters=False)
    print(f"no adapters: p50 {base['p50']:.3f} s, p95 {base['p95']:.3f} s; 1.2 x p95 = {1.2 * base['p95']:.3f} s")
    print(f"bound: {1 - top:.1%} of requests name an adapter outside the top {DENOISERS * SLOTS}; each costs >= "
          f"{floor:.3f} s ({floor / base['p95']:.2f} x the p95 without adapters)")
    cases = {}
    for rule in ("off", "on", "cost"):
        for evict in ("lru", "lfu"):
            cases[rule, evict] = simulate(rule, evict, args.order, args.requests, args.seed)
    print("| rule | eviction | cold loads | vs off (same eviction) | restores | device loads vs off | p50 s | p95 s "
          "| p95 vs no adapters |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (rule, evict), c in cases.items():
        off = cases["off", evict]
        print(f"| {rule} | {evict} | {c['loads']} | {c['loads'] / off['loads']:.2f} | {c['restores']} "
              f"| {(c['loads'] + c['restores']) / (off['loads'] + off['restores']):.2f} | {c['p50']:.3f} | {c['p95']:.3f} "
              f"| {c['p95'] / base['p95']:.2f} |")


if __name__ == "__main__":
    main()
