"""Wan 2.1 / 2.2 split into encoder / denoiser / decoder equals diffusers' WanPipeline, frame by frame.

In process, on tiny random checkpoints saved with save_pretrained (tests/ckpt_wan.py); each role's adapter
loads only its own components from the folder, as a role process would.
"""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from disagg.roles.media import encode_mp4
from disagg.roles.pipelines.wan import WanAdapter
from tests.ckpt_wan import BOUNDARY_RATIO, save_tiny_wan

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

PROMPT = "a red car on the beach at night"
SIZE = dict(width=32, height=32, num_frames=9)  # 4x4 latents (2x2 tokens), 3 latent frames



#: name -> (save_tiny_wan kwargs, latent channels, spatial downsampling, two transformers)
VARIANTS = {
    "wan21": (dict(), 16, 8, False),
    "wan22": (dict(v22=True), 16, 8, True),  # A14B: transformer + transformer_2, boundary_ratio
    "wan22-ti2v": (dict(v22=True, ti2v=True), 48, 16, False),  # TI2V-5B: expand_timesteps, 16x VAE
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt(variant, tmp_path_factory):
    folder = tmp_path_factory.mktemp(variant)
    save_tiny_wan(folder, **VARIANTS[variant][0])
    return folder


@pytest.fixture(scope="module")
def roles(ckpt):
    return {role: WanAdapter(str(ckpt), role) for role in ("encoder", "denoiser", "decoder")}


@pytest.fixture(scope="module")
def reference(ckpt):
    pipe = DiffusionPipeline.from_pretrained(ckpt)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def params(**kw) -> dict:
    return {**WanAdapter.defaults(), **SIZE, "prompt": PROMPT, "num_inference_steps": 2, **kw}


def passed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """As if staged through another process: fresh contiguous copies."""
    return {k: v.contiguous().clone() for k, v in tensors.items()}


def split_run(roles, p, progress=None):
    embeds = roles["encoder"].encode(p)
    assert all(isinstance(v, torch.Tensor) for v in embeds.values())
    latents = roles["denoiser"].denoise(passed(embeds), p, progress=progress)
    return embeds, latents, roles["decoder"].decode(passed(latents), p)


def reference_run(pipe, p) -> np.ndarray:
    return pipe(
        prompt=p["prompt"], negative_prompt=p["negative_prompt"], height=p["height"], width=p["width"],
        num_frames=p["num_frames"], num_inference_steps=p["num_inference_steps"],
        guidance_scale=p["guidance_scale"], num_videos_per_prompt=p["num_images_per_prompt"],
        generator=torch.Generator("cpu").manual_seed(p["seed"]), output_type="np",
    ).frames  # (videos, frames, H, W, 3) floats in [0, 1]


def max_frame_diff(videos: list[list[Image.Image]], ref: np.ndarray) -> tuple[float, int]:
    """The largest per-pixel difference of any frame: as a fraction, and in 8-bit levels against the
    reference quantised as diffusers' numpy_to_pil does (round(x * 255))."""
    assert len(videos) == ref.shape[0]
    worst, worst_levels = 0.0, 0
    for frames, ref_frames in zip(videos, ref):
        assert len(frames) == ref_frames.shape[0]
        for frame, ref_frame in zip(frames, ref_frames):
            assert isinstance(frame, Image.Image) and frame.mode == "RGB"
            assert frame.size == (ref_frame.shape[1], ref_frame.shape[0])
            pixels = np.asarray(frame)
            worst = max(worst, float(np.abs(pixels / 255 - ref_frame).max()))
            levels = np.abs(pixels.astype(int) - (ref_frame * 255).round().astype(int)).max()
            worst_levels = max(worst_levels, int(levels))
    return worst, worst_levels


def test_roles_load_only_their_components(variant, roles, reference):
    _, _, spatial, two = VARIANTS[variant]
    enc, den, dec = (roles[r].components_loaded() for r in ("encoder", "denoiser", "decoder"))
    assert set(enc) == {"text_encoder", "tokenizer"} and enc["text_encoder"] > 0
    expected = {"transformer", "scheduler"} | ({"transformer_2"} if two else set())
    assert set(den) == expected and all(den[t] > 0 for t in expected - {"scheduler"})
    assert set(dec) == {"vae"} and dec["vae"] > 0
    assert roles["denoiser"].pipe.config.boundary_ratio == (BOUNDARY_RATIO if two else None)
    # without a VAE the denoiser still knows the VAE's downsampling, as the full pipeline does
    den_pipe = roles["denoiser"].pipe
    assert (den_pipe.vae_scale_factor_spatial, den_pipe.vae_scale_factor_temporal) == (spatial, 4) == \
        (reference.vae_scale_factor_spatial, reference.vae_scale_factor_temporal)
    assert den_pipe.video_processor.config.vae_scale_factor == spatial


@pytest.mark.parametrize("case", [
    dict(guidance_scale=5.0, negative_prompt="blurry, green trees"),  # CFG on, a negative prompt
    dict(guidance_scale=4.0),  # CFG on, the empty negative prompt
    dict(guidance_scale=1.0),  # CFG off: no negative embeddings at all
    dict(guidance_scale=5.0, negative_prompt="blurry", num_images_per_prompt=2, seed=7),
    dict(guidance_scale=1.0, num_images_per_prompt=2, seed=3),
], ids=["cfg-negative", "cfg-empty-negative", "no-cfg", "cfg-two-videos", "no-cfg-two-videos"])
def test_split_equals_pipeline(variant, roles, reference, case):
    p = params(**case)
    steps = []
    embeds, latents, videos = split_run(roles, p, progress=lambda *_latents: steps.append(1))
    assert ("negative_prompt_embeds" in embeds) == (p["guidance_scale"] > 1)
    assert embeds["prompt_embeds"].shape[0] == 1  # one copy per prompt; the denoiser repeats it
    assert len(steps) == p["num_inference_steps"]
    n = p["num_images_per_prompt"]
    _, channels, spatial, _ = VARIANTS[variant]
    assert latents["latents"].shape == (n, channels, 3, 32 // spatial, 32 // spatial)
    ref = reference_run(reference, p)
    assert ref.shape == (n, 9, 32, 32, 3)
    diff, levels = max_frame_diff(videos, ref)
    print(f"{variant} {case}: max |split - pipeline| = {diff * 255:.3f}/255 ({levels} levels after rounding)")
    assert diff <= 1 / 255 + 1e-6


def test_wan22_uses_both_transformers(variant, roles, reference):
    """With 2 steps (t = 999, 750) and boundary 875 the high-noise transformer runs once, transformer_2 once."""
    if not VARIANTS[variant][3]:
        pytest.skip("Wan 2.2 A14B only (two transformers)")
    pipe = roles["denoiser"].pipe
    calls = {"transformer": 0, "transformer_2": 0}
    hooks = [getattr(pipe, name).register_forward_hook(lambda *a, name=name: calls.__setitem__(name, calls[name] + 1))
             for name in calls]
    try:
        p = params(guidance_scale=3.0, guidance_scale_2=6.0, negative_prompt="blurry")
        _, latents, videos = split_run(roles, p)
    finally:
        for h in hooks:
            h.remove()
    assert calls == {"transformer": 2, "transformer_2": 2}  # cond + uncond each
    # guidance_scale_2 reaches the pipeline: the same call with it matches, and it changes the result
    ref = reference(prompt=p["prompt"], negative_prompt=p["negative_prompt"], height=32, width=32, num_frames=9,
                    num_inference_steps=2, guidance_scale=3.0, guidance_scale_2=6.0,
                    generator=torch.Generator("cpu").manual_seed(0), output_type="np").frames
    assert max_frame_diff(videos, ref)[0] <= 1 / 255 + 1e-6
    other = roles["denoiser"].denoise(roles["encoder"].encode({**p, "guidance_scale_2": None}),
                                      {**p, "guidance_scale_2": None})
    assert not torch.equal(other["latents"], latents["latents"])


def test_repeated_requests_are_identical(roles):
    """Scheduler state (UniPC's history) and the VAE's frame cache do not leak from one request into the next."""
    p = params(guidance_scale=5.0, negative_prompt="blurry", seed=11)
    _, first, v1 = split_run(roles, p)
    split_run(roles, params(guidance_scale=1.0, seed=5, num_images_per_prompt=2))
    _, second, v2 = split_run(roles, p)
    assert torch.equal(first["latents"], second["latents"])
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(v1[0], v2[0]))


def test_decodes_take_turns_between_latent_frames_and_equal_their_solo_runs(roles):
    """schedule slo: a decoder holding a long video's decode hands the device to a more urgent decode between
    two latent frames, and resumes it after; each decode runs on its own copy of the VAE's frame cache, so both
    videos equal their solo decodes exactly."""
    import threading

    from disagg.roles.stage import Stage
    from disagg.roles.turns import Ticket

    stage = Stage("decoder", roles["decoder"], schedule="slo")
    assert stage.turns is not None  # the Wan VAE is not thread-safe: its decodes take turns, by urgency
    long_p, short_p = params(num_frames=33, seed=3), params(num_frames=9, seed=4)  # 9 and 3 latent frames
    latents = {k: roles["denoiser"].denoise(passed(roles["encoder"].encode(p)), p) for k, p in
               (("long", long_p), ("short", short_p))}
    solo = {k: roles["decoder"].decode(passed(latents[k]), p) for k, p in (("long", long_p), ("short", short_p))}
    long_t, short_t = Ticket("long", steps=1), Ticket("short", priority=1, steps=1)
    out, ended, frames_seen = {}, [], []

    def decode(name, p, ticket, progress=None):
        with stage.turns.hold(ticket):
            out[name] = roles["decoder"].decode(passed(latents[name]), p,
                                                progress=stage._yielding(progress, ticket))
        ended.append(name)

    short = threading.Thread(target=decode, args=("short", short_p, short_t))

    def first_frame_done():  # the short decode arrives while the long one is between its frames
        frames_seen.append(1)
        if len(frames_seen) == 1:
            short.start()
            while short_t not in stage.turns._waiting:
                threading.Event().wait(0.001)

    decode("long", long_p, long_t, first_frame_done)
    short.join(60)
    assert ended == ["short", "long"] and stage.turns.switches == 1, (ended, stage.turns.switches)
    assert len(frames_seen) == 8  # a boundary before each latent frame after the first
    for name in ("long", "short"):
        a, b = out[name], solo[name]
        assert len(a[0]) == len(b[0]) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a[0], b[0]))


