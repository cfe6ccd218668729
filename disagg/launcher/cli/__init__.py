"""The `disagg` command: its entry point, the commands and their options (from the settings schema), the live
table, prompt files and batches. Supervision (starting and watching processes) is disagg/launcher/; `disagg bench` is
disagg/launcher/bench/."""
