"""`disagg launch` after its flags are parsed: start, show live (or run a batch), stop cleanly."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from launcher.batch import run_prompts
from launcher.client import Client
from launcher.dashboard import events_between, status_view
from launcher.deployment import BootError, Deployment
from launcher.topology import DeploymentConfig
from transport.messages import GenerationParams, StatusReport

REFRESH_S = 0.5


def run_deployment(
    config: DeploymentConfig,
    console: Console,
    run_dir: str | None,
    dashboard: bool,
    prompts: list[GenerationParams] | None,
    out_dir: Path,
    concurrency: int,
) -> int:
    dep = Deployment(config, run_dir)
    dep.install_signal_handlers()
    n = len(dep.placements)
    console.print(
        f"disagg: {config.encoders.count}:{config.denoisers.count}:{config.decoders.count} "
        f"({n} role processes + orchestrator), model {config.model}, endpoint {dep.endpoint}, logs in {dep.run_dir}/logs"
    )
    last: list[StatusReport | None] = [None]

    def log_events(report: StatusReport) -> None:
        if not dashboard or prompts is not None:
            for line in events_between(last[0], report):
                console.print(f"{time.strftime('%H:%M:%S')} {line}")
        last[0] = report

    try:
        if dashboard and prompts is None:
            with console.status(f"starting {n} role processes…"):
                dep.start_processes()
                dep.wait_ready(on_status=log_events)
        else:
            dep.start_processes()
            dep.wait_ready(on_status=log_events)
        console.print(f"ready: {n} instances registered")
        if prompts is not None:
            with Client(dep.endpoint) as client:
                return run_prompts(client, prompts, out_dir, concurrency, console, timeout_s=None,
                                   cancelled=lambda: dep.interrupted)
        return watch(dep, console, dashboard, log_events)
    except BootError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        console.print("stopping…")
        dep.shutdown()
        console.print("stopped")


def watch(dep: Deployment, console: Console, dashboard: bool, log_events) -> int:
    """Show the deployment until Ctrl-C, SIGTERM or `disagg stop`."""
    from rich.live import Live

    orchestrator = dep.supervisor.children["orchestrator"]
    with Client(dep.endpoint) as client:
        live = Live(console=console, refresh_per_second=4, transient=False) if dashboard else None
        if live:
            live.start()
        try:
            while not dep.interrupted:
                for child in dep.supervisor.reap_children():
                    console.print(f"{time.strftime('%H:%M:%S')} {child.name} (pid {child.pid}) exited with status {child.returncode}")
                if orchestrator.returncode is not None:
                    console.print("the orchestrator has stopped")
                    return 0
                report = dep.status(client)
                if report is not None:
                    if live:
                        live.update(status_view(report, title=f"disagg at {dep.endpoint}  (Ctrl-C stops)"))
                    else:
                        log_events(report)
                time.sleep(REFRESH_S)
        finally:
            if live:
                live.stop()
    return 0
