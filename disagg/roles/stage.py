"""One role's compute, free of sockets: inputs in, outputs (tensors or encoded images) out."""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
from dataclasses import dataclass, field

import msgspec
import torch

from disagg.roles.errors import GroupBroken, RequestError
from disagg.roles.media import check_format, encode_image, encode_mp4
from disagg.roles.pipelines.adapter import ModelAdapter, check_adapter
from disagg.roles.pipelines.conditioned import LAYOUT, InputError
from disagg.settings.choices import Schedule
from disagg.settings.fields import default
from disagg.transport.wire.messages import GenerationParams
from disagg.transport.wire.params import conditioning_key, lora_label


def one_forward_at_a_time(model) -> None:
    """A batching denoiser's transformer also serves image tasks, which run their own pipeline call beside the
    batcher's loop (conditioned.py): their forwards take turns, step by step, instead of overlapping."""
    if model is None:
        return
    forward, lock = model.forward, threading.Lock()

    def locked(*args, **kw):
        with lock:
            return forward(*args, **kw)

    model.forward = locked


class Stopped(Exception):
    """A follower rank's request that rank 0 stopped (its client cancelled it)."""


@dataclass
class Call:
    """One compute's request: its parameters as sent (`params`, `given`: those it set) and with the model's
    defaults filled in (`p`), the format it is answered in, its inputs, and the step scheduler's hooks."""

    params: GenerationParams
    given: dict
    p: dict
    fmt: str
    inputs: dict[str, torch.Tensor]
    progress: object = None
    ticket: object = None


@dataclass
class StageOutput:
    """What a stage produced: tensors to stage for the next role, or the final encoded images."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    images: list[bytes] = field(default_factory=list)
    image_format: str = "png"
    #: this request's share of device seconds when it shared a batched forward (None: compute time)
    device_s: float | None = None
    #: the parameters the model ran with, its defaults filled in (the client's manifest records them)
    resolved: dict = field(default_factory=dict)
    #: a step cache's label and counts (cache, steps_computed, steps_skipped); empty without one
    cache_steps: dict = field(default_factory=dict)
    #: an encoder's output taken from its conditioning cache: nothing was computed
    from_cache: bool = False


def params_dict(params: GenerationParams) -> dict:
    """Request parameters as a plain dict, without the ones left to the model's defaults."""
    return {k: v for k, v in msgspec.structs.asdict(params).items() if v is not None}


#: parameters a decoder reports back (and writes into a PNG's text chunks)
RESOLVED = ("prompt", "negative_prompt", "seed", "width", "height", "num_inference_steps", "guidance_scale",
            "num_images_per_prompt", "num_frames", "strength")


def resolved(p: dict, model: str) -> dict:
    """What a result reports of the parameters it ran with; a folder checkpoint by its folder's name, never the
    server's path (it lands in the PNG's text chunks and the answer)."""
    if os.path.isabs(model):
        model = os.path.basename(os.path.normpath(model))
    out = {**{k: p[k] for k in RESOLVED if p.get(k) is not None}, "model": model}
    if p.get("loras"):  # "A:1,B:0.5": the adapters and scales it applied
        out["loras"] = lora_label(p["loras"])
    return out


