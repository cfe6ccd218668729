"""Role processes: the worker runtime and the model pipelines it runs."""
