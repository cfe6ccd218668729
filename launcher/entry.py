"""The `disagg` command's entry point (and `python -m launcher`'s): Ctrl-C at any moment, even while the CLI's
modules are still being imported, ends it quietly with exit status 130 and the word "interrupted", never a
traceback. Kept light on purpose: nothing here imports more than the standard library before the CLI does."""

from __future__ import annotations

import sys

#: the exit status of a command ended by Ctrl-C (128 + SIGINT), as a shell reports it
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> None:
    try:
        from launcher.cli import main as cli_main  # every subcommand's module: a second or so

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
