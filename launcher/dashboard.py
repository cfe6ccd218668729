"""The live table of every instance, and the plain one-line-per-event log used without it."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from transport.messages import StatusReport

STATE_STYLE = {"ready": "green", "starting": "yellow", "draining": "cyan", "dead": "bold red"}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def status_view(report: StatusReport, title: str = "disagg") -> Group:
    """A Rich renderable of one snapshot: the instance table and a line of totals."""
    table = Table(title=title, title_justify="left", expand=False)
    for col, justify in [
        ("role", "left"), ("id", "left"), ("pid", "right"), ("device", "left"), ("state", "left"),
        ("free/cap", "right"), ("in flight", "right"), ("done", "right"), ("failed", "right"),
        ("engine", "left"), ("pool MiB used/total", "right"), ("restarts", "right"),
    ]:
        table.add_column(col, justify=justify, no_wrap=True)
    for i in report.instances:
        table.add_row(
            i.role, i.id, str(i.pid), i.device, Text(i.state, style=STATE_STYLE.get(i.state, "")),
            f"{i.free_slots}/{i.capacity}", str(i.in_flight), str(i.completed), str(i.failed),
            i.engine, f"{_mib(i.pool_used_bytes)}/{_mib(i.pool_bytes)}", str(i.restarts),
        )
    q = report.queues
    r = report.requests
    totals = Text.assemble(
        ("queues ", "bold"), f"encoder {q.get('encoder', 0)}  denoiser {q.get('denoiser', 0)}  decoder {q.get('decoder', 0)}   ",
        ("requests ", "bold"), f"in flight {r.in_flight}  completed {r.completed}  failed {r.failed}   ",
        ("throughput ", "bold"), f"{report.throughput_rps:.2f} req/s",
    )
    orch = report.orchestrator
    head = Text(
        f"orchestrator pid {orch.get('pid')}  {orch.get('state')}  up {orch.get('uptime_s', 0):.0f} s"
        f"  restarts {orch.get('restarts', 0)}",
        style="dim",
    )
    return Group(table, totals, head)


def events_between(prev: StatusReport | None, cur: StatusReport) -> list[str]:
    """Plain log lines for what changed between two snapshots (the --no-dashboard output)."""
    lines = []
    before = {i.id: i for i in prev.instances} if prev else {}
    for i in cur.instances:
        old = before.get(i.id)
        if old is None or old.state != i.state:
            lines.append(f"{i.id} ({i.role}, pid {i.pid}, {i.device}) is {i.state}")
    if prev is None or (prev.requests.completed, prev.requests.failed) != (cur.requests.completed, cur.requests.failed):
        r = cur.requests
        if r.completed or r.failed:
            lines.append(
                f"requests: {r.completed} completed, {r.failed} failed, {r.in_flight} in flight "
                f"({cur.throughput_rps:.2f} req/s)"
            )
    return lines


def bench_view(doc: dict) -> Group:
    """The `disagg bench` report as tables."""
    lat = doc["latency_s"]
    head = Text.assemble(
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
    return Group(head, stages, inst)
