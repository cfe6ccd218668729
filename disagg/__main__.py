"""`python -m disagg` is the `disagg` command."""

from disagg.launcher.cli.entry import main

main()
