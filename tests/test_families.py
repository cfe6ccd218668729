"""Real model families end to end: a tiny random checkpoint saved with save_pretrained, served by
`disagg launch --model <folder>` (real processes, each role loading only its components), compared
pixel by pixel with `DiffusionPipeline.from_pretrained(folder)` run in this process."""

from __future__ import annotations

import io
import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from disagg.client import Client
from disagg.transport.wire.messages import GenerationParams
from tests.checkpoints import save_tiny
from tests.conftest import disagg, free_port_pair, reference_pipeline

pytestmark = pytest.mark.e2e

VIDEO = {"wan21", "wan22"}
#: what each role may hold, by component name prefix
ROLE_PREFIXES = {"encoder": ("text_encoder", "tokenizer"), "denoiser": ("transformer", "unet", "scheduler"),
                 "decoder": ("vae",)}
#: what an encoder also loads when its checkpoint takes images (disagg/roles/pipelines/checkpoint.py)
IMAGE_PREFIXES = ("vae", "image_encoder", "image_processor", "feature_extractor", "processor", "scheduler")


def requests(family: str) -> list[GenerationParams]:
    """Two distinct cases, then more of the same shapes with other prompts and seeds: with capacity 4 and
    these in flight together, every role runs several at once (each must still match its own reference)."""
    if family in VIDEO:
        common = dict(width=32, height=32, num_frames=5, num_inference_steps=2, response_format="png")
        cases = [
            GenerationParams(prompt="a cat on a beach", negative_prompt="blurry", guidance_scale=5.0, seed=1,
                             num_images_per_prompt=2, **common),
            GenerationParams(prompt="a red car", guidance_scale=1.0, seed=2, **common),
        ]
        more = [GenerationParams(prompt=f"a dog {k}", guidance_scale=5.0, seed=10 + k, **common) for k in range(1)]
        return cases + more
    cfg = 3.5 if family.startswith("flux") else 5.0
    cases = [
        GenerationParams(prompt="a cat on a beach", negative_prompt="blurry, dark", width=64, height=32,
                         num_inference_steps=2, guidance_scale=cfg, seed=1, num_images_per_prompt=2),
        GenerationParams(prompt="a red car at night", width=48, height=64, num_inference_steps=3,
                         guidance_scale=1.0, seed=2),
    ]
    more = [GenerationParams(prompt=f"a house {k}", width=64, height=32, num_inference_steps=3, guidance_scale=cfg,
                             seed=10 + k) for k in range(2)]
    return cases + more


def reference(folder, family: str, p: GenerationParams) -> list[np.ndarray]:
    """The same request through diffusers in one process: a list of HxWx3 uint8 arrays (frames for video)."""
    pipe = reference_pipeline(Path(folder))
    kw = dict(prompt=p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
              guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed))
    if not family.startswith("flux"):  # Flux has no negative prompt (it is guidance-distilled)
        kw["negative_prompt"] = p.negative_prompt
    if family in VIDEO:
        videos = pipe(**kw, num_frames=p.num_frames, num_videos_per_prompt=p.num_images_per_prompt, output_type="np").frames
        return [np.round(frame * 255).astype(np.uint8) for video in videos for frame in video]
    return [np.asarray(im) for im in pipe(**kw, num_images_per_prompt=p.num_images_per_prompt).images]


