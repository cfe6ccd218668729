"""Role processes: the worker runtime (socket loop, compute, batching, turns), its extensions (extensions/: LoRA,
caches, compile) and the model pipelines it runs (pipelines/)."""
