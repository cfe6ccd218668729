"""Step caches (disagg/roles/extensions/step_cache.py): each type a family takes, run through a denoiser Stage, equals diffusers'
own pipeline run in one process with the same cache config, within 1/255, and skips steps at the thresholds
docs/guide/step-caches.md documents; requests with other cache settings held by one denoiser keep their own."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from disagg.roles.errors import RequestError
from disagg.roles.extensions.step_cache import TYPES, UNSUPPORTED, config_of, make_caches
from disagg.roles.stage import Stage
from disagg.transport.wire.messages import GenerationParams

#: the tiny models' documented thresholds (README "Step caches"): each skips steps there
FLUX_CACHES = {
    "first_block": {"type": "first_block", "threshold": 0.3},
    "mag": {"type": "mag"},
    "taylorseer": {"type": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1},
    "faster": {"type": "faster"},
    "pyramid_attention_broadcast": {"type": "pyramid_attention_broadcast", "spatial_attention_block_skip_range": 2},
}
WAN_RATIOS = [1.0, 1.02, 1.01, 0.99, 0.98, 0.97, 0.95, 0.9]
WAN_CACHES = {
    "first_block": {"type": "first_block", "threshold": 0.1},
    "mag": {"type": "mag", "mag_ratios": WAN_RATIOS},
    "pyramid_attention_broadcast": {"type": "pyramid_attention_broadcast", "spatial_attention_block_skip_range": 2},
    "sea": {"type": "sea"},
}
STEPS = 8


def test_every_type_is_covered_or_refused_with_its_reason_per_family():
    assert set(FLUX_CACHES) | set(UNSUPPORTED["flux"]) == set(TYPES)
    assert set(WAN_CACHES) | set(UNSUPPORTED["wan"]) == set(TYPES)


# --- tiny Flux ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flux():
    from disagg.roles.pipelines.tiny import TinyFluxAdapter, build_tiny_flux_pipeline

    enc, dec = TinyFluxAdapter("encoder"), TinyFluxAdapter("decoder")
    ref = build_tiny_flux_pipeline()
    return enc, dec, ref


def flux_params(seed=1, prompt="a red cat", **kw):
    return {"prompt": prompt, "seed": seed, "num_inference_steps": STEPS, "width": 64, "height": 64, **kw}


def flux_reference(ref, spec, p) -> np.ndarray:
    if spec is not None:
        ref.transformer.enable_cache(config_of(spec, "flux", p["num_inference_steps"], lambda: ref.current_timestep))
    try:
        image = ref(prompt=p["prompt"], width=p["width"], height=p["height"], num_inference_steps=p["num_inference_steps"],
                    guidance_scale=3.5, generator=torch.Generator("cpu").manual_seed(p["seed"])).images[0]
    finally:
        if spec is not None:
            ref.transformer.disable_cache()
    return np.asarray(image, dtype=int)


def flux_stage(max_batch: int) -> Stage:
    from disagg.roles.pipelines.tiny import TinyFluxAdapter

    den = TinyFluxAdapter("denoiser")
    return Stage("denoiser", den, max_batch=max_batch, schedule="slo", caches=make_caches(den, "denoiser", None))


def flux_split(flux, stage: Stage, p: dict, spec) -> tuple[np.ndarray, dict]:
    enc, dec, _ = flux
    full = {**enc.defaults(), **p}
    out = stage.run(GenerationParams(**p, cache=spec), enc.encode(full))
    image = dec.decode({k: v.clone() for k, v in out.tensors.items()}, full)[0]
    return np.asarray(image, dtype=int), out.cache_steps


@pytest.mark.parametrize("max_batch", [1, 4], ids=["pipeline", "batcher"])
@pytest.mark.parametrize("kind", list(FLUX_CACHES))
def test_flux_cache_equals_the_pipeline_with_the_same_config(flux, kind, max_batch):
    spec = FLUX_CACHES[kind]
    p = flux_params()
    got, counted = flux_split(flux, flux_stage(max_batch), p, spec)
    want = flux_reference(flux[2], spec, p)
    assert np.abs(got - want).max() <= 1
    assert counted["steps_skipped"] > 0, counted
    assert counted["steps_computed"] + counted["steps_skipped"] == STEPS
    assert counted["cache"].startswith(kind)
    # the cache changed the output: the comparison above could fail
    assert np.abs(flux_reference(flux[2], None, p) - want).max() > 0


def test_requests_with_other_caches_on_one_denoiser_keep_their_own(flux):
    """Three requests held at once by one batching denoiser (schedule slo): two caches and none, each equal
    to its own pipeline run; and the cache leaves nothing behind for the next request."""
    stage = flux_stage(4)
    cases = [(flux_params(1, "a red cat"), FLUX_CACHES["first_block"]),
             (flux_params(2, "a blue house"), FLUX_CACHES["taylorseer"]),
             (flux_params(3, "a dog"), None)]
    enc, dec, _ = flux
    # encoded before and decoded after: only the denoiser's work overlaps (the encoder and the VAE computing at the
    # same time would change the CPU's reductions and, through a cache's extrapolation, the pixels)
    embeds = [enc.encode({**enc.defaults(), **p}) for p, _ in cases]
    outs = [None] * len(cases)

    def run(i):
        p, spec = cases[i]
        outs[i] = stage.run(GenerationParams(**p, cache=spec), embeds[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    got = [(np.asarray(dec.decode(out.tensors, {**dec.defaults(), **p})[0], dtype=int), out.cache_steps)
           for (p, _), out in zip(cases, outs)]
    for (p, spec), (image, counted) in zip(cases, got):
        assert np.abs(image - flux_reference(flux[2], spec, p)).max() <= 1
        assert bool(counted) == (spec is not None)
    again, counted = flux_split(flux, stage, cases[2][0], None)
    assert np.abs(again - flux_reference(flux[2], None, cases[2][0])).max() <= 1 and counted == {}
    assert not stage.caches.models[0].is_cache_enabled


def test_a_bad_cache_is_refused_naming_the_field(flux):
    stage = flux_stage(1)
    enc = flux[0]
    p = flux_params()
    embeds = enc.encode({**enc.defaults(), **p})
    for spec, words in [({"type": "teacache"}, "type must be one of"), ({"type": "sea"}, "no step index"),
                        ({"type": "first_block", "treshold": 0.2}, "takes no field 'treshold'"),
                        ({"type": "faster", "current_timestep_callback": 1}, "takes no field"),
                        ({"type": "taylorseer", "taylor_factors_dtype": "int8"}, "taylor_factors_dtype"),
                        # issue 44 (newcomer D3): diffusers took these, and the first ran every step
                        ({"type": "first_block", "threshold": -1}, "threshold must be a number >= 0"),
                        ({"type": "mag", "max_skip_steps": "3"}, "max_skip_steps must be a number >= 0")]:
        with pytest.raises(RequestError, match=words) as err:
            stage.run(GenerationParams(**p, cache=spec), embeds)
        assert err.value.param == "cache"
    # the deployment's default, and a request's "none"
    stage.caches.default = FLUX_CACHES["first_block"]
    _, counted = flux_split(flux, stage, p, None)
    assert counted["steps_skipped"] > 0
    _, counted = flux_split(flux, stage, p, {"type": "none"})
    assert counted == {}


# --- tiny Wan -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    from diffusers import DiffusionPipeline

    from disagg.roles.pipelines.wan import WanAdapter
    from tests.ckpt_wan import save_tiny_wan

    folder = tmp_path_factory.mktemp("wan-cache")
    save_tiny_wan(folder)
    roles = {r: WanAdapter(str(folder), r) for r in ("encoder", "denoiser", "decoder")}
    ref = DiffusionPipeline.from_pretrained(folder)
    ref.set_progress_bar_config(disable=True)
    return roles, ref


@pytest.mark.parametrize("kind", list(WAN_CACHES))
def test_wan_cache_equals_the_pipeline_with_the_same_config(wan, kind):
    roles, ref = wan
    spec = WAN_CACHES[kind]
    p = {**roles["encoder"].defaults(), "prompt": "a red cat walks", "width": 32, "height": 32, "num_frames": 9,
         "num_inference_steps": STEPS, "seed": 5}
    stage = Stage("denoiser", roles["denoiser"], schedule="slo", caches=make_caches(roles["denoiser"], "denoiser", None))
    given = {k: p[k] for k in ("prompt", "width", "height", "num_frames", "num_inference_steps", "seed")}
    out = stage.run(GenerationParams(**given, cache=spec), roles["encoder"].encode(p))
    frames = roles["decoder"].decode({k: v.clone() for k, v in out.tensors.items()}, p)[0]
    got = np.stack([np.asarray(f, dtype=int) for f in frames])

    def reference(cache):
        if cache is not None:
            ref.transformer.enable_cache(config_of(cache, "wan", STEPS, lambda: ref.current_timestep))
        try:
            return ref(prompt=p["prompt"], height=32, width=32, num_frames=9, num_inference_steps=STEPS,
                       guidance_scale=p["guidance_scale"], generator=torch.Generator("cpu").manual_seed(5),
                       output_type="np").frames[0]
        finally:
            if cache is not None:
                ref.transformer.disable_cache()

    want = (reference(spec) * 255).round().astype(int)
    assert np.abs(got - want).max() <= 1
    assert out.cache_steps["steps_skipped"] > 0 and sum(out.cache_steps[k] for k in ("steps_computed", "steps_skipped")) == STEPS
    assert np.abs((reference(None) * 255).round().astype(int) - want).max() > 0
