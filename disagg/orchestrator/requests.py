"""A request's life in the orchestrator: stage, attempt, timestamps, and where its data lies."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import msgspec

from disagg.transport.wire.messages import GenerationParams, Source
from disagg.transport.wire.params import lora_key

STAGES = ("encoder", "denoiser", "decoder")
#: a colocated instance runs all three stages of a request in one process
MONOLITH = "monolith"
#: every role the orchestrator queues for, in display order
ROLES = STAGES + (MONOLITH,)


_NEXT = {**dict(zip(STAGES, STAGES[1:] + (None,))), MONOLITH: None}
_PREVIOUS = dict(zip(STAGES[1:], STAGES))


class Names:
    """The names of a role's marks and timings in a request (`staged_denoiser`, ...), built once per role: the
    Router writes a dozen per stage."""

    def __init__(self, role: str):
        previous = _PREVIOUS.get(role)
        self.queued, self.run, self.staged = f"queued_{role}", f"run_{role}", f"staged_{role}"
        self.queue, self.stage, self.compute = f"queue_{role}", f"stage_{role}", f"compute_{role}"
        self.fetch, self.lora, self.handoff = f"fetch_{role}", f"lora_{role}", f"handoff_{role}"
        #: the previous stage's staged mark (None for the first stage)
        self.previous_staged = f"staged_{previous}" if previous else None


#: role -> its Names
NAMES = {role: Names(role) for role in ROLES}


def next_stage(role: str) -> str | None:
    return _NEXT[role]


@dataclass
class Request:
    """One submitted request, kept until it ends so it can always be retried."""

    id: str
    params: GenerationParams
    #: every client waiting for it: its Result goes to each (one that sent it again after a restart, or
    #: through another gateway, joins instead of starting a second run)
    clients: list[bytes]
    submitted_at: float
    deadline: float
    attempt: int = 1
    stage: str = "encoder"
    #: queued | running | done | failed, or parked: sent during a restarted orchestrator's recovery window,
    #: placed when it closes (disagg/orchestrator/parts/recovery.py)
    state: str = "queued"
    assigned: str | None = None
    #: the previous stage's output, staged in its producer's pool, until the consumer fetched it
    source: Source | None = None
    source_frames: list[bytes] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)
    #: where its LoRA adapters lie (name -> source), resolved at Submit; every Run carries it
    lora_sources: dict[str, str] = field(default_factory=dict)
    #: when it should be done (submitted_at + params.slo_ms), None without slo_ms (disagg/orchestrator/scheduling/deadlines.py)
    slo_deadline: float | None = None
    #: its denoiser's step cache: label and counts (Staged's cache, steps_computed, steps_skipped), for its Result
    cache_steps: dict = field(default_factory=dict)
    #: the index of the last live preview sent to its clients: one that decodes after a newer one is dropped
    #: (disagg/orchestrator/parts/previews.py)
    last_preview: int = -1
    #: instances reserved for its next stages, in order, each as (id, session): their Runs travel inside the Run of
    #: the stage before (Run.then) and that stage's instance sends them on (disagg/orchestrator/forwards.py)
    reserved: list[tuple[str, int]] = field(default_factory=list)
    #: reports of a reserved instance that came before the Staged of the stage before it: (sender, msg, frames),
    #: handled once that Staged is
    early: list[tuple] = field(default_factory=list)

    @functools.cached_property
    def conditioning_key(self) -> int | None:
        """What its encoding depends on (the fields transport.params.conditioning_key reads: prompts, guidance, images
        per prompt, adapters), as Python's hash of them: requests with equal keys may reuse one encoding
        (ConditioningAffinity sends them to one encoder; a collision only misplaces a hint). None with an input image
        or mask, whose encoding is the image's too."""
        p = self.params
        if p.image is not None or p.mask is not None:
            return None
        return hash((p.prompt, p.negative_prompt, p.guidance_scale, p.num_images_per_prompt, lora_key(p.loras)))

    def params_for(self, role: str) -> GenerationParams:
        """What a stage's Run carries: the input image and mask go to the first stage only."""
        p = self.params
        if role in ("encoder", "monolith") or (p.image is None and p.mask is None):
            return p
        return msgspec.structs.replace(p, image=None, mask=None)

    @property
    def ended(self) -> bool:
        return self.state in ("done", "failed")

    def mark(self, name: str, now: float) -> None:
        self.marks[name] = now

    def span(self, name: str, start: str, end: str) -> None:
        marks = self.marks
        t0, t1 = marks.get(start), marks.get(end)
        if t0 is not None and t1 is not None:
            self.timings[name] = micro(t1 - t0)


def micro(seconds: float) -> float:
    """`seconds` to the microsecond, as a request's timings keep them: round(seconds, 6) at a quarter of its cost (a
    request's stages take nine), the same value unless seconds x 1e6 lies within a rounding error of a half."""
    return round(seconds * 1e6) / 1e6


_LIMIT_KEYS = {"width": "max_width", "height": "max_height", "num_frames": "max_frames"}


def over_limits(limits: dict[str, int], p) -> tuple[str, str] | None:
    """(the field, why) a deployment with these limits (max_width, max_height, max_frames; 0 = none) cannot
    make a request of parameters `p`, or None when it can."""
    if not limits:
        return None
    for name, value in (("width", p.width), ("height", p.height), ("num_frames", p.num_frames)):
        limit = limits.get(_LIMIT_KEYS[name], 0)
        if value is not None and limit and value > limit:
            return name, f"{name} {value} is over this deployment's maximum of {limit}"
    return None
