"""The live table of every instance, and the plain one-line-per-event log used without it."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from disagg.transport.wire.messages import StatusReport

STATE_STYLE = {"ready": "green", "standby": "blue", "starting": "yellow", "draining": "cyan", "dead": "bold red"}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


#: the instance table's columns, most important first: a narrow terminal drops them from the end
#: (the id names the role already, so the role column goes early)
COLUMNS = (
    ("id", "left"), ("state", "left"), ("free/cap", "right"), ("in flight", "right"), ("done", "right"),
    ("failed", "right"), ("host", "left"), ("device", "left"), ("pid", "right"), ("restarts", "right"), ("engine", "left"),
    ("pool MiB used/total", "right"), ("memory GB", "right"), ("role", "left"), ("adapters", "left"),
)
#: what one column costs beside its text: Rich's padding and the border
COLUMN_EXTRA = 3


def _cells(i) -> dict[str, str]:
    return {
        # while starting, its boot's phase and bytes so far: "downloading 3.20 GB", "loading", "compiling"
        "role": i.role, "id": i.id, "pid": str(i.pid), "host": i.host,
        "state": boot_state(i) if i.state == "starting" and i.boot.phase else i.state,
        # an instance over several devices: each rank's device and the layout, e.g. "gpu0,gpu1 (ulysses 2)"; then
        # the GPUs it was given as its host numbers them and its device's name (or simulated class), where known:
        # "cuda:0 [GPU 3, NVIDIA H200]"
        "device": _device(i),
        "free/cap": f"{i.free_slots}/{i.capacity}", "in flight": str(i.in_flight), "done": str(i.completed),
        "failed": str(i.failed), "engine": i.engine, "pool MiB used/total": f"{_mib(i.pool_used_bytes)}/{_mib(i.pool_bytes)}",
        "restarts": str(i.restarts),
        # its device's memory where known: what it holds (weights, pool, caches, activations' peak) of the total,
        # and what is free on the device: "26.1/141 (free 98.2)"
        "memory GB": _memory(i.memory),
        # LoRA adapters held / slots, then hits and loads: "2/8 A,B (hits 10, loads 2)"
        "adapters": _adapters(i.lora) if i.lora.slots and i.role != "encoder" else "",
    }


def _device(i) -> str:
    base = f"{','.join(i.devices)} ({i.parallel})" if i.parallel else i.device
    extra = ", ".join(x for x in (f"GPU {i.visible_gpus}" if i.visible_gpus else "", i.memory.device) if x)
    return f"{base} [{extra}]" if extra else base


def _memory(m) -> str:
    if not m.total_bytes:
        return ""
    held = m.weights_bytes + m.pool_bytes + m.cache_bytes + m.activation_peak_bytes
    return f"{held / 1e9:.1f}/{m.total_bytes / 1e9:.0f} (free {m.free_bytes / 1e9:.1f})"


def _adapters(lora) -> str:
    held = lora.held
    return (f"{len(held)}/{lora.slots} {','.join(held[-3:])}{',..' if len(held) > 3 else ''} (hits {lora.hits}, loads "
            f"{lora.loads}" + (f", host {len(lora.host)}, restores {lora.restores}" if lora.host or lora.restores else "")
            + ")")


def boot_state(i) -> str:
    """A starting instance's state cell: its boot's phase, with the bytes downloaded or loaded so far."""
    boot = i.boot
    return f"{boot.phase} {_size(boot.bytes)}" if boot.bytes and boot.phase in ("downloading", "loading") else boot.phase


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def fit_columns(rows: list[dict[str, str]], width: int | None, adapters: bool = False) -> list[tuple[str, str]]:
    """The columns that fit `width` characters whole, in table order (None: all of them). `adapters`: the
    deployment serves LoRA adapters (else that column is left out)."""
    keep = [c for c in COLUMNS if adapters or c[0] != "adapters"]
    if width is not None:
        need = {name: max([len(name), *(len(r[name]) for r in rows)]) + COLUMN_EXTRA for name, _ in keep}
        while len(keep) > 2 and sum(need[name] for name, _ in keep) + 1 > width:
            keep.pop()
    order = ("role", "id", "host", "pid", "device", "state", "free/cap", "in flight", "done", "failed", "engine",
             "pool MiB used/total", "memory GB", "restarts", "adapters")
    return sorted(keep, key=lambda col: order.index(col[0]))


def status_view(report: StatusReport, title: str = "disagg", width: int | None = None) -> Group:
    """A Rich renderable of one snapshot: the instance table and a line of totals. With `width` (the
    terminal's), only the columns that fit whole are shown, the least important dropped first."""
    rows = [_cells(i) for i in report.instances]
    columns = fit_columns(rows, width, adapters=bool(report.loras) or any(i.lora.held for i in report.instances))
    table = Table(title=title, title_justify="left", expand=False)
    for col, justify in columns:
        table.add_column(col, justify=justify, no_wrap=True)
    for i, cells in zip(report.instances, rows):
        table.add_row(*(Text(cells[col], style=STATE_STYLE.get(i.state, "")) if col == "state" else Text(cells[col])
                        for col, _ in columns))
    q = report.queues
    r = report.requests

    def queued(role: str) -> str:  # with the least slack of its requests with a deadline
        slack = report.queue_slack.get(role)
        return f"{role} {q.get(role, 0)}" + (f" (least slack {slack:+.1f} s)" if slack is not None else "")

    met = sum(c.met for c in report.slo)
    missed = sum(c.missed for c in report.slo)
    totals = Text.assemble(
        ("queues ", "bold"), "  ".join(queued(role) for role in ("encoder", "denoiser", "decoder")) + "   ",
        *((("deadlines ", "bold"), f"met {met}  missed {missed}   ") if met + missed else ()),
        ("requests ", "bold"), f"in flight {r.in_flight}  completed {r.completed}  failed {r.failed}   ",
        ("throughput ", "bold"), f"{report.throughput_rps:.2f} req/s",
    )
    orch = report.orchestrator
    http = "".join(f"  http {g.url} (pid {g.pid}, restarts {g.restarts})" for g in report.gateways)
    head = Text(
        f"orchestrator pid {orch.get('pid')}  {orch.get('state')}  up {orch.get('uptime_s', 0):.0f} s  "
        f"schedule {report.schedule}"
        f"  restarts {orch.get('restarts', 0)}{http}",
        style="dim",
    )
    lines = [table, *unavailable_engine_lines(report), totals]
    if report.rebalance is not None:
        lines.append(rebalance_line(report.rebalance))
    return Group(*lines, head)


def unavailable_engine_lines(report: StatusReport) -> list[Text]:
    """One bold red line per live instance with an engine that applies to its pool and could not start (a GPU pool
    Mooncake cannot register): its hand-offs that need it go inline through the orchestrator."""
    return [Text(f"{i.id}: {engine} unavailable ({reason}): its hand-offs that need {engine} go inline through the "
                 "orchestrator", style="bold red")
            for i in report.instances if i.state != "dead" for engine, reason in sorted(i.unavailable_engines.items())]


def rebalance_line(rb) -> Text:
    """`rebalance`: the split, what it is predicted to serve, the recommendation and the moves in progress."""
    # devices of several classes: the splits per class (a swap between classes keeps the counts)
    current, recommended = (rb.current_classes, rb.recommended_classes) if rb.recommended_classes else \
        (rb.current, rb.recommended)
    if not rb.recommended:
        advice = f"split {rb.current}  no recommendation yet ({rb.holding or 'too few requests'})"
    elif recommended == current:
        advice = f"split {current} ({rb.current_rps:.2f} req/s predicted) is the best"
    else:
        gain = rb.recommended_rps / rb.current_rps - 1 if rb.current_rps else float("inf")
        advice = (f"split {current} ({rb.current_rps:.2f} req/s predicted)  recommended {recommended} "
                  f"({rb.recommended_rps:.2f} req/s, {gain:+.0%})")
    moving = "".join(f"  {m.instance_id} -> {m.new_id} ({m.state})" for m in rb.moving)
    return Text.assemble(("rebalance ", "bold"), f"{rb.mode}  {advice}{moving}  moves {rb.moves}")


def events_between(prev: StatusReport | None, cur: StatusReport) -> list[str]:
    """Plain log lines for what changed between two snapshots (the --no-dashboard output)."""
    lines = []
    before = {i.id: i for i in prev.instances} if prev else {}
    #: instances moving to another role (rebalance): their end is planned, not a death
    moves = {m.instance_id: m for rb in (prev.rebalance if prev else None, cur.rebalance) if rb for m in rb.moving}
    for i in cur.instances:
        old = before.get(i.id)
        if old is None or old.state != i.state:
            m = moves.get(i.id)
            if i.state == "dead" and m is not None:
                lines.append(f"{i.id} ({i.role}, pid {i.pid}, {i.device}) stopped to move: its device becomes "
                             f"{m.new_id} ({m.to_role})")
            else:
                lines.append(f"{i.id} ({i.role}, pid {i.pid}, {i.device}) is {i.state}")
        if i.state == "starting" and i.boot.phase and (old is None or old.boot.phase != i.boot.phase or old.state != i.state):
            lines.append(f"{i.id} is {i.boot.phase}" + (f" ({i.boot.detail})" if i.boot.detail else ""))
    urls = {g.url for g in prev.gateways} if prev else set()
    for g in cur.gateways:
        if g.url not in urls:
            lines.append(f"gateway {g.url} (pid {g.pid}) is up")
    for url in urls - {g.url for g in cur.gateways}:
        lines.append(f"gateway {url} is gone")
    lines += rebalance_events(prev.rebalance if prev else None, cur.rebalance)
    seen = set(prev.warnings) if prev else set()
    lines += [f"warning: {w}" for w in cur.warnings if w not in seen]
    if prev is None or (prev.requests.completed, prev.requests.failed) != (cur.requests.completed, cur.requests.failed):
        r = cur.requests
        if r.completed or r.failed:
            lines.append(
                f"requests: {r.completed} completed, {r.failed} failed, {r.in_flight} in flight "
                f"({cur.throughput_rps:.2f} req/s)"
            )
    return lines


def rebalance_events(prev, cur) -> list[str]:
    if cur is None:
        return []
    lines = []
    if cur.recommended and cur.recommended != cur.current and (prev is None or prev.recommended != cur.recommended):
        lines.append(f"rebalance: {cur.recommended} recommended ({cur.recommended_rps:.2f} req/s predicted; "
                     f"{cur.current} now, {cur.current_rps:.2f})")
    before = {(m.instance_id, m.state) for m in prev.moving} if prev else set()
    for m in cur.moving:
        if (m.instance_id, m.state) not in before:
            lines.append(f"rebalance: {m.instance_id} ({m.from_role}) {m.state} to become {m.new_id} ({m.to_role})")
    return lines


def bench_view(doc: dict) -> Group:
    """The `disagg bench` report as tables."""
    lat = doc["latency_s"]
    mode = doc.get("mode", {})
    load = (f"open loop, {mode['request_rate']:g} req/s" if "request_rate" in mode
            else f"closed loop, concurrency {mode.get('concurrency', '?')}")
    head = Text.assemble(
        ("path ", "bold"), f"{doc.get('path', 'zeromq')}  ", ("load ", "bold"), f"{load}\n",
        ("completed ", "bold"), f"{doc['completed']}  ", ("failed ", "bold"), f"{doc['failed']}  ",
        ("duration ", "bold"), f"{doc['duration_s']:.2f} s  ", ("throughput ", "bold"), f"{doc['throughput_rps']:.2f} req/s\n",
        ("latency ", "bold"), f"mean {lat['mean']:.4f}  p50 {lat['p50']:.4f}  p95 {lat['p95']:.4f}  p99 {lat['p99']:.4f} s   ",
        ("SLO ", "bold"), f"{doc['slo_attainment']:.1%} within {doc['slo_factor']:g} x {doc['unloaded_latency_s']:.4f} s",
    )
    stages = Table(title="per stage (means, s)", title_justify="left")
    for col in ("role", "queue", "compute", "transfer"):
        stages.add_column(col, justify="left" if col == "role" else "right")
    for role, st in doc["stages"].items():
        stages.add_row(role, f"{st['queue_s_mean']:.4f}", f"{st['compute_s_mean']:.4f}", f"{st['transfer_s_mean']:.4f}")
    inst = Table(title="instances", title_justify="left")
    for col in ("id", "role", "utilization"):
        inst.add_column(col, justify="right" if col == "utilization" else "left")
    for i in doc["instances"]:
        inst.add_row(i["id"], i["role"], f"{i['utilization']:.1%}")
    parts = [head, stages, inst]
    lora = doc.get("lora")
    if lora:
        served = lora.get("served", {})
        parts.append(Text.assemble(
            ("LoRA ", "bold"), f"{lora['adapters']} adapters, Zipf {lora['zipf']:g}: cold loads {lora['cold_loads']}  "
            f"hits {lora['hits']} ({lora['hit_rate']:.1%})  restores {lora.get('restores', 0)}  busiest instance {lora['max_share']:.2f} x the mean share  ",
            " ".join(f"{k} {v}" for k, v in served.items())))
    if doc.get("failures"):
        failures = Table(title="failures", title_justify="left")
        failures.add_column("count", justify="right")
        failures.add_column("reason", justify="left", overflow="fold")
        for f in doc["failures"]:
            failures.add_row(str(f["count"]), Text(f["reason"]))  # Text: a reason's [brackets] are not markup
        parts.append(failures)
    return Group(*parts)
