"""`python -m disagg` is the `disagg` command."""

from disagg.launcher.entry import main

main()
