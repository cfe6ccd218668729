"""What the user runs: CLI, topology, process supervisor, dashboard, client."""
