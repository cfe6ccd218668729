"""The largest request a deployment can hold: sizes the model makes, tensors its pools fit (torch-free)."""

from __future__ import annotations

from disagg.roles.errors import RequestError
from disagg.roles.pipelines import ROLES, ModelSpec, model_spec
from disagg.settings.choices import Dtype
from disagg.transport.wire.role_stats import MemoryStats

MIB = 1024 * 1024


class RequestTooLarge(RequestError):
    """A request whose tensors would not fit the pools of this deployment; it names the limit."""


def model_limits(model: str) -> dict[str, int]:
    """max_width / max_height / max_frames of `model` (0 = no limit), for the orchestrator's Submit check."""
    try:
        spec = model_spec(model)
    except ValueError:  # the launcher checked the model; a role started by hand learns of it at load
        return {}
    return {"max_width": spec.max_width, "max_height": spec.max_height, "max_frames": spec.max_frames}


def served_model(model: str, dtype: str):
    """The ModelIdentity an instance of `model` registers with (None if the model cannot be read here: its
    load then fails and says why)."""
    from disagg.roles.pipelines import model_identity
    from disagg.transport.wire.messages import ModelIdentity

    try:
        return ModelIdentity(**model_identity(model, dtype))
    except ValueError:
        return None


class PoolFit:
    """Checks, before any compute, that a request's tensors fit every role's pool.

    A role holds a request's input and its output at once (the input until the output is staged),
    so both must fit its pool. Checked by the first stage, which knows every pool's size from the
    launcher, so an oversized request fails at once instead of after its encoding and denoising."""

    def __init__(self, spec: ModelSpec, pools: dict[str, int]):
        self.spec = spec
        self.pools = {role: pools[role] for role in ROLES if pools.get(role)}

    def check(self, p: dict) -> None:
        w, h, n = p["width"], p["height"], p["num_images_per_prompt"]
        for i, role in enumerate(ROLES):
            pool = self.pools.get(role)
            if pool is None:
                continue
            need = self.spec.output_bytes(role, w, h, n) + (self.spec.output_bytes(ROLES[i - 1], w, h, n) if i else 0)
            if need > pool:
                raise RequestTooLarge(
                    f"{n} image(s) of {w}x{h} need {need / MIB:.1f} MiB in a {role}'s pool, which holds "
                    f"{pool / MIB:.1f} MiB ({role}s.pool_mib in the config): ask for fewer images or a smaller "
                    "size, or give that pool more memory")


def device_memory(device: str) -> int:
    """Bytes of memory of `device`: a GPU's total, the host's RAM for the CPU; 0 for a simulated device (unknown)."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    if device == "cpu":
        import psutil

        return int(psutil.virtual_memory().total)
    return 0


def device_free_memory(device: str) -> int:
    """Bytes free on `device` now, as the driver counts them (every process on a GPU: torch.cuda.mem_get_info); 0
    where unknown (the CPU, a simulated device): rebalance then checks against the device's total."""
    if not device.startswith("cuda"):
        return 0
    import torch

    try:
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    except (RuntimeError, AssertionError):  # a heartbeat must go on: unknown, as on the CPU
        return 0


def memory_stats(device: str, dtype: str, components: dict[str, int], adapter=None, pool_bytes: int = 0,
                 cache_bytes: int = 0) -> MemoryStats:
    """What its heartbeats say of its device's memory (MemoryStats). `adapter`: one with a memory model (a simulated
    device of a declared class) says its weights, peak and device itself; `pool_bytes`: its transfer pool's, where
    the pool is on the device; `cache_bytes`: what its caches hold there."""
    if adapter is not None and adapter.capabilities.memory_model:
        total, weights, peak = adapter.device_memory, adapter.weights_bytes(), adapter.activation_peak
        used = adapter.others_bytes + weights + peak + cache_bytes  # the others' weights on a shared device too
        return MemoryStats(device=adapter.device_class, total_bytes=total, weights_bytes=weights, cache_bytes=cache_bytes,
                           activation_peak_bytes=peak, free_bytes=max(total - used, 0) if total else 0)
    weights = sum(components.values()) * param_bytes(dtype, device)
    stats = MemoryStats(free_bytes=device_free_memory(device), weights_bytes=weights, pool_bytes=pool_bytes,
                        cache_bytes=cache_bytes)
    if device.startswith("cuda"):
        import torch

        try:
            dev = torch.device(device)
            stats.device, stats.total_bytes = torch.cuda.get_device_name(dev), device_memory(device)
            # what torch allocated at its peak, less what stays allocated for good
            stats.activation_peak_bytes = max(torch.cuda.max_memory_allocated(dev) - weights - pool_bytes - cache_bytes, 0)
        except (RuntimeError, AssertionError):  # a heartbeat must go on
            pass
    return stats


def param_bytes(dtype: str, device: str) -> int:
    """Bytes per weight at `dtype` (auto: bfloat16 on a GPU, float32 elsewhere)."""
    if dtype == Dtype.AUTO:
        return 2 if device.startswith("cuda") else 4
    return 4 if dtype == Dtype.FLOAT32 else 2
