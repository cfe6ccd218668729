"""The gateway's routes, one module per API: images, videos, and the deployment's own (operations)."""