def test_cfg_without_negative_embeddings_is_an_error(roles):
    p = params(guidance_scale=5.0)
    embeds = roles["encoder"].encode(params(guidance_scale=1.0))
    with pytest.raises(ValueError, match="negative_prompt_embeds"):
        roles["denoiser"].denoise(embeds, p)


def test_bf16_keeps_diffusers_fp32_modules(ckpt, roles):
    """In bf16 the transformers' _keep_in_fp32_modules hold the checkpoint's float32 values, as diffusers
    loads them with accelerate."""
    from diffusers import WanTransformer3DModel

    keep = WanTransformer3DModel._keep_in_fp32_modules
    assert keep
    bf16 = WanAdapter(str(ckpt), "denoiser", dtype="bfloat16")
    for name in ("transformer", "transformer_2"):
        model, full = getattr(bf16.pipe, name), getattr(roles["denoiser"].pipe, name)
        if model is None:
            continue
        assert model.dtype == torch.bfloat16
        reference = dict(full.named_parameters())
        kept = 0
        for pname, param in model.named_parameters():
            if any(m in pname.split(".") for m in keep):
                assert param.dtype == torch.float32 and torch.equal(param, reference[pname]), pname
                kept += 1
            else:
                assert param.dtype == torch.bfloat16, pname
        assert kept > 0


