"""What the orchestrator and the roles both use and neither owns: the moving average of measured times, and the
urgency order of requests. Imports nothing of ours."""
