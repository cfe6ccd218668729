"""`python -m launcher` is the `disagg` command."""

from launcher.cli import main

main()
