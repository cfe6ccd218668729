"""`python -m launcher` is the `disagg` command."""

from launcher.entry import main

main()
