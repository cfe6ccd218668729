"""SD3 and SDXL adapters, in one process: each role loads only its components, and encoder -> denoiser ->
decoder (tensors copied between them as if they crossed processes) paints what the diffusers pipeline paints."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from disagg.roles.pipelines.sd3 import SD3Adapter
from disagg.roles.pipelines.sdxl import SDXLAdapter
from tests.ckpt_sd3_sdxl import save_tiny_sd3, save_tiny_sdxl

pytestmark = pytest.mark.usefixtures("one_thread")

#: checkpoint variant -> (adapter class, saver)
VARIANTS = {
    "sd3": (SD3Adapter, save_tiny_sd3),
    "sdxl": (SDXLAdapter, save_tiny_sdxl),
    "sdxl-latents-mean-std": (SDXLAdapter, lambda folder: save_tiny_sdxl(folder, latents_mean_std=True)),
}
ENCODERS = {"text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3"}
DENOISERS = {"transformer", "unet", "scheduler"}

#: (guidance_scale, negative_prompt, num_images_per_prompt, width, height)
CASES = {
    "cfg-negative": (5.0, "a blurry photo", 1, 64, 64),
    "cfg-no-negative": (4.0, None, 1, 64, 64),
    "no-cfg": (1.0, "a blurry photo", 1, 64, 64),
    "two-images": (5.0, "a blurry photo", 2, 64, 64),
    "non-square": (5.0, "a dog", 1, 96, 48),
}



class Family:
    """A saved tiny checkpoint, its three role adapters and the monolithic reference pipeline."""

    def __init__(self, cls, folder):
        self.roles = {role: cls(str(folder), role) for role in ("encoder", "denoiser", "decoder")}
        self.reference = DiffusionPipeline.from_pretrained(folder)
        self.reference.set_progress_bar_config(disable=True)


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request, tmp_path_factory) -> Family:
    cls, save = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    save(folder)
    return Family(cls, folder)


def crossed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the next process receives: fresh contiguous copies."""
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    return {name: t.contiguous().clone() for name, t in tensors.items()}


def test_each_role_loads_only_its_components(family):
    enc, den, dec = (set(family.roles[r].components_loaded()) for r in ("encoder", "denoiser", "decoder"))
    present = {name for name, c in family.reference.components.items() if c is not None}
    # SDXL: 2 text encoders, SD3: 3; and for image inputs the VAE (its encoder half) and the scheduler
    assert enc == present & (ENCODERS | {"vae", "scheduler"}) and len(enc) in (6, 8)
    assert family.roles["encoder"].pipe.vae.decoder is None and family.roles["decoder"].pipe.vae.encoder is None
    assert den == present & DENOISERS and len(den) == 2
    assert dec == {"vae"}
    pipe = family.roles["denoiser"].pipe
    assert pipe.vae is None and pipe.text_encoder is None and pipe.text_encoder_2 is None
    assert getattr(pipe, "text_encoder_3", None) is None
    assert family.roles["encoder"].pipe.vae.decoder is None  # it encodes input images only
    assert sum(family.roles["denoiser"].components_loaded().values()) > 0
    assert family.roles["decoder"].components_loaded()["vae"] > 0


