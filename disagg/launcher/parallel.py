"""Instances over several devices: the `parallel` config and `--gpus-per-<role>`, checked and carved into groups.

A denoiser instance of layout {cfg: c, ulysses: u, ring: r} runs c x u x r rank processes under one instance
id (disagg/roles/parallel.py). With GPUs, each instance takes a contiguous group of that many from `--gpus`
(`-d 2 --gpus-per-denoiser 4` on 0-7: denoiser-0 on 0-3, denoiser-1 on 4-7); on the CPU its ranks share
the host's cores. A layout that does not fit, or that the model cannot run, is refused before anything starts.
"""

from __future__ import annotations

from disagg.roles.layout import KINDS, describe_layout
from disagg.settings.choices import Dtype
from disagg.settings.schema import ParallelLayout  # noqa: F401 - launcher code imports it from here


def resolve_layouts(config, gpus_per: dict[str, int]) -> dict[str, ParallelLayout]:
    """role -> its layout, from `parallel:` and `--gpus-per-<role>`; a ConfigError says why one cannot be."""
    from disagg.launcher.topology import ROLE_KEYS, ConfigError
    from disagg.roles.pipelines import model_spec

    spec = model_spec(config.model)
    out: dict[str, ParallelLayout] = {}
    for role in ROLE_KEYS:
        layout = config.parallel.get(role)
        n = gpus_per.get(role) or 1
        if layout is None and n > 1:  # the model's own kind of parallelism, at that degree
            kind = "ulysses" if "ulysses" in spec.parallel else ("cfg" if "cfg" in spec.parallel and n == 2 else None)
            if kind is None:
                why = ("its transformer has no context parallelism: it runs over 2 devices only, as cfg 2"
                       if "cfg" in spec.parallel else "it runs no instance over several devices")
                raise ConfigError(f"--gpus-per-{role} {n}: model {config.model!r}: {why}")
            layout = ParallelLayout(**{kind: n})
        if layout is None or layout.world == 1:
            continue
        if n > 1 and layout.world != n:
            raise ConfigError(f"parallel.{role} {describe_layout(layout.as_dict())} is {layout.world} ranks, but "
                              f"--gpus-per-{role} is {n}: the degrees' product must equal the GPUs per instance")
        if role != "denoiser":
            raise ConfigError(f"parallel.{role}: only denoisers run over several devices ({role}s are one process "
                              "each; run more of them instead)")
        wanted = [k for k in KINDS if getattr(layout, k) > 1]
        unsupported = [k for k in wanted if k not in spec.parallel]
        if unsupported:
            takes = f"it takes {', '.join(spec.parallel)}" if spec.parallel else "it takes none"
            raise ConfigError(f"parallel.{role} {unsupported[0]}: model {config.model!r} cannot run {unsupported[0]} "
                              f"parallelism ({takes})")
        if config.denoisers.max_batch > 1:
            raise ConfigError(f"denoisers.max_batch {config.denoisers.max_batch} with a parallel denoiser: its ranks run "
                              "one request at a time, in lockstep (continuous batching would have them agree on every "
                              "step's batch); use max_batch 1")
        if config.colocated:
            raise ConfigError("a colocated deployment runs each instance in one process: no parallel layout")
        rc = config.role(role)
        gpus = rc.gpus if rc.gpus is not None else config.gpus
        if layout.ring > 1 and not gpus:
            raise ConfigError(f"parallel.{role} ring {layout.ring}: ring attention needs an attention backend that returns "
                              "its log-sum-exp (cuDNN's, on GPUs); on the CPU use ulysses")
        if layout.ring > 1 and (config.dtype == Dtype.FLOAT32 or not spec.family):
            weights = "dtype float32" if spec.family else f"model {config.model!r} (float32 weights, whatever dtype says)"
            raise ConfigError(f"parallel.{role} ring {layout.ring} with {weights}: ring attention runs cuDNN's attention "
                              "(disagg/roles/parallel.py RING_BACKEND), which takes bfloat16 or float16; use a checkpoint at "
                              "dtype auto or bfloat16, or ulysses")
        need = (rc.count + rc.standby) * layout.world
        if gpus and need > len(gpus):
            raise ConfigError(f"{rc.count + rc.standby} {role}(s) of {layout.world} GPUs each need {need} GPUs; "
                              f"--gpus gives {len(gpus)} ({','.join(map(str, gpus))})")
        out[role] = layout
    return out


def group_gpus(gpus: list[int], index: int, world: int) -> list[int]:
    """The contiguous GPUs of a role's `index`-th instance of `world` ranks."""
    return gpus[index * world:(index + 1) * world]
