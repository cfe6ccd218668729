"""`disagg plan --config FILE --trace FILE`: the throughput model (disagg/orchestrator/parts/planner.py) run offline on a trace
(the `bench --trace` format): which split of the config's devices between the roles serves the trace's mix best.

Stage times come from the model's sim profile (disagg/roles/pipelines/sim_profiles: `sim:NAME`, or `sim:PATH.yaml`), per request size
and steps, a denoiser's batched at `denoisers.max_batch` (full batches: its profile's batch curve). A running
deployment plans from what it measures instead (`--rebalance advise`: `disagg status`).
"""

from __future__ import annotations

from disagg.orchestrator.parts.planner import ROLES, Plan, Work, fmt, plan
from disagg.roles.pipelines.sim_profile import load_profile
from disagg.settings import Settings


class PlanError(ValueError):
    """The config or trace cannot be planned for; the message says why."""


def stage_seconds(config: Settings):
    """predict(role, trace line) -> seconds of device time per request, from the config's sim profile."""
    if not config.model.startswith("sim:"):
        raise PlanError(f"offline plans take stage times from a sim profile (model sim:NAME); {config.model!r} has "
                        "none: plan it with the sim profile of its model, or launch it with --rebalance advise, "
                        "which plans from measured times (disagg status)")
    try:
        profile = load_profile(config.model[4:])
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    batch = config.denoisers.max_batch

    def predict(role: str, line) -> float:
        p = {"width": line.width or 1024, "height": line.height or 1024, "num_frames": line.num_frames}
        prof, pixels = profile.for_request(p)
        steps = line.num_inference_steps or 4
        ms = prof.stage_ms(role, pixels, steps)
        if role == "denoiser" and batch > 1:  # each request's share of full batches' steps
            ms -= steps * prof.denoiser.step_ms(pixels) * (1 - prof.denoiser.batch_factor(pixels, batch) / batch)
        return ms / 1000

    return predict


def plan_trace(config: Settings, lines) -> tuple[Plan, Work]:
    if config.colocated:
        raise PlanError("colocated instances run every stage: there is no split to plan")
    counts = {r: config.role(r).count for r in ROLES}
    if sum(counts.values()) < len(ROLES):
        raise PlanError(f"the config has {sum(counts.values())} devices; a split needs at least {len(ROLES)}")
    work = Work.of(((line, 1) for line in lines), stage_seconds(config))
    return plan(work, counts, config.rebalance.min_per_role), work


def plan_doc(p: Plan, work: Work) -> dict:
    return {
        "current": fmt(p.current), "current_rps": round(p.current_rps, 4),
        "recommended": fmt(p.best), "recommended_rps": round(p.best_rps, 4),
        "gain": round(p.gain, 4) if p.gain != float("inf") else None,
        "requests": work.requests, "work_s": {r: round(s, 6) for r, s in work.seconds.items()},
        "considered": [{"split": fmt(s), "rps": round(r, 4)} for s, r in p.considered],
    }
