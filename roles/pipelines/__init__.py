"""Model adapters, one per family: each loads only what its role needs and splits the pipeline."""

from __future__ import annotations

MODELS = ("tiny",)


class ModelError(ValueError):
    """A model name or path that no adapter can serve."""


def load_adapter(model: str, role: str, device: str = "cpu"):
    """The adapter for `model`, holding only `role`'s components, on `device`."""
    if model == "tiny":
        from roles.pipelines.tiny import TinyFluxAdapter

        return TinyFluxAdapter(role, device)
    raise ModelError(f"unknown model {model!r}: this version serves {', '.join(MODELS)}")
