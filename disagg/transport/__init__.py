"""Shared by orchestrator and roles: wire messages, tensor manifests, buffer pools, transfer engines.

Imports nothing else of disagg. Only `messages`, `allocator` and `selection` are torch-free, so
the orchestrator and the CLI stay light.
"""
