"""What a role's compute can be extended with, apart from the worker runtime: LoRA adapters (and their host-memory
tier), step caches, the conditioning cache, and compile."""
