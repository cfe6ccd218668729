"""`disagg plan`: the throughput models run offline on a trace (the `bench --trace` format).

`disagg plan --config FILE --trace FILE`: which split of the config's devices between the roles serves the trace's
mix best (disagg/orchestrator/parts/planner.py, the model of `--rebalance`).

`disagg plan --model sim:NAME --devices 8xH200[,4xL40S] --trace FILE [--write-config FILE] [--json]` (or the config's
model and devices): which placement serves it best (disagg/orchestrator/parts/placements.py): dedicated splits, light
roles sharing devices, light roles on another class of device, and colocated replicas (offloading where they must),
under the devices' memory; `--write-config` writes the winner as a config `disagg launch --config` takes as it is.

Stage times come from the model's sim profile (disagg/roles/pipelines/sim_profiles: `sim:NAME`, or `sim:PATH.yaml`), per request size
and steps, a denoiser's batched at `denoisers.max_batch` (full batches: its profile's batch curve). A running
deployment plans from what it measures instead (`--rebalance advise`: `disagg status`).
"""

from __future__ import annotations

import json
import os

import click
import yaml

from disagg.orchestrator.parts.placements import MONOLITH, Scored, rank
from disagg.orchestrator.parts.planner import ROLES, Plan, Work, fmt, plan
from disagg.roles.pipelines.sim_profile import load_profile
from disagg.settings import Settings
from disagg.settings.devices import DeviceError, parse_devices


class PlanError(ValueError):
    """The config or trace cannot be planned for; the message says why."""


def stage_seconds(config: Settings, batch: int | None = None):
    """predict(role, trace line) -> seconds of device time per request, from the config's sim profile; a denoiser's
    at `batch` (default `denoisers.max_batch`)."""
    if not config.model.startswith("sim:"):
        raise PlanError(f"offline plans take stage times from a sim profile (model sim:NAME); {config.model!r} has "
                        "none: plan it with the sim profile of its model, or launch it with --rebalance advise, "
                        "which plans from measured times (disagg status)")
    try:
        profile = load_profile(config.model[4:])
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    batch = config.denoisers.max_batch if batch is None else batch

    def predict(role: str, line) -> float:
        p = {"width": line.width or 1024, "height": line.height or 1024, "num_frames": line.num_frames}
        prof, pixels = profile.for_request(p)
        steps = line.num_inference_steps or 4
        ms = prof.stage_ms(role, pixels, steps)
        if role == "denoiser" and batch > 1:  # each request's share of full batches' steps
            ms -= steps * prof.denoiser.step_ms(pixels) * (1 - prof.denoiser.batch_factor(pixels, batch) / batch)
        return ms * prof.time_scale / 1000

    return predict


def plan_trace(config: Settings, lines) -> tuple[Plan, Work]:
    if config.colocated:
        raise PlanError("colocated instances run every stage: there is no split to plan")
    counts = {r: config.role(r).count for r in ROLES}
    if sum(counts.values()) < len(ROLES):
        raise PlanError(f"the config has {sum(counts.values())} devices; a split needs at least {len(ROLES)}")
    work = Work.of(((line, 1) for line in lines), stage_seconds(config))
    return plan(work, counts, config.rebalance.min_per_role), work


def plan_doc(p: Plan, work: Work) -> dict:
    return {
        "current": fmt(p.current), "current_rps": round(p.current_rps, 4),
        "recommended": fmt(p.best), "recommended_rps": round(p.best_rps, 4),
        "gain": round(p.gain, 4) if p.gain != float("inf") else None,
        "requests": work.requests, "work_s": {r: round(s, 6) for r, s in work.seconds.items()},
        "considered": [{"split": fmt(s), "rps": round(r, 4)} for s, r in p.considered],
    }


def place_trace(config: Settings, lines) -> tuple[list[Scored], Work, list]:
    """Every placement of the config's devices (`devices`) ranked for the trace's mix, best first."""
    try:
        classes = parse_devices(config.devices)
    except DeviceError as exc:
        raise PlanError(str(exc)) from None
    if not classes:
        raise PlanError("placements need devices: --devices 8xH200[,4xL40S] (or devices: in the config)")
    work = Work.of(((line, 1) for line in lines), stage_seconds(config))
    profile = load_profile(config.model[4:])
    # memory at the mix's largest request (its activations bound what a device must hold)
    pixels = max(profile.for_request({"width": line.width or 1024, "height": line.height or 1024,
                                      "num_frames": line.num_frames})[1] for line in lines)
    # a colocated replica runs one request at a time (it does not batch): its seconds are unbatched
    alone = Work.of(((line, 1) for line in lines), stage_seconds(config, batch=1)).seconds
    return rank(classes, profile, work.seconds, pixels, config.denoisers.max_batch, alone), work, classes


def placement_config(config: Settings, best: Scored, classes) -> dict:
    """The winner as a launch config: the model, the devices, and each role's GPUs (or the replicas)."""
    doc: dict = {"model": config.model, "devices": config.devices}
    hosts = best.placement.hosts
    if best.placement.kind == "replicas":
        gpus = [d for d, h in enumerate(hosts) if MONOLITH in h]
        doc.update(colocated=len(gpus), gpus=gpus)
        return doc
    for role, section in (("encoder", "encoders"), ("denoiser", "denoisers"), ("decoder", "decoders")):
        gpus = [d for d, h in enumerate(hosts) if role in h]
        doc[section] = {"count": len(gpus), "gpus": gpus}
    if config.denoisers.max_batch > 1:  # room for a second batch fetching its inputs as one computes
        doc["denoisers"].update(max_batch=config.denoisers.max_batch, capacity=2 * config.denoisers.max_batch)
    return doc


