"""`disagg launch` after its flags are parsed: start, show live (or run a batch), stop cleanly."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.text import Text

from disagg.launcher.cli.batch import run_prompts
from disagg.launcher.cli.dashboard import events_between, status_view
from disagg.launcher.deployment import BootError, Deployment, StoppedDuringStartup
from disagg.settings import Settings
from disagg.transport.wire.messages import GenerationParams, StatusReport

REFRESH_S = 0.5


class EventLog:
    """The --no-dashboard output: one timestamped line per change between snapshots."""

    def __init__(self, console: Console):
        self.console = console
        self.last: StatusReport | None = None

    def __call__(self, report: StatusReport) -> None:
        for line in events_between(self.last, report):
            self.say(line)
        self.last = report

    def say(self, line: str) -> None:
        # plain text: log lines and messages hold [brackets] that are not Rich markup
        self.console.print(f"{time.strftime('%H:%M:%S')} {line}", markup=False, highlight=False)


class LiveTable:
    """The dashboard: one Rich table of every instance, redrawn in place."""

    def __init__(self, console: Console, endpoint: str):
        self.live = Live(console=console, refresh_per_second=4, transient=False)
        self.endpoint = endpoint
        self.ready = False

    def __call__(self, report: StatusReport) -> None:
        state = "Ctrl-C stops" if self.ready else "starting…"
        self.live.update(status_view(report, title=f"disagg at {self.endpoint}  ({state})",
                                     width=self.live.console.width))

    def say(self, line: str) -> None:
        self.live.console.print(f"{time.strftime('%H:%M:%S')} {line}", markup=False, highlight=False)


def run_deployment(
    config: Settings,
    console: Console,
    run_dir: str | None,
    dashboard: bool,
    prompts: list[GenerationParams] | None,
    out_dir: Path,
    concurrency: int,
    as_json: bool = False,
) -> int:
    if config.join:
        from disagg.launcher.join import JoinDeployment

        dep = JoinDeployment(config, run_dir)
    else:
        dep = Deployment(config, run_dir)
    dep.install_signal_handlers()
    out = console  # what the batch prints (its JSON); with --json everything else goes to stderr
    if as_json:
        console = Console(stderr=True, width=200)
    n = sum(p.world for p in dep.placements)  # an instance over several ranks is that many processes
    shape = f"{config.colocated} colocated" if config.colocated else (
        f"{config.encoders.count}:{config.denoisers.count}:{config.decoders.count}")
    what = (f"joining {dep.endpoint} as host {dep.host_id} ({dep.data_host}) with {n} role processes" if config.join
            else f"{n} role processes + orchestrator, endpoint {dep.endpoint}")
    console.print(f"disagg: {shape} ({what}), model {config.model}, logs in {dep.run_dir}/logs",
                  markup=False, highlight=False)
    view = LiveTable(console, dep.endpoint) if dashboard and prompts is None else EventLog(console)
    if isinstance(view, LiveTable):
        view.live.start()
        view.live.update(f"starting {n} role processes…")
    try:
        for line in dep.claim_run():
            view.say(line)
        dep.start_processes()
        dep.wait_ready(on_status=view)
        view.say(f"ready: {len(dep.placements)} instances registered" + (f" ({n} processes)" if n != len(dep.placements) else "")
                 + (f"; HTTP at {dep.http_url}/v1" if dep.http_url else ""))
        dep.supervise(spares=prompts is None)
        if prompts is not None:
            with dep.client() as client:
                return run_prompts(client, prompts, out_dir, concurrency, out, as_json,
                                   cancelled=lambda: dep.interrupted, model=config.model)
        return watch(dep, view)
    except BootError as exc:
        console.print(Text.assemble(("error: ", "red"), str(exc)))
        return 1
    except StoppedDuringStartup as exc:
        console.print(str(exc), markup=False)
        return 0 if prompts is None else 1
    except KeyboardInterrupt:
        return 130
    finally:
        if isinstance(view, LiveTable):
            view.live.stop()
        console.print("stopping…")
        dep.shutdown()
        console.print("stopped")


def nothing_left(dep: Deployment, report: StatusReport) -> bool:
    """The head stopped every role this launcher started (they exited as told, not restarted) and no host has
    an instance any more: nothing would ever serve, so the launcher does not carry on."""
    roles = [c for name, c in dep.supervisor.children.items() if name not in ("orchestrator", "gateway")]
    return bool(roles) and all(c.returncode == 0 for c in roles) and all(i.state == "dead" for i in report.instances)


def watch(dep: Deployment, view) -> int:
    """Show the deployment until Ctrl-C, SIGTERM or `disagg stop` (a join host: this host's instances,
    until they are all stopped from the head)."""
    if isinstance(view, LiveTable):
        view.ready = True
    orchestrator = dep.supervisor.children.get("orchestrator")  # None on a join host
    stopped_before = False
    with dep.client() as client:
        while not dep.interrupted:
            while not dep.supervisor.events.empty():
                view.say(dep.supervisor.events.get())
            for line in dep.take_orders(client):  # rebalance: auto moves this launcher's devices between roles
                view.say(line)
            if orchestrator is None:
                children = list(dep.supervisor.children.values())
                stopped = bool(children) and all(c.returncode == 0 for c in children)
                if stopped and stopped_before:  # twice: an instance that exited to move comes back in between
                    view.say("the head stopped this host's roles")
                    return 0
                stopped_before = stopped
                report = dep.status(client)
                if report is not None:
                    view(dep.local(report))
                time.sleep(REFRESH_S)
                continue
            if orchestrator.returncode == 0:
                view.say("the orchestrator has stopped")
                return 0
            if orchestrator.gave_up:
                view.say(f"error: the orchestrator cannot run (exit status {orchestrator.returncode}); last log lines "
                         f"({orchestrator.log_path}):\n{orchestrator.log_tail(5)}")
                return 1
            report = dep.status(client)
            if report is not None and report.orchestrator.get("pid") == orchestrator.pid:
                dep.follow(report)  # a restarted orchestrator of ours: from now on that one is ours
                view(report)
                if nothing_left(dep, report):
                    view.say("every instance was stopped (disagg stop --host) and none is left on any host: "
                             "stopping the deployment")
                    return 0
            time.sleep(REFRESH_S)
    return 0
