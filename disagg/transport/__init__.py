"""Shared by orchestrator and roles, in two halves: wire/ (every message, its framing, the same-host lane, error
codes, keys) and data/ (tensor manifests, buffer pools, transfer engines); and the environment variables
(environment.py) and the launcher watch (parent.py).

Imports nothing else of disagg. Only `wire`, `data.allocator` and `data.selection` are torch-free, so the
orchestrator and the CLI stay light.
"""