def placement_doc(scored: list[Scored], work: Work, classes) -> dict:
    def one(s: Scored) -> dict:
        return {"placement": s.placement.describe(classes), "kind": s.placement.kind, "rps": round(s.rps, 4),
                "hosts": [list(h) for h in s.placement.hosts], "memory_bytes": s.memory,
                "offload_s": [round(o, 4) for o in s.offload_s], **({"refused": s.why_not} if s.why_not else {})}

    return {"requests": work.requests, "work_s": {r: round(v, 6) for r, v in work.seconds.items()},
            "devices": [c.name for c in classes], "winner": one(scored[0]), "candidates": [one(s) for s in scored]}


@click.command("plan")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None, help="Deployment YAML: its model (a sim profile gives the stage times), devices, role counts (the current split), denoisers.max_batch and rebalance.min_per_role.")
@click.option("--model", default=None, help="The sim:PROFILE whose stage times, weights and activations the plan uses (over the config's).")
@click.option("--devices", default=None, metavar="NxCLASS,...", help="The devices to place on, e.g. 8xH200,4xL40S (over the config's): rank placements, not only splits.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), required=True, help="A JSON Lines trace, as `disagg bench --trace` takes (t, width, height, num_inference_steps, num_frames): its requests are the mix.")
@click.option("--write-config", "write_path", type=click.Path(dir_okay=False), default=None, help="Write the winning placement as a config file `disagg launch --config` takes as it is.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def plan_command(config_path, model, devices, trace_path, write_path, as_json) -> None:
    """Recommend how to use the devices for the trace's mix, offline: the split E:D:K of the config's devices, or,
    with devices (--devices), the placement among dedicated splits, light roles sharing devices or on another class,
    and colocated replicas that serves the most within the devices' memory.

    Prints the predicted requests per second of every candidate (the throughput model of `--rebalance`)."""
    from disagg.launcher.bench.trace import TraceError, load_trace
    from disagg.launcher.cli.common import make_console
    from disagg.launcher.topology import ConfigError, resolve_checked

    flags = {}  # what the flags give, over the config's
    if model is not None:
        flags["model"] = model
    if devices is not None:
        flags["devices"] = devices
    if config_path is None and model is None:
        raise click.UsageError("give --config FILE, or --model sim:NAME with --devices")
    try:
        config = resolve_checked(config_path, os.environ, flags).settings
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--config" if config_path else "--model/--devices") from None
    try:
        lines = load_trace(trace_path)
    except TraceError as exc:
        raise click.BadParameter(str(exc), param_hint="--trace") from None
    try:
        if config.devices:
            scored, work, classes = place_trace(config, lines)
        else:
            doc = plan_doc(*plan_trace(config, lines))
    except PlanError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from None
    console = make_console()
    if not config.devices:
        if write_path:
            raise click.UsageError("--write-config writes a placement: give --devices")
        return _print_split(doc, as_json, console)
    best = scored[0]
    if write_path:
        with open(write_path, "w") as f:
            f.write(f"# disagg plan: {best.placement.describe(classes)}, {best.rps:.3f} req/s predicted\n")
            yaml.safe_dump(placement_config(config, best, classes), f, sort_keys=False)
    if as_json:
        click.echo(json.dumps(placement_doc(scored, work, classes), indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{work.requests} requests on {config.devices}; H200-seconds per request: "
                        + ", ".join(f"{r} {s:.3f}" for r, s in work.seconds.items()), title_justify="left")
    for col, justify in (("placement", "left"), ("kind", "left"), ("predicted req/s", "right"), ("", "left")):
        table.add_column(col, justify=justify)
    best_of = {}
    for s in scored:
        best_of.setdefault(s.placement.kind, s)
    shown = [s for s in scored[:8]] + [s for s in best_of.values() if s not in scored[:8]]
    for s in shown:
        note = "(recommended)" if s is best else s.why_not or (f"offloads {max(s.offload_s):.2f} s a request"
                                                             if any(s.offload_s) else "")
        table.add_row(s.placement.describe(classes), s.placement.kind, f"{s.rps:.3f}", note)
    console.print(table)
    memory = ", ".join(f"{d}: {m / 1e9:.1f}/{c.memory_bytes / 1e9:.0f} GB" for d, (m, c) in enumerate(zip(best.memory, classes)))
    click.echo(f"recommended {best.placement.describe(classes)}: {best.rps:.3f} req/s predicted; memory per device "
               f"{memory}" + (f"; written to {write_path}" if write_path else ""))


def _print_split(doc: dict, as_json: bool, console) -> None:
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{doc['requests']} requests; device-seconds per request: "
                        + ", ".join(f"{r} {s:.3f}" for r, s in doc["work_s"].items()), title_justify="left")
    table.add_column("split E:D:K")
    table.add_column("predicted req/s", justify="right")
    for row in doc["considered"]:
        mark = "  (recommended)" if row["split"] == doc["recommended"] else "  (current)" if row["split"] == doc["current"] else ""
        table.add_row(row["split"] + mark, f"{row['rps']:.3f}")
    console.print(table)
    click.echo(f"recommended {doc['recommended']}: {doc['recommended_rps']:.3f} req/s predicted "
               f"(current {doc['current']}: {doc['current_rps']:.3f} req/s)")
