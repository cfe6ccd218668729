"""What the `disagg` commands share: exit codes, the --endpoint and --keys options, a console and a client."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console

from disagg.client import Client, default_endpoint
from disagg.transport.environment import DISAGG_KEYS

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3

keys_option = click.option(
    "--keys", type=click.Path(file_okay=False), default=lambda: os.environ.get(DISAGG_KEYS),
    help="CurveZMQ keys directory (from `disagg keys generate`), when the deployment uses them. [default: $DISAGG_KEYS]",
)

def check_endpoint(ctx, param, value: str) -> str:
    """tcp://HOST:PORT, or a usage error (exit 2) that says so. Every client command takes --endpoint, so its
    check is where they refuse a mistyped DISAGG_ variable as `launch` does (DISAGG_ENDPIONT would be ignored)."""
    from disagg.settings.sources import SettingsError, check_variables

    try:
        check_variables(os.environ)
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    host, sep, port = value.removeprefix("tcp://").rpartition(":")
    if not value.startswith("tcp://") or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{value!r} is not a tcp://HOST:PORT address (e.g. tcp://127.0.0.1:5555)")
    return value


endpoint_option = click.option(
    "--endpoint", default=default_endpoint, show_default="$DISAGG_ENDPOINT or tcp://127.0.0.1:5555",
    callback=check_endpoint, help="The orchestrator's client endpoint, tcp://HOST:PORT.",
)


def make_console() -> Console:
    # piped output (logs, tests, scripts) gets the whole table rather than 80 squeezed columns
    return Console() if sys.stdout.isatty() else Console(width=200)


def exit_unreachable(exc: Exception) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(EXIT_UNREACHABLE)


def make_client(endpoint: str, keys_dir: str | None) -> Client:
    if not keys_dir:
        return Client(endpoint)
    from disagg.transport.wire.auth import KeyError_, client_curve

    try:
        return Client(endpoint, curve=client_curve(Path(keys_dir)))
    except KeyError_ as exc:
        raise click.BadParameter(str(exc), param_hint="--keys") from None


def int_list(text: str | None, name: str, length: int | None = None) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=name) from None
    if length is not None and len(values) != length:
        raise click.BadParameter(f"expected {length} comma-separated integers, got {text!r}", param_hint=name)
    if any(v < 0 for v in values):
        raise click.BadParameter("values must not be negative", param_hint=name)
    return values