def test_defaults_are_the_pipelines():
    d = WanAdapter.defaults()
    assert (d["width"], d["height"], d["num_frames"], d["num_inference_steps"], d["guidance_scale"]) == \
        (832, 480, 81, 50, 5.0)
    assert d["num_images_per_prompt"] == 1 and d["negative_prompt"] is None and d["fps"] == 16
    assert WanAdapter.video is True


def _frames(n: int, w: int, h: int) -> list[Image.Image]:
    y, x = np.mgrid[0:h, 0:w]
    return [Image.fromarray(np.stack([(x * 4 + i * 20) % 256, (y * 4) % 256, np.full_like(x, 128)], -1)
                            .astype(np.uint8)) for i in range(n)]


@pytest.mark.parametrize("w,h", [(32, 32), (832, 480), (33, 17)])
def test_encode_mp4_round_trip(w, h):
    frames = _frames(9, w, h)
    data = encode_mp4(frames, fps=16)
    assert data[4:8] == b"ftyp"
    # +faststart: the index (moov) comes before the media data
    assert 0 < data.find(b"moov") < data.find(b"mdat")
    video = iio.imread(data, extension=".mp4", plugin="FFMPEG")
    assert video.shape == (9, h + h % 2, w + w % 2, 3)  # odd sizes gain one repeated row / column
    meta = iio.immeta(data, extension=".mp4", plugin="FFMPEG")
    assert meta["fps"] == 16 and meta["codec"] == "h264"
    err = np.abs(video[:, :h, :w].astype(int) - np.stack([np.asarray(f) for f in frames])).mean()
    assert err < 4, err  # CRF 10: small, smooth test frames come back close


def test_encode_mp4_decoded_frames(roles):
    """The decoder's PIL frames encode as they are."""
    p = params(guidance_scale=1.0)
    _, _, videos = split_run(roles, p)
    data = encode_mp4(videos[0], fps=p["fps"])
    assert iio.imread(data, extension=".mp4", plugin="FFMPEG").shape == (9, 32, 32, 3)
