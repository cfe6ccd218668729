"""`disagg bench`: a load generator against a running deployment, and the numbers it reports.

Closed loop (`--concurrency C`: C requests always in flight) or open loop (`--request-rate R`:
Poisson arrivals). Per-stage times come from the timings every Result carries; utilization
from the busy seconds each instance reports in `status`, before and after the run.
"""

from __future__ import annotations

import random
import re
import statistics
import time

import msgspec

from disagg.client import Client, Outcome
from disagg.transport.wire.messages import GenerationParams, LoraRef, StatusReport

ROLES = ("encoder", "denoiser", "decoder")
#: a number in a failure's reason (grouped as N)
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def failure_counts(outcomes) -> list[dict]:
    """The failed outcomes grouped by reason, most common first: `reason` is the error with its numbers written
    N (a refusal's "slo_ms 400 is less than the 4851 ms ..." is one reason whatever its figures), `code` its
    error code, `example` the first error as it was (and `reason` too when every error of the group reads alike)."""
    groups: dict[tuple, list] = {}
    for o in outcomes:
        if not o.ok:
            error = o.error or "failed"
            key = (NUMBER.sub("N", error), o.code.value if o.code is not None else None)
            group = groups.setdefault(key, [error, 0, True])
            group[1] += 1
            group[2] = group[2] and error == group[0]
    # a reason said alike every time keeps its figures
    return [{"reason": example if same else reason, "code": code, "count": n, "example": example}
            for (reason, code), (example, n, same) in sorted(groups.items(), key=lambda kv: -kv[1][1])]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

    return {"mean": round(statistics.fmean(ordered), 6), "p50": round(pick(0.5), 6),
            "p95": round(pick(0.95), 6), "p99": round(pick(0.99), 6)}


def stage_means(outcomes: list[Outcome]) -> dict[str, dict[str, float]]:
    out = {}
    for role in ROLES:
        def mean(key: str) -> float:
            vals = [o.timings[key] for o in outcomes if key in o.timings]
            return round(statistics.fmean(vals), 6) if vals else 0.0

        out[role] = {"queue_s_mean": mean(f"queue_{role}"), "compute_s_mean": mean(f"compute_{role}"),
                     "transfer_s_mean": mean(f"fetch_{role}")}
    return out


def utilization(before: StatusReport, after: StatusReport, duration_s: float) -> list[dict]:
    busy0 = {i.id: i.busy_s for i in before.instances}
    return [
        {"id": i.id, "role": i.role, "utilization": round((i.busy_s - busy0.get(i.id, 0.0)) / max(duration_s, 1e-9), 4)}
        for i in after.instances
    ]


#: the adapters `--loras N` draws from: sim-lora-0 ... sim-lora-(N-1) (a sim model takes any name)
LORA_PREFIX = "sim-lora-"
#: the roles whose instances apply adapters in their model (disagg/orchestrator/scheduling/dispatch.py AFFINITY_ROLES)
LORA_ROLES = ("denoiser", "monolith")


def zipf_names(n: int, s: float, count: int, rng: random.Random) -> list[str]:
    """`count` adapter names drawn from `n` with Zipf(s): name k (0-based) with weight 1 / (k + 1)^s."""
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return [f"{LORA_PREFIX}{k}" for k in rng.choices(range(n), weights=weights, k=count)]


def adapter_rng(seed: int) -> random.Random:
    """The adapters' own random stream: drawing them leaves the arrivals (poisson_arrivals) as they are, so a run
    with `--loras` meets the same arrival times as the same seed's run without (BENCHMARKS.md, LoRA affinity)."""
    return random.Random(f"{seed}:loras")


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """An open loop's send times (seconds from the start): Poisson at `rate`, the same for a seed whatever else
    the run draws."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def lora_report(before: StatusReport, after: StatusReport) -> dict:
    """Adapter loads and hits on the instances that apply them, and each one's share of the requests, between
    two status reports: cold_loads, restores (adapters copied back from host memory: loras.host_slots), hits,
    hit_rate (hits / all three), max_share (the busiest instance's requests / the mean)."""
    start = {i.id: i for i in before.instances}
    loads = hits = restores = 0
    served = {}
    for i in after.instances:
        if i.role not in LORA_ROLES:
            continue
        b = start.get(i.id)
        loads += i.lora.loads - (b.lora.loads if b else 0)
        hits += i.lora.hits - (b.lora.hits if b else 0)
        restores += i.lora.restores - (b.lora.restores if b else 0)
        served[i.id] = i.completed - (b.completed if b else 0)
    mean = statistics.fmean(served.values()) if served else 0.0
    return {"cold_loads": loads, "restores": restores, "hits": hits, "hit_rate": round(hits / max(loads + restores + hits, 1), 4),
            "max_share": round(max(served.values()) / mean, 4) if mean else 0.0, "served": served}


def run_load(
    client: Client,
    workload: list[GenerationParams],
    num_requests: int,
    concurrency: int | None = None,
    request_rate: float | None = None,
    warmup: int = 3,
    slo_factor: float = 2.0,
    seed: int = 0,
    loras: int = 0,
    lora_zipf: float = 1.1,
) -> dict:
    """Warm up (one at a time: the unloaded latency), then run the measured load; return the report. `loras`:
    each measured request applies one adapter, drawn with Zipf(`lora_zipf`) from that many names."""
    reqs = [workload[k % len(workload)] for k in range(num_requests)]
    if loras:
        reqs = [msgspec.structs.replace(p, loras=[LoraRef(name=name)])
                for p, name in zip(reqs, zipf_names(loras, lora_zipf, len(reqs), adapter_rng(seed)))]
    warm = client.run_all([workload[k % len(workload)] for k in range(max(warmup, 1))], concurrency=1)
    unloaded = statistics.median([o.latency_s for o in warm if o.ok] or [0.0])
    before = client.status()
    arrivals = poisson_arrivals(len(reqs), request_rate, seed) if request_rate else None
    t0 = time.monotonic()
    outcomes = client.run_all(reqs, concurrency=concurrency or 1, arrivals=arrivals)
    duration = time.monotonic() - t0
    after = client.status()
    ok = [o for o in outcomes if o.ok]
    latencies = [o.latency_s for o in ok]
    slo = slo_factor * unloaded
    return {
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        #: every distinct failure reason with its count, most common first
        "failures": failure_counts(outcomes),
        "duration_s": round(duration, 6),
        "throughput_rps": round(len(ok) / duration, 3) if duration > 0 else 0.0,
        "latency_s": percentiles(latencies),
        "unloaded_latency_s": round(unloaded, 6),
        "slo_factor": slo_factor,
        "slo_attainment": round(sum(lat <= slo for lat in latencies) / max(len(outcomes), 1), 4),
        "stages": stage_means(ok),
        "instances": utilization(before, after, duration),
        "mode": {"concurrency": concurrency} if not request_rate else {"request_rate": request_rate},
        **({"lora": {**lora_report(before, after), "adapters": loras, "zipf": lora_zipf}} if loras else {}),
    }