@pytest.mark.parametrize("checkpoint", ["flux", "sd3", "sdxl", "wan21", "wan22"], indirect=True)
def test_family_matches_diffusers_through_disagg(checkpoint):
    family, folder = checkpoint.kind, checkpoint.folder
    # capacity 4 (the shared checkpoint deployments'): a pipeline keeps per-call state (scheduler step index,
    # Wan's VAE cache), so this is the check that requests computed side by side on one instance stay each its own
    for inst in checkpoint.status().instances:  # each role loaded its own components, and only those
        assert inst.components, inst.id
        assert inst.capacity == 4, inst.id
        allowed = ROLE_PREFIXES[inst.role]
        if inst.role == "encoder" and not family.startswith("wan"):  # it takes images: their VAE encoder too
            allowed += IMAGE_PREFIXES
        assert all(name.startswith(allowed) for name in inst.components), (inst.id, inst.components)
        assert sum(inst.components.values()) > 0
    params = requests(family)
    with Client(checkpoint.endpoint) as client:
        outcomes = client.run_all(params, concurrency=len(params), timeout_s=300)
    worst = 0
    for outcome in outcomes:
        assert outcome.ok, outcome.error
        got = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in outcome.images]
        want = reference(folder, family, outcome.params)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            worst = max(worst, int(np.abs(g.astype(int) - w.astype(int)).max()))
    print(f"{family}: {sum(len(o.images) for o in outcomes)} images/frames, max pixel difference {worst}/255")
    assert worst <= 1, f"{family}: max pixel difference {worst}/255"


@pytest.mark.parametrize("checkpoint,formats", [("flux", ("jpeg", "webp", "png")), ("wan21", (None,))],
                         indirect=["checkpoint"])
def test_outputs_in_every_format_and_video_as_mp4(checkpoint, formats, tmp_path):
    """JPEG / WebP for an image model, MP4 for a video model; `disagg submit` saves the right extension."""
    import imageio.v3 as iio

    video = checkpoint.kind == "wan21"
    items = [{"prompt": "a cat", "width": 32, "height": 32, "num_inference_steps": 1,
              **({"num_frames": 5} if video else {"response_format": f})} for f in formats]
    exts = {".mp4"} if video else {".jpg", ".webp", ".png"}
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(items))
    out = tmp_path / "out"
    res = disagg("submit", str(prompts), "--endpoint", checkpoint.endpoint, "--out", str(out), timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    files = sorted(f for f in out.iterdir() if f.name != "manifest.jsonl")
    assert {f.suffix for f in files} == exts
    assert len((out / "manifest.jsonl").read_text().splitlines()) == len(items)
    for f in files:
        if f.suffix == ".mp4":
            frames = iio.imread(f, extension=".mp4")
            assert frames.shape == (5, 32, 32, 3)
        else:
            assert Image.open(f).size == (32, 32)


def test_an_unsupported_family_fails_at_launch_naming_its_pipeline(tmp_path):
    folder = tmp_path / "sd15"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                         "unet": ["diffusers", "UNet2DConditionModel"]}))
    res = disagg("launch", "--model", str(folder), "--no-dashboard", "--run-dir", str(tmp_path / "run"), timeout=60)
    assert res.returncode == 2
    assert "StableDiffusionPipeline" in res.stderr and "FluxPipeline" in res.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # no process started
    res = disagg("launch", "--model", str(tmp_path / "missing"), "--no-dashboard", timeout=60)
    assert res.returncode == 2 and "missing" in res.stderr


def test_a_request_in_a_format_the_model_cannot_make_fails_clearly(tmp_path):
    from disagg.roles.media import FormatError, check_format

    assert check_format(None, video=True) == "mp4" and check_format(None, video=False) == "png"
    with pytest.raises(FormatError, match="mp4.*video models"):
        check_format("mp4", video=False)
    with pytest.raises(FormatError, match="makes video"):
        check_format("jpeg", video=True)


