"""`disagg bench` (load a running deployment) and `disagg bench transfer` (the stage handoff per engine)."""

from __future__ import annotations

import json
import os
import sys

import click

from disagg.client import Unreachable
from disagg.launcher.cli.common import (
    EXIT_FAILED,
    endpoint_option,
    exit_unreachable,
    int_list,
    keys_option,
    make_client,
    make_console,
)
from disagg.launcher.cli.prompts import PromptError, load_prompts
from disagg.transport.data.selection import CHOICES as TRANSFER_CHOICES
from disagg.transport.data.selection import Transfer
from disagg.transport.environment import DISAGG_API_KEY


@click.group(invoke_without_command=True)
@endpoint_option
@keys_option
@click.option("--concurrency", type=click.IntRange(1, 100_000), help="Closed loop: requests kept in flight (default 1).")
@click.option("--request-rate", type=click.FloatRange(0.001), help="Open loop: Poisson arrivals per second.")
@click.option("--num-requests", type=click.IntRange(1), default=100, show_default=True, help="Measured requests.")
@click.option("--warmup", type=click.IntRange(0), default=3, show_default=True, help="Requests run one at a time first; their median latency is the unloaded latency.")
@click.option("--width", type=int, help="Request width (default: the model's).")
@click.option("--height", type=int, help="Request height (default: the model's).")
@click.option("--steps", type=int, help="num_inference_steps (default: the model's).")
@click.option("--prompts", "prompts_path", type=click.Path(dir_okay=False), help="A prompts file (mixed sizes): requests cycle through it.")
@click.option("--slo-factor", type=click.FloatRange(0.0, min_open=True), default=2.0, show_default=True, help="slo_attainment: share of requests within this many times the unloaded latency.")
@click.option("--loras", type=click.IntRange(0, 100_000), default=0, help="Each measured request applies one LoRA adapter, drawn from this many names (sim-lora-0 ...; a sim model takes any name). Reports cold loads, hits and each instance's share.")
@click.option("--lora-zipf", type=click.FloatRange(0.0), default=1.1, show_default=True, help="With --loras: adapters are drawn with Zipf of this exponent (0: uniform).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the open loop's arrivals and the adapters drawn (another seed: another draw of the same load); the adapters have a stream of their own, so a run with --loras meets the same arrival times as one without.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), help="Replay this JSON Lines trace open-loop (one request per line: t, width, height, num_inference_steps, and optionally num_frames, priority, slo_ms; benchmarks/traces/mixed.py makes one). Lines without slo_ms get --slo-factor x their class's standalone latency, measured first. Reports SLO attainment and goodput, overall and per class.")
@click.option("--rate-scale", type=click.FloatRange(0.0, min_open=True), default=1.0, show_default=True, help="With --trace: divide every arrival time by this (2: twice the rate).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--http", "http_url", metavar="URL", help="Drive the HTTP gateway at URL (e.g. http://127.0.0.1:8000) instead of the ZeroMQ endpoint.")
@click.option("--api-key", default=lambda: os.environ.get(DISAGG_API_KEY, ""), help="With --http: the gateway's API key. [default: $DISAGG_API_KEY]")
@click.pass_context
def bench(ctx, endpoint, keys, concurrency, request_rate, num_requests, warmup, width, height, steps, prompts_path, slo_factor, loras, lora_zipf, seed, trace_path, rate_scale, as_json, http_url, api_key) -> None:
    """Load a running deployment and report throughput, latency, stage times, utilization.

    `disagg bench transfer` instead measures the stage handoff per transfer engine.
    """
    if ctx.invoked_subcommand is not None:
        return
    from disagg.launcher.bench.load import run_load
    from disagg.transport.wire.messages import MessageError, params_from_obj

    if concurrency and request_rate:
        raise click.UsageError("give --concurrency (closed loop) or --request-rate (open loop), not both")
    if trace_path:
        return bench_trace(endpoint, keys, trace_path, rate_scale, slo_factor, as_json, http_url, api_key)
    if prompts_path:
        try:
            workload = load_prompts(prompts_path)
        except PromptError as exc:
            raise click.BadParameter(str(exc), param_hint="--prompts") from None
    else:
        fields = {k: v for k, v in (("width", width), ("height", height), ("num_inference_steps", steps)) if v is not None}
        try:
            workload = [params_from_obj({"prompt": "a benchmark prompt", "seed": 0, **fields})]
        except MessageError as exc:
            raise click.UsageError(str(exc)) from None
    if http_url:
        from disagg.launcher.bench.http import HttpLoadClient

        load_client = HttpLoadClient(http_url, api_key)
    else:
        load_client = make_client(endpoint, keys)
    with load_client as client:
        try:
            doc = run_load(client, workload, num_requests, concurrency, request_rate, warmup, slo_factor,
                           seed=seed, loras=loras, lora_zipf=lora_zipf)
        except Unreachable as exc:
            exit_unreachable(exc)
    doc["path"] = "http" if http_url else "zeromq"
    if as_json:
        click.echo(json.dumps(doc))
    else:
        from disagg.launcher.cli.dashboard import bench_view

        make_console().print(bench_view(doc))
    if doc["failed"]:
        click.echo(f"error: {doc['failed']} of {doc['failed'] + doc['completed']} requests failed", err=True)
        sys.exit(EXIT_FAILED)


def bench_trace(endpoint, keys, trace_path, rate_scale, slo_factor, as_json, http_url, api_key) -> None:
    from disagg.launcher.bench.trace import TraceError, load_trace, run_trace, trace_table

    try:
        lines = load_trace(trace_path)
    except TraceError as exc:
        raise click.BadParameter(str(exc), param_hint="--trace") from None
    if http_url and any(line.num_frames for line in lines):
        raise click.BadParameter("lines with num_frames (videos) replay over ZeroMQ only: POST /v1/images/generations "
                                 "takes no num_frames", param_hint="--trace")
    if http_url:
        from disagg.launcher.bench.http import HttpLoadClient

        load_client = HttpLoadClient(http_url, api_key)
    else:
        load_client = make_client(endpoint, keys)
    with load_client as client:
        try:
            doc = run_trace(client, lines, rate_scale, slo_factor)
        except Unreachable as exc:
            exit_unreachable(exc)
        except TraceError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_FAILED)
    doc["path"] = "http" if http_url else "zeromq"
    if as_json:
        click.echo(json.dumps(doc))
    else:
        make_console().print(trace_table(doc))
    failed = doc["classes"][0]["failed"]
    if failed:
        click.echo(f"error: {failed} of {doc['requests']} requests failed or were refused:", err=True)
        for f in doc["failures"]:
            click.echo(f"  {f['count']} x {f['example'] if f['count'] == 1 else f['reason']}", err=True)
        sys.exit(EXIT_FAILED)


