"""Prometheus metrics (`GET /metrics`), prometheus-client with `disagg_` names.

The deployment's own state (requests by outcome from every client, queues, slots, instance states,
restarts) comes from the orchestrator's status at scrape time; latencies and stage times are
observed on the requests this gateway served."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)

from disagg.transport.wire.codes import CLIENT_FAULT, ErrorCode
from disagg.transport.wire.messages import SLACK_BUCKETS_S, STATES, StatusReport

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
PHASES = {"queue": "queue", "compute": "compute", "fetch": "transfer"}


class StatusCollector:
    """Turns the last StatusReport into gauges and counters."""

    def __init__(self):
        self.report: StatusReport | None = None

    def collect(self):
        r = self.report
        if r is None:
            return
        outcome = CounterMetricFamily("disagg_requests", "Requests ended since the orchestrator started, by outcome "
                                                          "(every client: CLI, bench, HTTP)", labels=["outcome"])
        outcome.add_metric(["completed"], r.requests.completed)
        outcome.add_metric(["failed"], r.requests.failed)
        outcome.add_metric(["invalid"], r.requests.invalid)
        yield outcome
        yield GaugeMetricFamily("disagg_requests_in_flight", "Requests accepted and not yet ended",
                                value=r.requests.in_flight)
        queue = GaugeMetricFamily("disagg_queue_depth", "Requests waiting for a free slot, per role", labels=["role"])
        for role, n in r.queues.items():
            queue.add_metric([role], n)
        yield queue
        free = GaugeMetricFamily("disagg_instance_free_slots", "Free compute slots", labels=["role", "instance"])
        total = GaugeMetricFamily("disagg_instance_slots", "Compute slots (capacity)", labels=["role", "instance"])
        state = GaugeMetricFamily("disagg_instance_state", "1 for the instance's current state",
                                  labels=["role", "instance", "state"])
        restarts = GaugeMetricFamily("disagg_instance_restarts", "Times the launcher restarted the instance",
                                     labels=["role", "instance"])
        busy = CounterMetricFamily("disagg_instance_busy_seconds", "Device seconds the instance spent computing",
                                   labels=["role", "instance"])
        for i in r.instances:
            labels = [i.role, i.id]
            free.add_metric(labels, i.free_slots)
            total.add_metric(labels, i.capacity)
            restarts.add_metric(labels, i.restarts)
            busy.add_metric(labels, i.busy_s)
            for s in STATES:
                state.add_metric(labels + [s], 1.0 if i.state == s else 0.0)
        yield from (free, total, state, restarts, busy)
        yield device_memory_metrics(r)
        unavailable = GaugeMetricFamily("disagg_transfer_engine_unavailable", "1 per live instance and transfer engine "
                                        "that applies to its pool but could not start there (a GPU pool Mooncake "
                                        "cannot register): its hand-offs that need it go inline through the "
                                        "orchestrator", labels=["role", "instance", "engine"])
        for i in r.instances:
            if i.state != "dead":
                for engine in sorted(i.unavailable_engines):
                    unavailable.add_metric([i.role, i.id, engine], 1.0)
        yield unavailable
        moved = CounterMetricFamily("disagg_transfer_bytes", "Bytes moved between stages since the orchestrator "
                                    "started", labels=["source", "target", "engine"])
        handoffs = CounterMetricFamily("disagg_transfers", "Stage handoffs since the orchestrator started",
                                       labels=["source", "target", "engine"])
        for t in r.transfers:
            moved.add_metric([t.source, t.target, t.engine], t.bytes)
            handoffs.add_metric([t.source, t.target, t.engine], t.count)
        yield moved
        yield handoffs
        stages = SummaryMetricFamily("disagg_stage_seconds", "Per-stage queue, compute and transfer time of every "
                                     "request since the orchestrator started", labels=["role", "phase"])
        for t in r.stage_times:
            stages.add_metric([t.role, PHASES.get(t.phase, t.phase)], t.count, t.sum_s)
        yield stages
        batch = CounterMetricFamily("disagg_batch_steps", "Denoising steps run per batch size (continuous batching)",
                                    labels=["role", "instance", "size"])
        for i in r.instances:
            for size, n in sorted(i.batch_steps.items()):
                batch.add_metric([i.role, i.id, str(size)], n)
        yield batch
        loads = CounterMetricFamily("disagg_lora_loads", "LoRA adapters the instance loaded (a request's adapter it "
                                    "did not hold)", labels=["role", "instance"])
        hits = CounterMetricFamily("disagg_lora_hits", "Requests' LoRA adapters the instance held already",
                                   labels=["role", "instance"])
        held = GaugeMetricFamily("disagg_lora_held", "LoRA adapters the instance holds now", labels=["role", "instance"])
        restores = CounterMetricFamily("disagg_lora_restores", "LoRA adapters the instance copied back from host "
                                       "memory (loras.host_slots) instead of loading them", labels=["role", "instance"])
        host = GaugeMetricFamily("disagg_lora_host_held", "LoRA adapters the instance keeps in host memory now",
                                 labels=["role", "instance"])
        for i in r.instances:
            lora = i.lora
            if lora.slots:
                loads.add_metric([i.role, i.id], lora.loads)
                hits.add_metric([i.role, i.id], lora.hits)
                held.add_metric([i.role, i.id], len(lora.held))
                restores.add_metric([i.role, i.id], lora.restores)
                host.add_metric([i.role, i.id], len(lora.host))
        yield from (loads, hits, held, restores, host)
        yield from conditioning_metrics(r)
        yield from slo_metrics(r)
        yield from rebalance_metrics(r)
        yield GaugeMetricFamily("disagg_orchestrator_restarts", "Times the orchestrator was restarted",
                                value=float(r.orchestrator.get("restarts", 0)))


#: the parts of an instance's device memory /metrics exports (MemoryStats fields)
MEMORY_KINDS = ("total", "free", "weights", "pool", "cache", "activation_peak")


def device_memory_metrics(r: StatusReport) -> GaugeMetricFamily:
    """Each live instance's device memory, by kind: its device's total and free bytes (every process on it, where
    known), and its own weights, transfer pool (on the device), caches and activations' peak."""
    g = GaugeMetricFamily("disagg_device_memory_bytes", "An instance's device memory: the device's total and free "
                          "bytes, and the instance's weights, pool, caches and activations' peak on it",
                          labels=["role", "instance", "device", "kind"])
    for i in r.instances:
        if i.state == "dead":
            continue
        for kind in MEMORY_KINDS:
            g.add_metric([i.role, i.id, i.memory.device, kind], getattr(i.memory, f"{kind}_bytes"))
    return g


