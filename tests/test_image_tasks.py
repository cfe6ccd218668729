"""Image inputs through real 1:1:1 deployments: every image pipeline equals diffusers' own, called directly.

One deployment per tiny checkpoint (Flux, Flux Kontext, Flux Fill, SD3, SDXL, Wan 2.1 I2V, Qwen-Image), shared with
the other modules' tests of that checkpoint (conftest.checkpoint); each
request goes through `client.Client` as `disagg submit` sends it (the image's bytes inside the request), and
its output is compared with the diffusers pipeline object called in this process on the same inputs, with
`generator=torch.Generator("cpu").manual_seed(seed)`: within 1/255 per pixel (and frame).
"""

from __future__ import annotations

import importlib.util
import io
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from disagg.client import Client
from disagg.transport.wire.messages import GenerationParams
from tests.checkpoints import save_tiny
from tests.conftest import Launched, reference_pipeline

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]

PROMPT = "a red cat on a blue car"
W, H = 64, 48
RNG = np.random.default_rng(7)
IMAGE = Image.fromarray(RNG.integers(0, 255, (H, W, 3), dtype=np.uint8))
MASK = Image.fromarray(np.where(np.arange(W)[None, :] >= W // 2, 255, 0).astype(np.uint8).repeat(H, 0))
SMALL = Image.fromarray(RNG.integers(0, 255, (32, 32, 3), dtype=np.uint8))  # Wan I2V: 32x32, 9 frames


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


#: checkpoint -> cases: (diffusers class, request fields beyond the prompt, reference kwargs beyond the prompt)
def _cases() -> dict[str, list[tuple[str, dict, dict]]]:
    img, mask, small = png(IMAGE), png(MASK), png(SMALL)
    size = dict(width=W, height=H)
    flux = dict(num_inference_steps=3, guidance_scale=3.5)
    cfg = dict(num_inference_steps=4, guidance_scale=5.0)

    def cfg_family(prefix: str) -> list[tuple[str, dict, dict]]:
        """SD3's and SDXL's img2img and inpainting cases, alike but for the class names."""
        return [
            (f"{prefix}Img2ImgPipeline", dict(image=img, strength=0.6, **cfg), dict(image=IMAGE, strength=0.6, **cfg)),
            (f"{prefix}InpaintPipeline", dict(image=img, mask=mask, strength=0.8, **size, **cfg),
             dict(image=IMAGE, mask_image=MASK, strength=0.8, **size, **cfg)),
        ]

    return {
        "flux": [
            ("FluxImg2ImgPipeline", dict(image=img, strength=0.7, **size, **flux),
             dict(image=IMAGE, strength=0.7, **size, **flux)),
            ("FluxInpaintPipeline", dict(image=img, mask=mask, strength=0.9, **size, **flux),
             dict(image=IMAGE, mask_image=MASK, strength=0.9, **size, **flux)),
        ],
        "flux-kontext": [  # Kontext picks its own resolution (~1024^2) from the image's aspect
            ("FluxKontextPipeline", dict(image=img, num_inference_steps=2, guidance_scale=2.5),
             dict(image=IMAGE, num_inference_steps=2, guidance_scale=2.5)),
        ],
        "flux-fill": [
            ("FluxFillPipeline", dict(image=img, mask=mask, **size, num_inference_steps=3, guidance_scale=30.0),
             dict(image=IMAGE, mask_image=MASK, **size, num_inference_steps=3, guidance_scale=30.0)),
        ],
        "sd3": cfg_family("StableDiffusion3"),  # img2img keeps the image's size
        "sdxl": cfg_family("StableDiffusionXL"),
        "wan21-i2v": [
            ("WanImageToVideoPipeline", dict(image=small, width=32, height=32, num_frames=9, num_inference_steps=2,
                                             guidance_scale=5.0, response_format="png"),
             dict(image=SMALL, width=32, height=32, num_frames=9, num_inference_steps=2, guidance_scale=5.0)),
        ],
        "qwen": [  # guidance_scale is Qwen-Image's true_cfg_scale, applied with a negative prompt
            ("QwenImagePipeline", dict(negative_prompt="blurry", **size, num_inference_steps=3, guidance_scale=4.0),
             dict(negative_prompt="blurry", **size, num_inference_steps=3, true_cfg_scale=4.0)),
            ("QwenImageImg2ImgPipeline", dict(image=img, strength=0.8, **size, num_inference_steps=3, guidance_scale=4.0),
             dict(image=IMAGE, strength=0.8, **size, num_inference_steps=3, true_cfg_scale=4.0)),
            ("QwenImageInpaintPipeline", dict(image=img, mask=mask, strength=0.9, **size, num_inference_steps=3,
                                              guidance_scale=4.0),
             dict(image=IMAGE, mask_image=MASK, strength=0.9, **size, num_inference_steps=3, true_cfg_scale=4.0)),
        ],
    }


CASES = _cases()
#: the components a denoiser may hold: its DiT and the scheduler, nothing else
DENOISER_ONLY = {"transformer", "transformer_2", "unet", "scheduler"}



#: every test here that takes a checkpoint runs on each of these shared deployments (conftest.checkpoint)
ON_EACH = pytest.mark.parametrize("checkpoint", list(CASES), indirect=True)


def frames_of(outcome) -> list[np.ndarray]:
    return [np.asarray(Image.open(io.BytesIO(b)).convert("RGB"), dtype=np.int16) for b in outcome.images]


def reference(folder, cls_name: str, kwargs: dict, seed: int) -> list[np.ndarray]:
    pipe = reference_pipeline(Path(folder), cls_name)
    out = pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(seed), output_type="pil", **kwargs)
    images = out.frames[0] if hasattr(out, "frames") else out.images
    return [np.asarray(im.convert("RGB"), dtype=np.int16) for im in images]


@ON_EACH
def test_every_pipeline_equals_diffusers_called_directly(checkpoint):
    worst = {}
    with Client(checkpoint.endpoint) as client:
        params = [GenerationParams(prompt=PROMPT, seed=11 + i, **fields)
                  for i, (_, fields, _) in enumerate(CASES[checkpoint.kind])]
        t0 = time.monotonic()
        outcomes = client.run_all(params, concurrency=1, timeout_s=300)
        took = time.monotonic() - t0
    for (cls_name, _, ref_kwargs), p, outcome in zip(CASES[checkpoint.kind], params, outcomes):
        assert outcome.ok, f"{cls_name}: {outcome.error}"
        got, want = frames_of(outcome), reference(checkpoint.folder, cls_name, ref_kwargs, p.seed)
        assert len(got) == len(want), cls_name
        assert got[0].shape == want[0].shape, (cls_name, got[0].shape, want[0].shape)
        worst[cls_name] = max(int(np.abs(a - b).max()) for a, b in zip(got, want))
        h, w = want[0].shape[:2]
        assert (outcome.resolved.get("width"), outcome.resolved.get("height")) == (w, h), cls_name
    print(f"\n{checkpoint.kind}: worst pixel difference {worst}, {took:.2f} s for {len(params)} requests")
    assert all(d <= 1 for d in worst.values()), worst


@ON_EACH
def test_the_denoiser_loads_only_the_dit_and_the_encoder_the_image_encoders(checkpoint):
    loaded = {i.role: set(i.components) for i in checkpoint.status().instances}
    assert loaded["denoiser"] <= DENOISER_ONLY, loaded["denoiser"]
    assert "vae" in loaded["encoder"] and "vae" in loaded["decoder"]
    assert not loaded["decoder"] & {"text_encoder", "transformer", "unet", "image_encoder"}
    if checkpoint.kind == "wan21-i2v":
        assert "image_encoder" in loaded["encoder"]


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="transformers 5 builds Qwen2VLProcessor only with torchvision (no CPU wheel for torch 2.13)")
def test_qwen_image_edit_equals_diffusers(tmp_path):
    folder = tmp_path / "ckpt"
    save_tiny("qwen-edit", folder)
    dep = Launched(["--model", str(folder), "-e", "1", "-d", "1", "-k", "1", "--no-dashboard"], tmp_path)
    for d in dep.serve(3):
        with Client(d.endpoint) as client:
            outcome = client.run_all([GenerationParams(prompt=PROMPT, seed=5, image=png(IMAGE), num_inference_steps=2)])[0]
        assert outcome.ok, outcome.error
        want = reference(folder, "QwenImageEditPipeline", dict(image=IMAGE, num_inference_steps=2), 5)
        assert np.abs(frames_of(outcome)[0] - want[0]).max() <= 1


