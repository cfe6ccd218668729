"""The `disagg` command: launch, status, submit, stop, keys, serve-http (bench: disagg/launcher/bench/cli.py).

Exit codes: 0 success, 1 a request failed, 2 usage error (submit: every failure was the request's own fault),
3 cannot reach the orchestrator.
Heavy imports (torch, diffusers) never happen here: only role processes load them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import click
import msgspec

from disagg.client import Unreachable
from disagg.launcher.bench.cli import bench
from disagg.launcher.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    endpoint_option,
    exit_unreachable,
    keys_option,
    make_client,
    make_console,
)
from disagg.launcher.cli.dashboard import boot_state, status_view
from disagg.launcher.cli.entry import run_click
from disagg.launcher.cli.options import file_only_epilog, flags_from, settings_options
from disagg.launcher.cli.plan import plan_command
from disagg.launcher.cli.prompts import PromptError, load_prompts
from disagg.launcher.topology import ConfigError

#: how long `disagg stop` waits for the orchestrator to let go of its port
STOP_WAIT_S = 10.0



@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log the launcher's own steps (before or after the command: `disagg launch -v`).")
@click.version_option(package_name="disagg", prog_name="disagg")
def cli(verbose: bool) -> None:
    """disagg: diffusion serving with encoders, denoisers and decoders as separate pools."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")


