"""Image inputs, piece by piece: reading files and data: URLs, decoding and checking uploads, the task a request
asks for, the sim profile's image cost, and how errors reach HTTP clients."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from disagg.client.inputs import InputError, read_input, resolve_inputs
from disagg.roles.pipelines import conditioned
from disagg.roles.pipelines.conditioned import input_images, request_task
from disagg.transport.wire.messages import MAX_INPUT_BYTES, GenerationParams, MessageError, params_from_obj


def png(im: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def test_paths_and_data_urls_become_the_files_bytes(tmp_path):
    data = png(Image.new("RGB", (8, 8), "red"))
    (tmp_path / "a.png").write_bytes(data)
    assert read_input("a.png", "image", tmp_path) == data
    assert read_input(str(tmp_path / "a.png"), "image") == data
    assert read_input("data:image/png;base64," + base64.b64encode(data).decode(), "image") == data
    assert resolve_inputs({"prompt": "p", "mask": "a.png"}, tmp_path)["mask"] == data
    with pytest.raises(InputError, match="image: cannot read .*b.png"):
        read_input("b.png", "image", tmp_path)
    with pytest.raises(InputError, match="mask: the data: URL is not valid base64"):
        read_input("data:image/png;base64,###", "mask")
    with pytest.raises(InputError, match="image: a data: URL must look like"):
        read_input("data:nonsense", "image")
    with pytest.raises(InputError, match="image: expected a path or a data: URL, got int"):
        resolve_inputs({"prompt": "p", "image": 3})
    (tmp_path / "big.png").write_bytes(bytes(MAX_INPUT_BYTES + 1))
    with pytest.raises(InputError, match=f"over the {MAX_INPUT_BYTES}-byte limit"):
        read_input("big.png", "image", tmp_path)


def test_the_request_fields_are_checked_by_the_message_schema():
    with pytest.raises(MessageError, match=r"\$\.strength"):
        params_from_obj({"prompt": "p", "strength": 1.01})
    with pytest.raises(MessageError, match=r"\$\.image"):
        params_from_obj({"prompt": "p", "image": base64.b64encode(bytes(MAX_INPUT_BYTES + 1)).decode()})
    p = params_from_obj({"prompt": "p", "image": base64.b64encode(b"abc").decode(), "strength": 0.5})
    assert p.image == b"abc" and p.strength == 0.5


def test_uploads_decode_to_rgb_and_grayscale_or_name_the_field():
    image, mask = input_images({"image": png(Image.new("RGBA", (16, 8))), "mask": png(Image.new("RGB", (16, 8)))})
    assert image.mode == "RGB" and mask.mode == "L" and image.size == mask.size == (16, 8)
    image, _ = input_images({"image": png(Image.new("RGB", (16, 8)), "JPEG")})
    assert image.size == (16, 8)
    with pytest.raises(conditioned.InputError, match="image: not an image Pillow can read"):
        input_images({"image": b"GIF89a but not really"})
    with pytest.raises(conditioned.InputError, match="mask: 8x8 differs from the image's 16x8"):
        input_images({"image": png(Image.new("RGB", (16, 8))), "mask": png(Image.new("L", (8, 8)))})


def test_an_image_over_the_pixel_limit_is_refused_before_decoding(monkeypatch):
    monkeypatch.setattr(conditioned, "MAX_PIXELS", 100)
    with pytest.raises(conditioned.InputError, match="image: 16x8 is over the 100-pixel limit"):
        input_images({"image": png(Image.new("RGB", (16, 8)))})


def test_the_task_follows_from_the_inputs():
    assert request_task({}) == "text"
    assert request_task({"image": b"x"}) == "image"
    assert request_task({"image": b"x", "mask": b"y"}) == "inpaint"
    with pytest.raises(conditioned.InputError, match="a mask needs an image"):
        request_task({"mask": b"y"})


def test_call_kwargs_name_the_pipelines_own_arguments():
    import diffusers

    p = dict(prompt="p", num_inference_steps=3, num_images_per_prompt=2, guidance_scale=4.0, strength=0.5,
             negative_prompt="n", width=64, height=48, num_frames=9)
    kw = conditioned.call_kwargs(diffusers.QwenImageImg2ImgPipeline, p, "IMG", None, False, "true_cfg_scale")
    assert kw["true_cfg_scale"] == 4.0 and "guidance_scale" not in kw and kw["image"] == "IMG" and kw["strength"] == 0.5
    kw = conditioned.call_kwargs(diffusers.WanImageToVideoPipeline, {**p, "strength": None}, "IMG", None, True)
    assert kw["num_videos_per_prompt"] == 2 and kw["num_frames"] == 9 and "num_images_per_prompt" not in kw
    with pytest.raises(conditioned.InputError, match="strength: FluxKontextPipeline does not take one"):
        conditioned.call_kwargs(diffusers.FluxKontextPipeline, p, "IMG", None, False)


def test_the_sim_profile_charges_the_encoder_for_an_input_image():
    from disagg.roles.pipelines.sim import SimAdapter

    enc = SimAdapter("flux-h200", "encoder")
    charged = []  # what each encode charges its simulated device, in ms (not this machine's clock, which load skews)
    enc._busy = charged.append
    p = dict(width=1024, height=1024, num_images_per_prompt=1, prompt="p")
    text = enc.encode(p)["x"].numel()
    with_image = enc.encode({**p, "image": b"x"})["x"].numel()
    assert with_image * 4 >= text * 4 + 4 * 2**20  # the image's pixels and latents move on
    assert charged[1] - charged[0] > 30  # ~40 ms of VAE encoding at 1024^2


@pytest.mark.parametrize("error,code,param,status", [
    ("encoder encoder-0 failed: InputError: mask: 8x8 differs from the image's 16x8", "invalid_input", "mask", 400),
    ("encoder encoder-0 failed: InputError: model 'tiny' takes text-to-image (a prompt) only", "invalid_input", "image",
     400),
    ("denoiser denoiser-0 failed: RuntimeError: boom", "generation_failed", None, 500),
])
def test_input_errors_reach_http_clients_as_400_naming_the_field(error, code, param, status):
    """By the code and field the role reported (issue 23: the gateway parses no text)."""
    from disagg.client import Outcome
    from disagg.gateway.errors import from_outcome
    from disagg.transport.wire.codes import ErrorCode

    err = from_outcome(Outcome("r", GenerationParams(prompt="p"), False, error, code=ErrorCode(code), param=param))
    assert err.status == status and err.param == param
    if status == 400:
        assert err.message.startswith(error.split("InputError: ")[1][:10])


def test_a_sim_request_with_an_image_runs_through_its_stage():
    """sim: models take an image (its cost is the profile's); their stage keeps the request's size."""
    from disagg.roles.pipelines.sim import SimAdapter
    from disagg.roles.stage import Stage

    stage = Stage("encoder", SimAdapter("zero", "encoder"), model="sim:zero")
    out = stage.run(GenerationParams(prompt="p", image=png(Image.new("RGB", (8, 8)))), {})
    assert out.tensors["x"].numel() > 0