def conditioning_metrics(r: StatusReport):
    """Encoders' conditioning caches: lookups, hits and bytes held per instance, and the hit rate over all of them."""
    lookups = CounterMetricFamily("disagg_conditioning_lookups", "Text requests an encoder looked up in its "
                                  "conditioning cache", labels=["instance"])
    hits = CounterMetricFamily("disagg_conditioning_hits", "Text requests an encoder took from its conditioning "
                               "cache, computing nothing", labels=["instance"])
    held = GaugeMetricFamily("disagg_conditioning_bytes", "Bytes an encoder's conditioning cache holds now (on its "
                             "device, at most conditioning_cache_mib)", labels=["instance"])
    encoders = [i for i in r.instances if i.role == "encoder"]
    for i in encoders:
        lookups.add_metric([i.id], i.conditioning.lookups)
        hits.add_metric([i.id], i.conditioning.hits)
        held.add_metric([i.id], i.conditioning.bytes)
    total = sum(i.conditioning.lookups for i in encoders)
    yield from (lookups, hits, held)
    yield GaugeMetricFamily("disagg_conditioning_hit_ratio", "Conditioning-cache hits over lookups, all encoders, "
                            "since they started", value=sum(i.conditioning.hits for i in encoders) / total if total else 0.0)


def slo_metrics(r: StatusReport):
    """Deadlines (a request's slo_ms): met and missed per priority, the slack at finish, each queue's least slack."""
    met = CounterMetricFamily("disagg_slo_met", "Requests with a deadline (slo_ms) that ended in time, per priority",
                              labels=["priority"])
    missed = CounterMetricFamily("disagg_slo_missed", "Requests with a deadline that ended late or failed, per "
                                 "priority", labels=["priority"])
    slack = HistogramMetricFamily("disagg_slo_slack_seconds", "Deadline minus finish time of requests with a "
                                  "deadline (negative: late), per priority", labels=["priority"])
    for c in r.slo:
        label = [str(c.priority)]
        met.add_metric(label, c.met)
        missed.add_metric(label, c.missed)
        buckets = [(f"{bound:g}", n) for bound, n in zip(SLACK_BUCKETS_S, c.buckets)] + [("+Inf", c.met + c.missed)]
        slack.add_metric(label, buckets, c.slack_s)
    least = GaugeMetricFamily("disagg_queue_least_slack_seconds", "The least slack of the requests with a deadline "
                              "waiting in a role's queue", labels=["role"])
    for role, seconds in r.queue_slack.items():
        least.add_metric([role], seconds)
    yield from (met, missed, slack, least)