def test_a_colocated_instance_runs_image_tasks_whole(tmp_path):
    """--colocated: the task pipeline with every component in one process, the same output."""
    folder = tmp_path / "ckpt"
    save_tiny("flux", folder)
    cls_name, fields, ref_kwargs = CASES["flux"][1]  # inpainting: image, mask and strength
    dep = Launched(["--model", str(folder), "--colocated", "1", "--no-dashboard"], tmp_path)
    for d in dep.serve(1):
        with Client(d.endpoint) as client:
            [outcome] = client.run_all([GenerationParams(prompt=PROMPT, seed=21, **fields)])
        assert outcome.ok, outcome.error
        want = reference(folder, cls_name, ref_kwargs, 21)
        assert np.abs(frames_of(outcome)[0] - want[0]).max() <= 1


#: per checkpoint, a request it cannot take, and what the error must say
REFUSED = {
    "flux-kontext": (dict(image=png(IMAGE), mask=png(MASK)), "(FluxKontextPipeline) takes text-to-image (a prompt), "
                     "image editing or img2img (an image); this request is inpainting"),
    "flux-fill": (dict(image=png(IMAGE)), "(FluxFillPipeline) takes inpainting (an image and a mask); this request is "
                  "image editing or img2img"),
    "wan21-i2v": ({}, "(WanImageToVideoPipeline) takes image-to-video (an image); this request is text-to-video"),
}


@ON_EACH
def test_a_task_the_checkpoint_does_not_serve_is_refused_naming_it(checkpoint):
    fields, says = REFUSED.get(checkpoint.kind, (dict(mask=png(MASK)), "a mask needs an image"))
    with Client(checkpoint.endpoint) as client:
        bad, good = client.run_all([GenerationParams(prompt=PROMPT, num_inference_steps=1, **fields),
                                    GenerationParams(prompt=PROMPT, seed=1, **CASES[checkpoint.kind][0][1])])
    assert not bad.ok and says in bad.error and bad.attempts == 1, bad.error
    assert good.ok, good.error  # and it keeps serving
