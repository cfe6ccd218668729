"""`disagg bench --trace FILE`: replay a JSON Lines trace open-loop and report SLO attainment and goodput.

One request per line, `t` seconds from the start (`--rate-scale X` divides every t by X: 2 sends twice as fast):

    {"t": 1.25, "width": 1024, "height": 1024, "num_inference_steps": 28, "num_frames": 33, "priority": 0, "slo_ms": 9000}

`num_frames`, `priority` and `slo_ms` are optional; lines carry no prompt. A line without `slo_ms` gets
`--slo-factor K` x its class's standalone latency, measured first on the idle deployment (one request of each
class at a time, the faster of two). A class is a line's size, frames and steps. A request meets its SLO when
it succeeds within its slo_ms; a refused or failed one misses it. Goodput: requests that met their SLO per
second of the run.
"""

from __future__ import annotations

import msgspec

from disagg.launcher.bench.load import failure_counts, percentiles
from disagg.transport.wire.messages import GenerationParams, MessageError, params_from_obj


class TraceError(ValueError):
    """A trace file that cannot be replayed: the message names the line and the field."""


class TraceLine(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    t: float
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    num_frames: int | None = None
    priority: int | None = None
    slo_ms: float | None = None


def load_trace(path: str) -> list[TraceLine]:
    lines = []
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc}") from None
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = msgspec.json.decode(raw, type=TraceLine)
        except msgspec.DecodeError as exc:
            raise TraceError(f"{path}:{n}: {exc}") from None
        if line.t < 0:
            raise TraceError(f"{path}:{n}: t must be >= 0")
        try:
            params(line, 0)  # the same checks as every request's
        except MessageError as exc:
            raise TraceError(f"{path}:{n}: {exc}") from None
        lines.append(line)
    if not lines:
        raise TraceError(f"{path}: no requests")
    return sorted(lines, key=lambda line: line.t)


def label(line: TraceLine) -> str:
    """A line's class: 1024x1024/28, or 832x480x33f/30 for a video (the model's default size: "default")."""
    size = f"{line.width}x{line.height}" if line.width and line.height else "default"
    frames = f"x{line.num_frames}f" if line.num_frames else ""
    return f"{size}{frames}/{line.num_inference_steps or 'default'}"


def params(line: TraceLine, k: int, slo_ms: float | None = None) -> GenerationParams:
    fields = {f: getattr(line, f) for f in ("width", "height", "num_inference_steps", "num_frames", "priority")
              if getattr(line, f) is not None}
    slo = line.slo_ms if line.slo_ms is not None else slo_ms
    return params_from_obj({"prompt": f"a benchmark prompt {k}", "seed": k, **fields,
                            **({"slo_ms": round(slo, 3)} if slo else {})})


def standalone(client, lines: list[TraceLine]) -> dict[str, float]:
    """Each class's latency alone on the idle deployment: the faster of two, one request at a time, without the
    line's deadline (a deadline tighter than the class can meet would refuse the measurement itself)."""
    first = {}
    for line in lines:
        first.setdefault(label(line), line)
    out = {}
    for name, line in first.items():
        alone = msgspec.structs.replace(line, slo_ms=None)
        runs = client.run_all([params(alone, 10_000_000 + i) for i in range(2)], concurrency=1)
        ok = [o.latency_s for o in runs if o.ok]
        if not ok:
            raise TraceError(f"class {name} fails alone: {runs[0].error}")
        out[name] = min(ok)
    return out


def run_trace(client, lines: list[TraceLine], rate_scale: float = 1.0, slo_factor: float = 2.0,
              alone: dict[str, float] | None = None) -> dict:
    """Replay the trace; `alone`: classes' standalone latencies measured before (else measured now)."""
    alone = alone or standalone(client, lines)
    reqs = [params(line, k, None if line.slo_ms is not None else 1000 * slo_factor * alone[label(line)])
            for k, line in enumerate(lines)]
    arrivals = [line.t / rate_scale for line in lines]
    t0 = arrivals[0]
    arrivals = [a - t0 for a in arrivals]
    outcomes = client.run_all(reqs, concurrency=len(reqs), arrivals=arrivals)
    duration = max(max(arrivals), max((a + o.latency_s for a, o in zip(arrivals, outcomes)), default=0.0))
    classes: dict[str, list] = {}
    for line, p, o in zip(lines, reqs, outcomes):
        met = o.ok and o.latency_s * 1000 <= p.slo_ms
        classes.setdefault(label(line), []).append((o, met))
    rows = []
    for name, items in [("all", [x for v in classes.values() for x in v]), *sorted(classes.items())]:
        lat = [o.latency_s for o, _ in items if o.ok]
        pct = percentiles(lat)
        rows.append({
            "class": name, "requests": len(items), "met": sum(m for _, m in items),
            "attainment": round(sum(m for _, m in items) / len(items), 4),
            "failed": sum(not o.ok for o, _ in items),
            "refused": sum(o.code is not None and o.code.value == "deadline_unmeetable" for o, _ in items),
            "p50_s": pct["p50"], "p99_s": pct["p99"], "max_s": round(max(lat), 6) if lat else 0.0,
            **({"standalone_s": round(alone[name], 6)} if name in alone else {}),
        })
    met = rows[0]["met"]
    return {
        "requests": len(reqs),
        "duration_s": round(duration, 6),
        "offered_rps": round(len(reqs) / max(arrivals[-1], 1e-9), 4),
        "goodput_rps": round(met / max(duration, 1e-9), 4),
        "attainment": rows[0]["attainment"],
        "slo_factor": slo_factor,
        "rate_scale": rate_scale,
        "classes": rows,
        "longest_s": rows[0]["max_s"],
        "errors": sorted({o.error for o in outcomes if not o.ok and o.error})[:5],
        #: every failure reason (its numbers written N: refusals of any figures are one) with its count
        "failures": failure_counts(outcomes),
    }


def trace_table(doc: dict):
    from rich.table import Table

    table = Table(title=(f"trace: {doc['requests']} requests, {doc['offered_rps']} req/s offered, goodput "
                         f"{doc['goodput_rps']} req/s, SLO attainment {doc['attainment']:.1%} "
                         f"(slo factor {doc['slo_factor']:g})"))
    for col in ("class", "requests", "attainment", "failed", "refused", "p50 s", "p99 s", "max s", "alone s"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for r in doc["classes"]:
        table.add_row(r["class"], str(r["requests"]), f"{r['attainment']:.1%}", str(r["failed"]), str(r["refused"]),
                      f"{r['p50_s']:.3f}", f"{r['p99_s']:.3f}", f"{r['max_s']:.3f}",
                      f"{r['standalone_s']:.3f}" if "standalone_s" in r else "")
    return table

