"""`disagg bench`: a load generator against a running deployment, and the numbers it reports.

Closed loop (`--concurrency C`: C requests always in flight) or open loop (`--request-rate R`:
Poisson arrivals). Per-stage times come from the timings every Result carries; utilization
from the busy seconds each instance reports in `status`, before and after the run.
"""

from __future__ import annotations

import collections
import random
import statistics
import time

from client import Client, Outcome
from transport.messages import GenerationParams, StatusReport

ROLES = ("encoder", "denoiser", "decoder")


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


def run_load(
    client: Client,
    workload: list[GenerationParams],
    num_requests: int,
    concurrency: int | None = None,
    request_rate: float | None = None,
    warmup: int = 3,
    slo_factor: float = 2.0,
    seed: int = 0,
) -> dict:
    """Warm up (one at a time: the unloaded latency), then run the measured load; return the report."""
    rng = random.Random(seed)
    reqs = [workload[k % len(workload)] for k in range(num_requests)]
    warm = client.run_all([workload[k % len(workload)] for k in range(max(warmup, 1))], concurrency=1)
    unloaded = statistics.median([o.latency_s for o in warm if o.ok] or [0.0])
    before = client.status()
    arrivals = None
    if request_rate:
        t, arrivals = 0.0, []
        for _ in reqs:
            arrivals.append(t)
            t += rng.expovariate(request_rate)
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
        "failures": [{"reason": why, "count": n}
                     for why, n in collections.Counter(o.error for o in outcomes if not o.ok).most_common()],
        "duration_s": round(duration, 6),
        "throughput_rps": round(len(ok) / duration, 3) if duration > 0 else 0.0,
        "latency_s": percentiles(latencies),
        "unloaded_latency_s": round(unloaded, 6),
        "slo_factor": slo_factor,
        "slo_attainment": round(sum(lat <= slo for lat in latencies) / max(len(outcomes), 1), 4),
        "stages": stage_means(ok),
        "instances": utilization(before, after, duration),
        "mode": {"concurrency": concurrency} if not request_rate else {"request_rate": request_rate},
    }
