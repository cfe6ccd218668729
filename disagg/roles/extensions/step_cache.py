"""Step caches: diffusers' own cache hooks (FirstBlockCache, MagCache, TaylorSeer, FasterCache, Pyramid Attention
Broadcast, SeaCache), per request, on a denoiser's transformer.

A request names one in its `cache` field (`{"type": "first_block", "threshold": 0.2}`), or the deployment's
`cache` setting gives it one. The other keys are the diffusers config's own fields, with its own bounds; a
field that takes a function (`current_timestep_callback`, ...) is this module's to set, not a request's.

A transformer holds one cache config at a time, and a cache's state (the last step's residuals) lives in its
hooks: a request with a cache enables its config when its denoising starts, keeps the device until its last
step (it does not yield at step boundaries), and disables it at the end. So every cached request starts from
a fresh state, and no other request's forward runs through its hooks.

Steps computed and skipped: forward hooks on each attention's `to_q`, registered while a cached request runs, count
the attentions that ran. A step in
which every attention of every forward ran is computed; one in which the cache stood in for any is skipped.

On a compiled denoiser (disagg/roles/extensions/compile.py) a cached request runs the transformer uncompiled, so these hooks and
diffusers' run in Python: its counts and images are the uncompiled denoiser's, and it compiles nothing.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import fields

import torch

from disagg.roles.errors import RequestError

#: a request's `type` -> the diffusers config class
TYPES = {
    "first_block": "FirstBlockCacheConfig",
    "mag": "MagCacheConfig",
    "taylorseer": "TaylorSeerCacheConfig",
    "faster": "FasterCacheConfig",
    "pyramid_attention_broadcast": "PyramidAttentionBroadcastConfig",
    "sea": "SeaCacheConfig",
}
#: "none": no cache for this request, whatever the deployment's default
NONE = "none"
#: family -> type -> why its pipeline cannot use it (measured on the tiny checkpoints, diffusers 0.42)
UNSUPPORTED = {
    "flux": {"sea": "FluxPipeline gives its transformer no step index, which SeaCache needs (it would compute "
                    "every step)"},
    "wan": {"faster": "FasterCache needs the conditional and unconditional rows in one forward; WanPipeline runs "
                      "them as two",
            "taylorseer": "TaylorSeer's hooks leave WanTransformer3DModel's blocks computing every step"},
    "sdxl": {t: "SDXL's UNet has no diffusers cache hooks" for t in TYPES},
}
#: config fields that take a function: this module sets the ones it can
CALLBACKS = ("current_timestep_callback", "attention_weight_callback", "low_frequency_weight_callback",
             "high_frequency_weight_callback", "raw_vision_callback")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _error(msg: str) -> RequestError:
    return RequestError(f"cache: {msg}", param="cache")


def _count(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def config_of(spec: dict, family: str, steps: int, timestep) -> object:
    """The diffusers config for a request's `cache` spec; a RequestError naming the field otherwise.

    `timestep()`: the current denoising timestep (0..1000), for the caches that read it."""
    import diffusers
    from diffusers.hooks import mag_cache

    kind = spec.get("type")
    if kind not in TYPES:
        raise _error(f"type must be one of {', '.join([*TYPES, NONE])}, not {kind!r}")
    why = UNSUPPORTED.get(family, {}).get(kind)
    if why:
        raise _error(f"{kind} does not work with this model: {why}")
    cls = getattr(diffusers, TYPES[kind])
    known = {f.name: f for f in fields(cls) if not f.name.startswith("_")}
    kwargs = {}
    for name, value in spec.items():
        if name == "type":
            continue
        if name not in known or name in CALLBACKS:
            settable = sorted(n for n in known if n not in CALLBACKS)
            raise _error(f"{kind} takes no field {name!r}; it takes {', '.join(settable) or 'none'}")
        default = known[name].default
        if _count(default) and not (_count(value) and value >= 0):
            # diffusers takes threshold -1 or a step count "x" as they are (a cache that never skips, or a
            # TypeError mid-request): a number field with a number default is a count or a bound, >= 0
            raise _error(f"{kind}: {name} must be a number >= 0 (default {default}), not {value!r}")
        if isinstance(value, list) and isinstance(default, tuple):
            value = tuple(value)
        if name == "taylor_factors_dtype":
            if value not in DTYPES:
                raise _error(f"taylor_factors_dtype must be one of {', '.join(DTYPES)}")
            value = DTYPES[value]
        kwargs[name] = value
    if kind == "mag":
        kwargs["num_inference_steps"] = steps  # its ratios are interpolated to the request's own steps
        if kwargs.get("mag_ratios") is None and not kwargs.get("calibrate"):
            if family != "flux":
                raise _error("mag needs mag_ratios for this model (diffusers ships Flux's only); calibrate them "
                             "with diffusers' MagCacheConfig(calibrate=True)")
            kwargs["mag_ratios"] = mag_cache.FLUX_MAG_RATIOS
    if kind == "faster" and family == "flux":
        kwargs.setdefault("is_guidance_distilled", True)  # Flux has no unconditional rows to skip
    if "current_timestep_callback" in known:
        kwargs["current_timestep_callback"] = timestep
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise _error(f"{kind}: {exc}") from None


def request_spec(params_cache: dict | None, default: dict | None) -> dict | None:
    """The cache a request runs with: its own, else the deployment's; None for none."""
    spec = params_cache if params_cache is not None else default
    if not spec or spec.get("type") == NONE:
        return None
    return spec