def test_a_hugging_face_id_is_served_from_the_hub_cache(tmp_path):
    """`--model owner/name`: the launcher reads model_index.json through huggingface_hub, and every role
    loads its own components by the id (here from a hub cache, offline, as on a machine that downloaded it)."""
    import os

    cache, rev = tmp_path / "hub", "0" * 40
    repo = cache / "models--test--tiny-flux"
    save_tiny("flux", repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"prompt": "a cat", "width": 32, "height": 32, "num_inference_steps": 1, "seed": 4,
                                   "guidance_scale": 3.5}]))
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    res = disagg("launch", "--model", "test/tiny-flux", "-e", "1", "-d", "1", "-k", "1", "--no-dashboard",
                 "--submit", str(prompts), "--out", str(tmp_path / "out"), "--port", str(free_port_pair()),
                 env=env, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    [png] = (tmp_path / "out").glob("*.png")
    got = np.asarray(Image.open(png).convert("RGB")).astype(int)
    want = reference(repo / "snapshots" / rev, "flux", GenerationParams(prompt="a cat", width=32, height=32,
                                                                         num_inference_steps=1, seed=4,
                                                                         guidance_scale=3.5))[0]
    assert np.abs(got - want.astype(int)).max() <= 1


def test_colocated_instance_runs_a_whole_checkpoint_in_one_stage(tmp_path):
    """`--colocated`: the monolith role loads every component and runs all three stages itself."""
    from disagg.roles.pipelines.sd3 import SD3Adapter
    from disagg.roles.stage import Stage

    folder = tmp_path / "sd3"
    save_tiny("sd3", folder)
    adapter = SD3Adapter(str(folder), "monolith")
    assert {"text_encoder", "text_encoder_3", "transformer", "vae"} <= set(adapter.components_loaded())
    p = GenerationParams(prompt="a cat on a beach", negative_prompt="blurry", width=64, height=32,
                         num_inference_steps=2, guidance_scale=5.0, seed=1)
    out = Stage("monolith", adapter).run(p, {})
    got = np.asarray(Image.open(io.BytesIO(out.images[0])).convert("RGB")).astype(int)
    assert np.abs(got - reference(folder, "sd3", p)[0].astype(int)).max() <= 1


@pytest.mark.parametrize("variant", ["flux", "flux-schnell"])
def test_flux_dev_and_schnell_split_roles_match_the_pipeline(variant, tmp_path):
    """Guidance-distilled (dev: guidance is a transformer input) and not (schnell), role by role in process."""
    from disagg.roles.pipelines.flux import FluxAdapter

    folder = tmp_path / variant
    save_tiny(variant, folder)
    enc, den, dec = (FluxAdapter(str(folder), role) for role in ("encoder", "denoiser", "decoder"))
    assert den.pipe.transformer.config.guidance_embeds == (variant == "flux")
    assert set(den.components_loaded()) == {"transformer", "scheduler"} and set(dec.components_loaded()) == {"vae"}
    p = GenerationParams(prompt="a red car at night", width=48, height=32, num_inference_steps=2, guidance_scale=3.5,
                         seed=7, num_images_per_prompt=2)
    q = {**FluxAdapter.defaults(), **{k: v for k, v in msgspec.structs.asdict(p).items() if v is not None}}
    embeds = {k: v.contiguous().clone() for k, v in enc.encode(q).items()}
    latents = {k: v.contiguous().clone() for k, v in den.denoise(embeds, q).items()}
    got = [np.asarray(im).astype(int) for im in dec.decode(latents, q)]
    want = reference(folder, "flux", p)
    assert len(got) == 2 and max(int(np.abs(g - w.astype(int)).max()) for g, w in zip(got, want)) <= 1


@pytest.mark.parametrize("family,largest", [("sd3", 256), ("wan21", 512)])
def test_the_largest_size_comes_from_the_checkpoints_own_config(family, largest, tmp_path):
    """issue 22 L16: SD3's pos_embed_max_size and Wan's rope_max_seq_len bound the size a deployment takes, so
    a larger request is refused at Submit; diffusers' own pipeline runs at that size and fails 16 px above it."""
    from diffusers import DiffusionPipeline

    from disagg.roles.pipelines import model_spec

    save_tiny(family, tmp_path / family)
    spec = model_spec(str(tmp_path / family))
    assert (spec.max_width, spec.max_height) == (largest, largest)
    pipe = DiffusionPipeline.from_pretrained(str(tmp_path / family))
    pipe.set_progress_bar_config(disable=True)
    video = {"num_frames": 1} if family.startswith("wan") else {}
    pipe("x", width=largest, height=16, num_inference_steps=1, **video)
    with pytest.raises(Exception):
        pipe("x", width=largest + 16, height=16, num_inference_steps=1, **video)
