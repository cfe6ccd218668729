"""The `disagg` command's entry point (and `python -m disagg`'s): Ctrl-C at any moment, even while the CLI's
modules are still being imported, ends it quietly with exit status 130 and the word "interrupted", never a
traceback. Kept light on purpose: nothing here imports more than the standard library before the CLI does."""

from __future__ import annotations

import sys

#: the exit status of a command ended by Ctrl-C (128 + SIGINT), as a shell reports it
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> None:
    try:
        from disagg.launcher.cli.main import main as cli_main  # every subcommand's module: a second or so

        cli_main(argv)
    except KeyboardInterrupt:
        interrupted()


def interrupted() -> None:
    try:
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    sys.exit(EXIT_INTERRUPTED)


def run_click(command, args: list[str]) -> None:
    """Run a click command as click's standalone mode would (usage errors: their message and status 2; --help and
    --version; a broken pipe: status 1, quietly), except for Ctrl-C: click would print "Aborted!" and exit 1, here it
    goes up to main() (130, "interrupted")."""
    import os

    import click

    try:
        code = command.main(args=args, prog_name="disagg", standalone_mode=False)
    except click.exceptions.Abort as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):
            raise exc.__cause__ from None
        click.echo("Aborted!", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except BrokenPipeError:  # `disagg status | head`: nothing more to say, and nothing on exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