class StepCount:
    """Counts one request's computed and skipped steps from its attentions' `to_q` calls."""

    def __init__(self):
        self.computed = 0
        self.skipped = 0
        self._ran = 0  # attentions that ran since the last step
        self._expected = 0  # attentions the forwards since the last step have

    def step(self) -> None:
        if self._expected:
            if self._ran >= self._expected:
                self.computed += 1
            else:
                self.skipped += 1
        self._ran = self._expected = 0

    def as_dict(self) -> dict[str, int]:
        return {"steps_computed": self.computed, "steps_skipped": self.skipped}


class StepCaches:
    """The cache hooks of one denoiser's transformers (Wan 2.2: both experts)."""

    def __init__(self, models: list, family: str, default: dict | None = None):
        self.models = [m for m in models if m is not None]
        self.family = family
        self.default = default
        #: held while a cached request runs: no other forward goes through its hooks
        self.lock = threading.RLock()
        self._count: StepCount | None = None
        self._attentions = {id(m): [a for _, a in m.named_modules() if hasattr(a, "to_q")] for m in self.models}

    @property
    def usable(self) -> bool:
        return bool(self.models) and all(hasattr(m, "enable_cache") for m in self.models)

    def _forward(self, n: int) -> None:
        if self._count is not None:
            self._count._expected += n

    def _ran(self) -> None:
        if self._count is not None:
            self._count._ran += 1

    def check(self, spec: dict | None, steps: int) -> None:
        """Refuse a spec before any compute (a RequestError naming the field)."""
        if spec is None:
            return
        if not self.usable:
            raise _error(f"this model ({self.family or 'built in'}) has no diffusers cache hooks")
        config_of(spec, self.family, steps, lambda: 0)

    @contextlib.contextmanager
    def use(self, spec: dict | None, steps: int, timestep):
        """Enable `spec`'s config for one request's denoising (yields its StepCount; None without a cache)."""
        if spec is None:
            yield None
            return
        if not self.usable:
            raise _error(f"this model ({self.family or 'built in'}) has no diffusers cache hooks")
        from disagg.roles.extensions.compile import eager

        # a compiled transformer runs uncompiled meanwhile: its hooks and their state stay in Python (disagg/roles/extensions/compile.py)
        with self.lock, eager(self.models), self._forwards_kept():
            for m in self.models:
                m.enable_cache(config_of(spec, self.family, steps, timestep))
            self._count = count = StepCount()
            handles = self._counting_hooks()  # only while a cached request runs: no cost on other forwards
            try:
                yield count
            finally:
                self._count = None
                for h in handles:
                    h.remove()
                for m in self.models:
                    m._reset_stateful_cache()
                    m.disable_cache()

    @contextlib.contextmanager
    def _forwards_kept(self):
        """The modules' `forward` as they were once the cache is disabled: diffusers' hook registry, removing a
        hook, leaves the module's own forward behind as an instance attribute, which a compiled block guards on
        (its next uncached forward would recompile)."""
        modules = [mod for m in self.models for mod in m.modules()]
        own = {id(mod) for mod in modules if "forward" in mod.__dict__}
        try:
            yield
        finally:
            for mod in modules:
                left = mod.__dict__.get("forward")
                if left is not None and id(mod) not in own and getattr(left, "__self__", None) is mod \
                        and getattr(left, "__func__", None) is type(mod).forward:
                    del mod.__dict__["forward"]

    def _counting_hooks(self) -> list:
        """Hooks that count each forward's attentions and those that ran (StepCount)."""
        handles = []
        for m in self.models:
            attentions = self._attentions[id(m)]
            handles.append(m.register_forward_pre_hook(lambda *_a, n=len(attentions): self._forward(n)))
            handles += [a.to_q.register_forward_hook(lambda *_a: self._ran()) for a in attentions]
        return handles


def make_caches(adapter, role: str, default: dict | None) -> StepCaches | None:
    """The step caches of a denoiser (or colocated instance) whose adapter holds a diffusers transformer."""
    family = adapter.capabilities.family  # its diffusers pipeline's (tiny and demo are Flux)
    if role not in ("denoiser", "monolith") or not family:
        return None
    models = [getattr(adapter.pipe, name, None) for name in ("transformer", "transformer_2")]
    if not any(isinstance(m, torch.nn.Module) for m in models):
        return None
    return StepCaches([m for m in models if isinstance(m, torch.nn.Module)], family, default)