@pytest.mark.parametrize("case", list(CASES))
def test_split_matches_pipeline(family, case):
    guidance, negative, n, width, height = CASES[case]
    p = {**family.roles["encoder"].defaults(), "prompt": "a red cat on a house", "negative_prompt": negative,
         "guidance_scale": guidance, "num_images_per_prompt": n, "width": width, "height": height,
         "num_inference_steps": 2, "seed": 7}

    embeds = family.roles["encoder"].encode(p)
    assert all(t.shape[0] == 1 for t in embeds.values())  # one copy per prompt, whatever n
    assert ("negative_prompt_embeds" in embeds) == (guidance > 1)
    latents = family.roles["denoiser"].denoise(crossed(embeds), p)
    spatial = 2  # the tiny VAEs' downsampling (the pipeline would assume 8 without its VAE)
    assert latents["latents"].shape[0] == n and latents["latents"].shape[-2:] == (height // spatial, width // spatial)
    images = family.roles["decoder"].decode(crossed(latents), p)

    expected = family.reference(
        prompt=p["prompt"], negative_prompt=negative, height=height, width=width, num_inference_steps=2,
        guidance_scale=guidance, num_images_per_prompt=n, generator=torch.Generator("cpu").manual_seed(p["seed"]),
    ).images
    assert len(images) == len(expected) == n
    for got, want in zip(images, expected):
        assert got.size == want.size == (width, height)
        diff = np.abs(np.asarray(got, dtype=np.int16) - np.asarray(want, dtype=np.int16)).max()
        print(f"{case}: max pixel difference {diff}")
        assert diff <= 1
    if n > 1:  # the images of one prompt differ (their noise does)
        assert not np.array_equal(np.asarray(images[0]), np.asarray(images[1]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_roles_match_pipeline(family, dtype):
    """Roles loaded in half precision (as on a GPU; SDXL keeps an fp16 VAE in float32, as its pipeline upcasts)."""
    cls, folder = type(family.roles["encoder"]), family.roles["encoder"].ck.path
    roles = {role: cls(str(folder), role, dtype=dtype) for role in ("encoder", "denoiser", "decoder")}
    p = {**roles["encoder"].defaults(), "prompt": "a red cat", "negative_prompt": "a dog", "guidance_scale": 5.0,
         "num_images_per_prompt": 2, "width": 64, "height": 32, "num_inference_steps": 2, "seed": 3}
    embeds = roles["encoder"].encode(p)
    latents = roles["denoiser"].denoise(crossed(embeds), p)
    assert latents["latents"].dtype == getattr(torch, dtype)
    images = roles["decoder"].decode(crossed(latents), p)

    reference = DiffusionPipeline.from_pretrained(folder, torch_dtype=getattr(torch, dtype))
    reference.set_progress_bar_config(disable=True)
    transformer = getattr(reference, "transformer", None)
    if transformer is not None:  # what accelerate's loading path gives (see SD3Adapter.__init__)
        transformer.to(getattr(torch, dtype))
    expected = reference(
        prompt=p["prompt"], negative_prompt=p["negative_prompt"], height=32, width=64, num_inference_steps=2,
        guidance_scale=5.0, num_images_per_prompt=2, generator=torch.Generator("cpu").manual_seed(3),
    ).images
    for got, want in zip(images, expected, strict=True):
        diff = np.abs(np.asarray(got, dtype=np.int16) - np.asarray(want, dtype=np.int16)).max()
        print(f"{dtype}: max pixel difference {diff}")
        assert diff <= 1


def test_progress_is_reported_each_step(family):
    p = {**family.roles["encoder"].defaults(), "prompt": "a cat", "width": 32, "height": 32,
         "num_inference_steps": 3}
    steps = []
    family.roles["denoiser"].denoise(crossed(family.roles["encoder"].encode(p)), p, progress=lambda *_latents: steps.append(1))
    assert len(steps) == 3


@pytest.mark.parametrize("cls", [SD3Adapter, SDXLAdapter])
def test_defaults_are_the_pipelines(cls):
    import diffusers

    pipeline = {SD3Adapter: diffusers.StableDiffusion3Pipeline, SDXLAdapter: diffusers.StableDiffusionXLPipeline}[cls]
    params = inspect.signature(pipeline.__call__).parameters
    from types import SimpleNamespace

    # SD3's default size comes from the checkpoint's config, as the pipeline's does: the real model's here
    real = SimpleNamespace(ck=SimpleNamespace(family="sd3", configs={"transformer": {"sample_size": 128},
                                                                    "vae": {"block_out_channels": [1, 2, 3, 4]}}))
    d = cls.defaults(real) if cls is SD3Adapter else cls.defaults()
    for key in ("num_inference_steps", "guidance_scale", "num_images_per_prompt", "negative_prompt"):
        assert d[key] == params[key].default, key
    assert (d["width"], d["height"]) == (128 * 8, 128 * 8)  # the real models' sample_size x vae_scale_factor