@bench.command("transfer")
@click.option("--engines", help="Comma-separated engines (default: shm, mooncake if installed, inline; with --gpus: cuda-ipc, mooncake, inline).")
@click.option("--sizes", help="Comma-separated payload sizes in bytes (default 16 KiB, 512 KiB, 4 MiB, 10 MiB, 30 MiB).")
@click.option("--repeats", type=click.IntRange(1, 10_000), default=20, show_default=True, help="Measured handoffs per size.")
@click.option("--warmup", type=click.IntRange(0, 1000), default=3, show_default=True, help="Unmeasured handoffs first, per size.")
@click.option("--gpus", metavar="0,1,...", help="Place the roles on these GPUs (GPU pools, cuda-ipc); shm still runs on host pools, as the baseline.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def bench_transfer(engines, sizes, repeats, warmup, gpus, as_json) -> None:
    """Measure the stage handoff per transfer engine between real role processes."""
    import importlib.util

    from disagg.launcher.bench.transfer import SIZES, bench_table, run_bench, shape_for

    gpu_list = int_list(gpus, "--gpus") or []
    if engines:
        names = [e.strip() for e in engines.split(",") if e.strip()]
        bad = [e for e in names if e not in TRANSFER_CHOICES or e == Transfer.AUTO]
        if bad:
            raise click.BadParameter(f"unknown engine(s) {', '.join(bad)}", param_hint="--engines")
    else:
        has_mooncake = importlib.util.find_spec("mooncake") is not None
        names = ([Transfer.CUDA_IPC] if gpu_list else [Transfer.SHM]) + ([Transfer.MOONCAKE] if has_mooncake else []) + \
            [Transfer.INLINE]
    size_list = int_list(sizes, "--sizes") or list(SIZES)
    for n in size_list:
        try:
            shape_for(n)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--sizes") from None
    console = make_console()
    doc = run_bench(names, size_list, repeats, warmup, gpu_list, console, quiet=as_json)
    if as_json:
        click.echo(json.dumps(doc))
    else:
        console.print(bench_table(doc))