def rebalance_metrics(r: StatusReport):
    """`rebalance`: devices per role now and recommended, the throughput predicted for each, the moves."""
    rb = r.rebalance
    if rb is None:
        return
    devices = GaugeMetricFamily("disagg_rebalance_devices", "Devices per role, in the current split and in the one "
                                "the throughput model recommends", labels=["split", "role"])
    rps = GaugeMetricFamily("disagg_rebalance_predicted_rps", "Requests per second the throughput model predicts "
                            "for the last window's mix, on the current and on the recommended split", labels=["split"])
    for which, split, rate in (("current", rb.current, rb.current_rps), ("recommended", rb.recommended, rb.recommended_rps)):
        if not split:
            continue
        for role, n in zip(("encoder", "denoiser", "decoder"), split.split(":")):
            devices.add_metric([which, role], float(n))
        if rb.recommended:
            rps.add_metric([which], rate)
    yield from (devices, rps)
    yield CounterMetricFamily("disagg_rebalance_moves", "Devices moved to another role (rebalance auto) since the "
                              "orchestrator started", value=rb.moves)
    yield GaugeMetricFamily("disagg_rebalance_moving", "Devices changing role now", value=len(rb.moving))


def outcome_label(outcome) -> str:
    """A request's `outcome` label, as the orchestrator counts it (disagg_requests_total): completed; invalid when
    the request was at fault (a 400: a size over the maximum, an unknown adapter); cancelled by someone else;
    else failed."""
    if outcome.ok:
        return "completed"
    if outcome.code in CLIENT_FAULT:
        return "invalid"
    return "cancelled" if outcome.code == ErrorCode.CANCELLED else "failed"


class Metrics:
    """The gateway's registry."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.status = StatusCollector()
        self.registry.register(self.status)
        self.http = Counter("disagg_gateway_http_requests", "HTTP requests the gateway answered",
                            ["route", "method", "code"], registry=self.registry)
        self.latency = Histogram("disagg_request_latency_seconds", "End-to-end latency of requests served over HTTP",
                                 ["outcome"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.stage = Histogram("disagg_http_stage_seconds", "Per-stage queue, compute and transfer time of requests "
                               "served over HTTP", ["role", "phase"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe(self, outcome: str, latency_s: float, timings: dict[str, float]) -> None:
        """One request answered over HTTP; `outcome`: outcome_label's."""
        self.latency.labels(outcome).observe(latency_s)
        for key, seconds in timings.items():
            phase, _, role = key.partition("_")
            if phase in PHASES and role:
                self.stage.labels(role, PHASES[phase]).observe(seconds)