class Stage:
    """Runs one role's part of the pipeline through a model adapter.

    A diffusers pipeline keeps per-call state (its scheduler's step index, `_guidance_scale`, Wan's VAE
    feature cache), so with a capacity above 1 the computes of one instance take turns (`turn`) unless
    the adapter says it is safe to share (`thread_safe`). Their transfers still overlap; a denoiser that
    should run requests together batches them (`max_batch`, one thread drives every forward)."""

    def __init__(self, role: str, adapter: ModelAdapter, max_batch: int = 1, fit=None, model: str = "", sync=None, group=None,
                 loras=None, schedule: Schedule = default("schedule.order"), aging_s: float = default("schedule.aging_s"),
                 caches=None, conditioning=None):
        self.role = role
        self.adapter = adapter
        #: what the adapter can do (pipelines/adapter.py), checked against its methods
        self.caps = caps = check_adapter(adapter)
        #: the compute of this role: one path each (a colocated instance runs all three stages: `_monolith`)
        self._compute_role = {"encoder": self._encoder, "denoiser": self._denoiser, "decoder": self._decoder,
                              "monolith": self._monolith}[role]
        self.model = model
        #: the step caches of a denoiser's transformer (disagg/roles/extensions/step_cache.py); None: it runs none
        self.caches = caches
        #: an encoder's recent encodings (disagg/roles/extensions/conditioning.py); None: off
        self.conditioning = conditioning if role == "encoder" else None
        #: the LoRA adapters this instance holds (disagg/roles/extensions/loras.py); None: it applies none
        self.loras = loras
        #: the first stage checks that a request's tensors fit every pool (disagg/roles/limits.py PoolFit)
        self.fit = fit if role in ("encoder",) else None
        self.batcher = None
        if role == "denoiser" and max_batch > 1:
            if not caps.batching:
                raise ValueError(f"{type(adapter).__name__} cannot batch denoising steps; run it with max_batch 1")
            from disagg.roles.batcher import StepBatcher

            self.batcher = StepBatcher(adapter, max_batch, sync=sync, loras=loras, schedule=schedule, aging_s=aging_s,
                                       caches=caches, memory_limit=adapter.batch_limit if caps.memory_model else None)
            if caps.family:
                one_forward_at_a_time(getattr(adapter.pipe, "transformer", None))
        shared = self.batcher is not None or caps.thread_safe
        #: an instance over several ranks (disagg/roles/parallel.py): they run one request at a time, in lockstep
        self.group = group if role == "denoiser" else None
        if self.group is not None and self.batcher is not None:
            raise ValueError("a denoiser over several ranks does not batch requests; run it with max_batch 1")
        self.turn = contextlib.nullcontext() if shared and self.group is None else threading.Lock()
        #: schedule slo: the held requests' computes take the device by urgency and hand it over at step
        #: boundaries (disagg/roles/turns.py); None: `turn` as above. Not for batching or multi-rank instances
        self.turns = None
        #: the schedule (fifo or slo): under slo, a batching denoiser re-forms its batch at every step by urgency
        self.schedule = schedule
        #: an encoder's or decoder's computes are ordered by urgency too where they take turns anyway (not
        #: thread-safe, or on one simulated device); a decoder that can (`decode_yields`) hands the device over
        #: between a video's latent frames
        serial = not shared or caps.one_device
        if schedule == Schedule.SLO and self.batcher is None and self.group is None and (
                role in ("denoiser", "monolith") or (role in ("encoder", "decoder") and serial)):
            from disagg.roles.turns import Turns

            self.turns = Turns(aging_s)

    def ticket(self, request_id: str, params: GenerationParams, deadline_s: float | None, steps: int):
        """The step scheduler's view of one request (schedule slo: `turns`, or the batcher's), or None."""
        if self.turns is None and (self.batcher is None or self.schedule != Schedule.SLO):
            return None
        from disagg.roles.turns import Ticket

        # an encode or decode is one step (a decode that yields hands over between its video's latent frames)
        steps = steps if self.role in ("denoiser", "monolith") else 1
        return Ticket(request_id, priority=params.priority or 0, steps=steps,
                      deadline=None if deadline_s is None else time.monotonic() + deadline_s,
                      shape=(params.width, params.height, params.num_frames, params.num_images_per_prompt))

    def _yielding(self, progress, ticket):
        """`progress` that also hands the device to a more urgent request at each step (schedule slo)."""
        if ticket is None:
            return progress

        def step(*args) -> None:
            if progress is not None:
                progress(*args)
            self.turns.step(ticket)
        return step

    def _own(self):
        """The adapter for one compute that may hand the device over mid-way: a thread-safe adapter itself;
        else a copy whose diffusers pipeline is a shallow copy with its own scheduler, so the per-call state
        (the scheduler's step index, `_guidance_scale`, ...) is the call's own and the modules are shared."""
        adapter = self.adapter
        if self.caps.thread_safe or not self.caps.family:
            return adapter
        pipe = adapter.pipe
        own = copy.copy(adapter)
        own_pipe = copy.copy(pipe)
        object.__setattr__(own_pipe, "scheduler", copy.deepcopy(pipe.scheduler))
        own.pipe = own_pipe
        return own

    def run(self, params: GenerationParams, inputs: dict[str, torch.Tensor], progress=None,
            ticket=None) -> StageOutput:
        """`progress()` is called at each denoising step, so a live role is told from a hung one. `ticket`
        (schedule slo): the request's place in `turns`, whose turn the caller holds."""
        if self.group is None:
            return self._run(params, inputs, progress, ticket)
        from disagg.roles.parallel import is_group_failure

        if self.group.leader:
            self.group.share(params, inputs)
        try:
            return self._run(params, inputs, self._in_lockstep(progress))
        except Exception as exc:
            if is_group_failure(exc) and not isinstance(exc, GroupBroken):  # a collective inside the forward
                raise GroupBroken(f"the instance's ranks lost each other ({type(exc).__name__}: {exc})") from exc
            raise

    def _in_lockstep(self, progress):
        """Each step, rank 0 tells every rank whether the request goes on (it may have been cancelled)."""
        group = self.group

        def step(*_args) -> None:
            stopped = None
            if progress is not None:
                try:
                    progress()
                except Exception as exc:  # noqa: BLE001 - Cancelled, on rank 0: the others stop with it
                    stopped = exc
            if not group.go_on(stopped is not None):
                raise stopped or Stopped("rank 0 stopped this request")
        return step

    # --- step caches (disagg/roles/extensions/step_cache.py) ------------------------------------------------------------------

    def _cache_spec(self, p: dict, given: dict) -> dict | None:
        """The step cache this request runs with (its own, else the deployment's), checked; None for none."""
        from disagg.roles.extensions.step_cache import request_spec

        default = self.caches.default if self.caches is not None else None
        spec = request_spec(given.get("cache"), default)
        if spec is None:
            return None
        if self.caches is None:  # the deployment's default is for the models that have one; a request's own is refused
            raise RequestError(f"cache: model {self.model!r} has no diffusers transformer to cache", param="cache")
        self.caches.check(spec, p["num_inference_steps"])
        return spec

    def _cached(self, spec: dict | None, p: dict, adapter):
        """The request's cache enabled on the transformer while it denoises (a null context without one)."""
        if spec is None:
            return contextlib.nullcontext()
        pipe = adapter.pipe
        return self.caches.use(spec, p["num_inference_steps"], lambda: pipe.current_timestep)

    @staticmethod
    def _counting(progress, count):
        """`progress` that also closes each step of a step cache's count."""
        if count is None:
            return progress

        def step(*args) -> None:
            count.step()
            if progress is not None:
                progress(*args)
        return step

    @staticmethod
    def _counted(spec: dict | None, count) -> dict:
        if spec is None or count is None:
            return {}
        from disagg.transport.wire.params import cache_label

        return {"cache": cache_label(spec), **count.as_dict()}

    def _run(self, params: GenerationParams, inputs: dict[str, torch.Tensor], progress=None,
             ticket=None) -> StageOutput:
        if self.loras is None or self.role == "decoder":
            return self._compute(params, inputs, progress, ticket)
        with self.loras.use(params.loras):  # this thread's forwards apply the request's adapters only
            return self._compute(params, inputs, progress, ticket)

    def _compute(self, params: GenerationParams, inputs: dict[str, torch.Tensor], progress=None,
                 ticket=None) -> StageOutput:
        return self._compute_role(self._call(params, inputs, progress, ticket))

    def _call(self, params: GenerationParams, inputs: dict[str, torch.Tensor], progress, ticket) -> Call:
        """The request as every role's compute takes it, checked: a request the model cannot serve fails here,
        before any compute (every role checks, so a format the model cannot make fails in the first)."""
        caps = self.caps
        given = params_dict(params)
        p = {**self.adapter.defaults(), **given}
        fmt = check_format(params.response_format, caps.video)
        if self.fit is not None:
            self.fit.check(p)
        if caps.image_tasks and (given.get("image") is not None or "image_pixels" in inputs):
            # an image task's size is its image's (or its pipeline's choice) unless the request names one
            for name in ("width", "height"):
                if name not in given:
                    p.pop(name, None)
        if not caps.image_tasks and not caps.image_inputs and (p.get("image") is not None or p.get("mask") is not None):
            raise InputError(f"model {self.model!r} takes text-to-image (a prompt) only: it takes no image or mask",
                             param="image")
        return Call(params, given, p, fmt, inputs, progress, ticket)

    def _task(self, p: dict) -> str | None:
        """The image task whose pipeline runs this request (conditioned.py), or None for the adapter's own path."""
        if not self.caps.image_tasks:
            return None
        task = self.adapter.tasks.check(p)
        return task if self.adapter.tasks.generic(task) else None

    # --- one compute per role -----------------------------------------------------------------------------------

    def _encoder(self, call: Call) -> StageOutput:
        key = conditioning_key(call.params, self.caps.conditioning_depends) if self.conditioning is not None else None
        if key is not None:
            hit = self.conditioning.get(key)
            if hit is not None:
                return StageOutput(tensors=hit, from_cache=True)
        task = self._task(call.p)
        # an image task: its pipeline up to its denoising loop (conditioned.py)
        tensors = self.adapter.tasks.encode(call.p, task) if task is not None else self.adapter.encode(call.p)
        if key is not None:
            self.conditioning.put(key, tensors)
        return StageOutput(tensors=tensors)

    def _step_cache(self, call: Call) -> dict | None:
        """The step cache a denoising role runs this request with (none for an image task's pipeline)."""
        cache = self._cache_spec(call.p, call.given)
        if cache is not None and self.caps.image_tasks and (LAYOUT in call.inputs or self._task(call.p) is not None):
            raise RequestError("cache: image tasks run without a step cache", param="cache")
        return cache

    def _denoise(self, call: Call, cache: dict | None, encode: bool = False):
        """The adapter's own denoising loop, one request (after its encoding, where `encode`): (latents, the step
        cache's counts). Under schedule slo it may yield the device at its steps (on its own pipeline state); one
        with a step cache keeps it."""
        ticket = call.ticket if self.turns is not None and cache is None else None
        adapter = self._own() if ticket is not None else self.adapter
        inputs = adapter.encode(call.p) if encode else call.inputs
        with self._cached(cache, call.p, adapter) as count:
            tensors = adapter.denoise(inputs, call.p,
                                      progress=self._counting(self._yielding(call.progress, ticket), count))
        return tensors, self._counted(cache, count)

    def _denoiser(self, call: Call) -> StageOutput:
        cache = self._step_cache(call)
        if self.caps.image_tasks and LAYOUT in call.inputs:  # what the encoder recorded, replayed
            return StageOutput(tensors=self.adapter.tasks.denoise(call.inputs, call.p, call.progress))
        if self.batcher is not None:
            tensors, device_s, counted = self.batcher.denoise(call.inputs, {**call.p, "cache": cache}, call.progress,
                                                              call.ticket)
            return StageOutput(tensors=tensors, device_s=device_s, cache_steps=counted)
        tensors, counted = self._denoise(call, cache)
        return StageOutput(tensors=tensors, cache_steps=counted)

    def _monolith(self, call: Call) -> StageOutput:
        """Colocated: all three stages here, nothing leaves the process. Its decode never yields the device."""
        cache = self._step_cache(call)
        task = self._task(call.p)
        if task is not None:
            latents, counted = self.adapter.tasks.whole(call.p, task, call.progress), {}
        else:
            latents, counted = self._denoise(call, cache, encode=True)
        return self._decoded(call, latents, counted, {})

    def _decoder(self, call: Call) -> StageOutput:
        # schedule slo: a decode that can yields the device between a video's latent frames
        yields = {"progress": self._yielding(None, call.ticket)} if (
            self.turns is not None and call.ticket is not None and self.caps.decode_yields) else {}
        return self._decoded(call, call.inputs, {}, yields)

    def _decoded(self, call: Call, latents: dict[str, torch.Tensor], counted: dict, yields: dict) -> StageOutput:
        """Decode and encode the images (or videos): the answer."""
        p, fmt = call.p, call.fmt
        params_used = resolved(p, self.model)
        # the client knows its prompts: the wire carries the rest
        done = {k: v for k, v in params_used.items() if k not in ("prompt", "negative_prompt")}
        if self.caps.encoded_output:  # an adapter that has its output bytes at hand (sim)
            return StageOutput(images=self.adapter.decode_encoded(latents, p, fmt, **yields), image_format=fmt,
                               resolved=done, cache_steps=counted)
        outputs = self.adapter.decode(latents, p, **yields)
        first = outputs[0] if outputs else None
        first = first[0] if isinstance(first, list) and first else first
        if hasattr(first, "size"):  # an image task may keep its input's size: report the size it made
            params_used["width"], params_used["height"] = first.size
            done.update(width=first.size[0], height=first.size[1])
        if fmt == "mp4":  # one list of frames per video
            return StageOutput(images=[encode_mp4(frames, p.get("fps", 16)) for frames in outputs], image_format=fmt,
                               resolved=done, cache_steps=counted)
        if self.caps.video:  # lossless frames: each video's frames in order
            outputs = [frame for frames in outputs for frame in frames]
        return StageOutput(images=[encode_image(im, fmt, params_used) for im in outputs], image_format=fmt, resolved=done,
                           cache_steps=counted)