@cli.command(epilog=file_only_epilog())
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Deployment YAML (default: the built-in deployment, as in configs/tiny.yaml, which lists every setting).")
@settings_options()
@click.option("--print-config", is_flag=True, help="Print the effective settings as YAML, each with where it came from (flag, env, file, default), and exit without starting anything.")
@click.option("--run-dir", type=click.Path(file_okay=False), help="The run's folder: per-process logs go to DIR/logs (default $TMPDIR/disagg/RUN_ID; the 20 newest runs there are kept).")
@click.option("--no-dashboard", is_flag=True, help="Print one plain line per event instead of the live table.")
@click.option("--submit", "submit_path", type=click.Path(dir_okay=False), help="Batch mode: run this prompts file, write outputs, shut down.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="outputs", show_default=True, help="Batch mode: where images go.")
@click.option("--concurrency", type=click.IntRange(1, 4096), default=4, show_default=True, help="Batch mode: requests in flight at once.")
@click.option("--json", "as_json", is_flag=True, help="Batch mode: print one JSON object with every request's outcome and stage timings.")
def launch(config_path, print_config, run_dir, no_dashboard, submit_path, out_dir, concurrency, as_json, **flags) -> None:
    """Start the orchestrator and every role process, and show them live.

    Every setting is a flag, a DISAGG_<NAME> variable (a section's key: DISAGG_<SECTION>_<NAME>) and a key of
    the --config file; a flag wins over the variable, which wins over the file, which wins over the built-in
    default. Ctrl-C (or SIGTERM) stops every process and removes the run's shared memory.
    """
    from disagg.launcher.topology import resolve_checked

    try:
        resolved = resolve_checked(config_path, os.environ, flags_from(flags))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    for note in resolved.warnings:
        click.echo(f"warning: {note}", err=True)
    config = resolved.settings
    if print_config:
        from disagg.settings.render import effective_yaml

        click.echo(effective_yaml(resolved), nl=False)
        return
    if config.keys:
        from disagg.transport.wire.auth import KeyError_, client_curve

        try:
            client_curve(Path(config.keys))
        except KeyError_ as exc:
            raise click.BadParameter(str(exc), param_hint="--keys") from None
    prompts = None
    if submit_path:
        try:
            prompts = load_prompts(submit_path)
        except PromptError as exc:
            raise click.BadParameter(str(exc), param_hint="--submit") from None
        _check_out(out_dir)
    from disagg.launcher.ports import PortBusy, check_http_port, check_ports
    from disagg.launcher.topology import check_gpus
    from disagg.transport.wire.lane import lane_path

    try:
        check_gpus(config)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--gpus") from None
    from disagg.launcher.topology import check_fit, place, shared_gpu_warnings

    placements = place(config)
    try:
        check_fit(config, placements)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--devices") from None
    for note in shared_gpu_warnings(placements):
        click.echo(f"warning: {note}", err=True)
    if config.join and (submit_path or config.http.port):
        raise click.UsageError("a join host runs roles only: --submit and --http-port belong to the head")
    if config.http.port and not config.join and config.http.port in (config.port, config.port + 1):
        raise click.BadParameter(f"{config.http.port} is the orchestrator's {'client' if config.http.port == config.port else 'role'} "
                                 f"port (--port {config.port} takes {config.port} and {config.port + 1})",
                                 param_hint="--http-port")
    nothing_here = not config.colocated and not any(config.role(r).count for r in ("encoder", "denoiser", "decoder"))
    if nothing_here and (config.join or submit_path):
        raise click.UsageError("-e 0 -d 0 -k 0 starts no role instance: nothing would serve"
                               + (" here" if config.join else " the prompts"))
    if nothing_here:
        click.echo("warning: -e 0 -d 0 -k 0: no role instance on this host; the deployment serves once hosts join "
                   "(disagg launch --join)", err=True)
    try:  # before anything is spawned: a second launch must never disturb the deployment already there
        if not config.join:
            check_ports(config.host, config.port, lane_path(config.port) if config.lane else None)
        if config.http.port:
            check_http_port(config.http.host, config.http.port)
    except PortBusy as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    if not config.keys and not config.join and not _loopback(config.host):
        click.echo(f"warning: binding {config.host} without --keys: anyone who can reach it can submit, register a "
                   "role, and stop the deployment (disagg stop)", err=True)
    from disagg.launcher.run import run_deployment

    sys.exit(run_deployment(config, make_console(), run_dir, not no_dashboard, prompts, Path(out_dir), concurrency, as_json))


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _check_out(out_dir: str) -> None:
    from disagg.launcher.cli.batch import OutDirError, check_out_dir

    try:
        check_out_dir(Path(out_dir))
    except OutDirError as exc:
        raise click.BadParameter(str(exc), param_hint="--out") from None


@cli.command()
@endpoint_option
@keys_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--watch", is_flag=True, help="Refresh the table until Ctrl-C.")
@click.option("--ready-here", is_flag=True, help="A readiness probe: exit 0 only if this host (its id: $DISAGG_HOST_ID, or this machine's) has instances and all of them are ready or standbys, else 1 saying which are not.")
def status(endpoint: str, keys: str | None, as_json: bool, watch: bool, ready_here: bool) -> None:
    """Show every instance's state, free slots and queues."""
    console = make_console()
    with make_client(endpoint, keys) as client:
        try:
            report = client.status()
        except Unreachable as exc:
            exit_unreachable(exc)
        if ready_here:
            from disagg.launcher.hosts import host_id

            here = host_id()
            mine = [i for i in report.instances if i.host == here and i.state != "dead"]
            waiting = [f"{i.id} {boot_state(i) if i.state == 'starting' and i.boot.phase else i.state}"
                       for i in mine if i.state not in ("ready", "standby")]
            if not mine or waiting:
                click.echo(f"not ready: {', '.join(waiting) or f'no instance of host {here} has registered'}", err=True)
                sys.exit(EXIT_FAILED)
            click.echo(f"ready: {len(mine)} instance(s) of host {here}")
            return
        if as_json:
            click.echo(json.dumps(msgspec.to_builtins(report), indent=2))
            return
        if not watch:
            console.print(status_view(report, title=f"disagg at {endpoint}", width=console.width))
            return
        from rich.live import Live

        try:
            with Live(status_view(report, width=console.width), console=console, refresh_per_second=4) as live:
                while True:
                    time.sleep(0.5)
                    try:
                        live.update(status_view(client.status(), title=f"disagg at {endpoint}", width=console.width))
                    except Unreachable as exc:
                        exit_unreachable(exc)
        except KeyboardInterrupt:
            pass


@cli.command()
@click.argument("prompts", type=click.Path(dir_okay=False))
@endpoint_option
@keys_option
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="outputs", show_default=True, help="Where images go, named by request id.")
@click.option("--concurrency", type=click.IntRange(1, 4096), default=4, show_default=True, help="Requests in flight at once.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.001), help="Per-request deadline in seconds (default: the deployment's).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with every request's outcome and stage timings.")
@click.option("--previews", "previews_dir", type=click.Path(file_okay=False), help="Save live previews here as they arrive (REQUEST-preview-N.png): a decoder decodes the latents at evenly spaced steps; a prompt without `previews` gets 2.")
def submit(prompts: str, endpoint: str, keys: str | None, out_dir: str, concurrency: int, timeout_s, as_json: bool,
           previews_dir: str | None) -> None:
    """Run the prompts in PROMPTS (a JSON object, a list, or JSON Lines) and save the images."""
    try:
        params = load_prompts(prompts)
    except PromptError as exc:
        raise click.BadParameter(str(exc), param_hint="PROMPTS") from None
    _check_out(out_dir)
    if previews_dir:
        _check_out(previews_dir)
        params = [p if p.previews is not None else msgspec.structs.replace(p, previews=2) for p in params]
    from disagg.launcher.cli.batch import run_prompts

    with make_client(endpoint, keys) as client:
        try:
            code = run_prompts(client, params, Path(out_dir), concurrency, make_console(), as_json, timeout_s,
                               previews_dir=Path(previews_dir) if previews_dir else None)
        except Unreachable as exc:
            exit_unreachable(exc)
    sys.exit(code)


@cli.command()
@endpoint_option
@keys_option
@click.option("--drain", is_flag=True, help="Refuse new work, finish what is in flight, then stop.")
@click.option("--host", "host_id", help="Stop only the instances of this host (its id, as `status` shows it); with --drain once they finished their work, else now (their work moves elsewhere).")
@click.option("--yes", is_flag=True, help="With --host naming the orchestrator's own host: stop its instances all the same.")
def stop(endpoint: str, keys: str | None, drain: bool, host_id: str | None, yes: bool) -> None:
    """Shut the deployment down: the orchestrator stops every role, then the launcher exits.

    With --host, only one host's instances stop; the rest of the deployment goes on. The orchestrator's own
    host is refused without --yes: that stops the head launcher's roles, which are not started again."""
    with make_client(endpoint, keys) as client:
        if host_id:
            try:
                report = client.status()
                if report.orchestrator.get("host_id") == host_id and not yes:
                    others = sorted({i.host for i in report.instances if i.host != host_id and i.state != "dead"})
                    rest = (f"the instances of {', '.join(others)} go on" if others else
                            "no other host has instances, so nothing would serve (`disagg stop` stops it all)")
                    click.echo(f"error: host {host_id} runs the orchestrator: its roles would stop for good and {rest}. "
                               "Pass --yes to stop them all the same.", err=True)
                    sys.exit(EXIT_USAGE)
                client.stop_host(host_id, drain=drain)
            except Unreachable as exc:
                exit_unreachable(exc)
            except RuntimeError as exc:  # refused: no such host
                click.echo(f"error: {exc}", err=True)
                sys.exit(EXIT_FAILED)
            click.echo(f"{'draining' if drain else 'stopping'} host {host_id} of the deployment at {endpoint}")
            return
        try:
            client.stop(drain=drain)
        except Unreachable as exc:
            exit_unreachable(exc)
        except RuntimeError as exc:  # refused
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_FAILED)
        if drain:
            click.echo(f"draining, then stopping the deployment at {endpoint}")
            return
        click.echo(f"stopping the deployment at {endpoint}")
        # return once its port is free, so a launch right after this one finds it so
        if client.wait_gone(STOP_WAIT_S):
            click.echo("stopped")
        else:
            click.echo(f"warning: the orchestrator still holds {endpoint} after {STOP_WAIT_S:g} s", err=True)


@cli.command()
@click.option("--wait", "wait_s", type=click.FloatRange(0), default=0, show_default=True,
              help="Seconds to wait for the processes of gone launchers' runs to exit, removing their segments as "
                   "they do (a node's processes killed one by one).")
def clean(wait_s: float) -> None:
    """Remove what deployments killed on this machine left behind: the shared-memory pools and simulated devices'
    files of runs whose launcher and processes are gone, and their lane sockets. A live deployment is never touched.
    Every launch does this first; a cluster job runs it where a node's processes were killed (the Slurm recipe:
    each step's task epilog)."""
    import time

    from disagg.launcher.leftovers import remove_leftovers

    deadline = time.monotonic() + wait_s
    said: list[str] = []
    while True:
        pending: list[str] = []
        for line in remove_leftovers(pending=pending):
            said.append(line)
            click.echo(line)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if pending:
        click.echo(f"still running: processes of run(s) {', '.join(pending)} whose launcher is gone; their "
                   "segments stay until they exit (`disagg clean` again, or the next launch, removes them)")
    elif not said:
        click.echo("nothing left behind")


@cli.group()
def keys() -> None:
    """CurveZMQ keys: encrypt and authenticate every socket of a deployment."""


@keys.command("generate")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Replace keys already in DIRECTORY (a deployment running with them "
                                            "then admits no client until it is restarted with the new ones).")
def keys_generate(directory: str, force: bool) -> None:
    """Write a server and a client key pair into DIRECTORY (launch, submit, status take --keys DIRECTORY).

    DIRECTORY/clients gets the client pair and the server's public key only: give that to clients, roles and
    join hosts (their --keys), and the whole DIRECTORY to the orchestrator's host alone (it holds the server's
    secret key)."""
    from disagg.transport.wire.auth import generate_keys, key_files

    existing = [p for p in key_files(Path(directory)) if p.exists()]
    if existing and not force:
        raise click.UsageError(f"{directory} already holds keys ({', '.join(p.name for p in existing)}); a running "
                               "deployment may use them. Pass --force to replace them, or choose another directory")
    for path in generate_keys(Path(directory)):
        click.echo(str(path))


@cli.command("serve-http")
@endpoint_option
@keys_option
@settings_options(rename={"http.host": "--host", "http.port": "--port"}, only=("http.host", "http.port", "http.api_key"))
def serve_http(endpoint: str, keys: str | None, **flags) -> None:
    """Serve the OpenAI-compatible HTTP API for a running deployment (more gateways may front one orchestrator).

    --host, --port and --api-key are the settings http.host, http.port and http.api_key (also DISAGG_HTTP_HOST,
    DISAGG_HTTP_PORT, DISAGG_HTTP_API_KEY; a flag wins); with port 0, the default, it serves on 8000."""
    from disagg.launcher.ports import PortBusy, check_http_port
    from disagg.settings import resolve
    from disagg.settings.process import encode
    from disagg.settings.schema import SERVE_HTTP_PORT

    given = flags_from(flags)
    try:
        resolved = resolve(None, os.environ, given)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    for note in resolved.warnings:
        click.echo(f"warning: {note}", err=True)
    http = resolved.settings.http
    http.port = http.port or SERVE_HTTP_PORT
    try:
        check_http_port(http.host, http.port)
    except PortBusy as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    with make_client(endpoint, keys) as client:
        try:
            client.status()
        except Unreachable as exc:
            exit_unreachable(exc)
    from disagg.gateway.__main__ import main as gateway_main
    from disagg.launcher.deployment import gateway_settings

    settings, secrets = gateway_settings(resolved.settings, endpoint, keys or "")
    os.environ.update(secrets)
    click.echo(f"serving http://{http.host}:{http.port}/v1 for {endpoint}")
    sys.exit(gateway_main([encode(settings)]))


cli.add_command(bench)
cli.add_command(plan_command)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    # -v/--verbose belongs to the group; `disagg launch -v` means the same as `disagg -v launch`
    if args and not args[0].startswith("-") and any(a in ("-v", "--verbose") for a in args[1:]):
        args = ["-v", *[a for a in args if a not in ("-v", "--verbose")]]
    run_click(cli, args)
