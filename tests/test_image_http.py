"""Image inputs over HTTP and from prompts files, against real deployments: the official openai client's
images.edit, /v1/videos with input_reference, `disagg submit` with an image, and every kind of bad input
(each a clear error, after which the deployment keeps serving)."""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from disagg.client import Client
from disagg.transport.wire.messages import MAX_INPUT_BYTES, GenerationParams
from tests.conftest import disagg

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

RNG = np.random.default_rng(3)
IMAGE = Image.fromarray(RNG.integers(0, 255, (48, 64, 3), dtype=np.uint8))


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


#: the tests on the shared deployments of tiny checkpoints (conftest.checkpoint)
ON_FLUX = pytest.mark.parametrize("checkpoint", ["flux"], indirect=True)
ON_WAN_I2V = pytest.mark.parametrize("checkpoint", ["wan21-i2v"], indirect=True)


@pytest.fixture
def flux(checkpoint):
    """A FluxPipeline checkpoint (text, img2img, inpainting) behind a gateway."""
    checkpoint.api = openai.OpenAI(base_url=checkpoint.http + "/v1", api_key="unused", max_retries=0)
    return checkpoint


def edit(dep, files: dict, **fields) -> httpx.Response:
    data = {"prompt": "a red cat", "size": "64x48", "seed": "3", "num_inference_steps": "3", **fields}
    return httpx.post(dep.http + "/v1/images/edits", data=data, files=files, timeout=120)


def still_serves(dep) -> None:
    r = edit(dep, {"image": ("in.png", png(IMAGE), "image/png")})
    assert r.status_code == 200, r.text


@ON_FLUX
def test_openai_images_edit_equals_disagg_submit(flux, tmp_path):
    (tmp_path / "in.png").write_bytes(png(IMAGE))
    with open(tmp_path / "in.png", "rb") as f:
        r = flux.api.images.edit(image=f, prompt="a red cat at night", size="64x48",
                                 extra_body={"seed": 3, "strength": 0.7, "num_inference_steps": 3})
    got = pixels(base64.b64decode(r.data[0].b64_json))
    assert got.shape == (48, 64, 3) and r.size == "64x48"
    prompts = tmp_path / "p.json"  # the image by a path relative to the prompts file
    prompts.write_text(json.dumps({"prompt": "a red cat at night", "image": "in.png", "strength": 0.7, "width": 64,
                                   "height": 48, "seed": 3, "num_inference_steps": 3}))
    res = disagg("submit", str(prompts), "--endpoint", flux.endpoint, "--out", str(tmp_path / "out"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    [out] = (tmp_path / "out").glob("*.png")
    assert np.array_equal(got, pixels(out.read_bytes()))
    # the image changed the output: a text-to-image request with the same seed differs
    t2i = flux.api.images.generate(prompt="a red cat at night", size="64x48",
                                   extra_body={"seed": 3, "num_inference_steps": 3})
    assert not np.array_equal(got, pixels(base64.b64decode(t2i.data[0].b64_json)))
    # streamed, as OpenAI's edits stream: a partial image (the latents after step 3 of 6, decoded on the
    # decoder), then the image the same request gets unstreamed. Three steps still run after the preview is
    # staged: a preview never waits, so one staged right before the last step could lose to the final image
    six = {"seed": 3, "strength": 0.7, "num_inference_steps": 6}
    with open(tmp_path / "in.png", "rb") as f:
        events = list(flux.api.images.edit(image=f, prompt="a red cat at night", size="64x48", stream=True,
                                           partial_images=1, extra_body=six))
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"], events
    assert pixels(base64.b64decode(events[0].b64_json)).shape == (48, 64, 3)
    with open(tmp_path / "in.png", "rb") as f:
        plain = flux.api.images.edit(image=f, prompt="a red cat at night", size="64x48", extra_body=six)
    assert np.array_equal(pixels(base64.b64decode(plain.data[0].b64_json)),
                          pixels(base64.b64decode(events[1].b64_json)))


@ON_FLUX
def test_inpainting_over_http_with_image_array_and_mask(flux):
    mask = Image.fromarray(np.where(np.arange(64)[None, :] >= 32, 255, 0).astype(np.uint8).repeat(48, 0))
    r = edit(flux, [("image[]", ("a.png", png(IMAGE), "image/png")), ("mask", ("m.png", png(mask), "image/png"))],
             strength="1.0")
    assert r.status_code == 200, r.text
    got = pixels(base64.b64decode(r.json()["data"][0]["b64_json"]))
    # strength 1 repaints the white half from noise; the black half keeps the image (the pipeline blends it back)
    assert np.abs(got[:, :28] - np.asarray(IMAGE, dtype=np.int16)[:, :28]).mean() < \
        np.abs(got[:, 36:] - np.asarray(IMAGE, dtype=np.int16)[:, 36:]).mean()


@pytest.mark.parametrize("files,fields,status,param,says", [
    ({"image": ("x.png", b"this is not an image", "image/png")}, {}, 400, "image", "not an image Pillow can read"),
    ({"image": ("x.png", png(IMAGE), "image/png"), "mask": ("m.png", png(Image.new("L", (32, 32))), "image/png")},
     {}, 400, "mask", "32x32 differs from the image's 64x48"),
    ({"image": ("x.png", png(IMAGE), "image/png")}, {"strength": "1.5"}, 400, "strength", "<= 1.0"),
    ({"image": ("x.png", png(IMAGE), "image/png")}, {"strength": "-0.1"}, 400, "strength", ">= 0.0"),
    ({}, {}, 400, "image", "required"),
    ({"mask": ("m.png", png(IMAGE), "image/png")}, {}, 400, "image", "required"),
])
@ON_FLUX
def test_bad_edits_are_clear_errors_and_the_deployment_keeps_serving(flux, files, fields, status, param, says):
    r = edit(flux, files, **fields)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    still_serves(flux)


@ON_FLUX
def test_an_image_over_the_size_limit_is_413_before_any_work(flux, tmp_path):
    big = b"\x89PNG" + bytes(MAX_INPUT_BYTES)
    r = edit(flux, {"image": ("big.png", big, "image/png")})
    assert r.status_code == 413 and str(MAX_INPUT_BYTES) in r.json()["error"]["message"], r.text
    prompts = tmp_path / "p.json"
    (tmp_path / "big.png").write_bytes(big)
    prompts.write_text('{"prompt": "x", "image": "big.png"}')
    res = disagg("submit", str(prompts), "--endpoint", flux.endpoint, "--out", str(tmp_path / "o"), timeout=60)
    assert res.returncode == 2 and "image:" in res.stderr and "limit" in res.stderr, res.stderr
    still_serves(flux)


@ON_FLUX
def test_a_prompts_file_with_a_data_url_and_a_missing_file(flux, tmp_path):
    url = "data:image/png;base64," + base64.b64encode(png(IMAGE)).decode()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a cat", "image": url, "width": 64, "height": 48, "seed": 1,
                                   "num_inference_steps": 2}) + "\n")
    res = disagg("submit", str(prompts), "--endpoint", flux.endpoint, "--out", str(tmp_path / "o"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    prompts.write_text('{"prompt": "a cat", "image": "nowhere.png"}\n')
    res = disagg("submit", str(prompts), "--endpoint", flux.endpoint, "--out", str(tmp_path / "o2"), timeout=60)
    assert res.returncode == 2 and "image: cannot read" in res.stderr and "nowhere.png" in res.stderr, res.stderr


@ON_FLUX
def test_the_orchestrator_forwards_the_image_to_the_encoder_only(flux):
    """The denoiser's and decoder's Runs carry no image: their roles never see its bytes (nor need them)."""
    with Client(flux.endpoint) as client:
        [out] = client.run_all([GenerationParams(prompt="a cat", image=png(IMAGE), width=64, height=48, seed=2,
                                                 num_inference_steps=2)])
    assert out.ok, out.error
    from disagg.orchestrator.requests import Request

    req = Request(id="r", params=GenerationParams(prompt="a", image=b"x", mask=b"y"), clients=[], submitted_at=0,
                  deadline=1)
    assert req.params_for("encoder").image == b"x" and req.params_for("monolith").mask == b"y"
    assert req.params_for("denoiser").image is None and req.params_for("decoder").mask is None


# --- image-to-video over /v1/videos, and a text-only model ----------------------------------------------


@pytest.fixture
def wan_i2v(checkpoint):
    return checkpoint


def wait_video(dep, vid: str) -> dict:
    deadline = time.monotonic() + 120
    while True:
        doc = httpx.get(f"{dep.http}/v1/videos/{vid}", timeout=10).json()
        if doc["status"] in ("completed", "failed"):
            return doc
        assert time.monotonic() < deadline, doc
        time.sleep(0.2)


@ON_WAN_I2V
def test_videos_with_input_reference_equal_disagg_submit(wan_i2v, tmp_path):
    small = Image.fromarray(RNG.integers(0, 255, (32, 32, 3), dtype=np.uint8))
    url = "data:image/png;base64," + base64.b64encode(png(small)).decode()
    common = {"prompt": "a cat walks", "size": "32x32", "num_frames": 9, "num_inference_steps": 2, "seed": 4}
    as_json = httpx.post(wan_i2v.http + "/v1/videos", json={**common, "input_reference": url}, timeout=30).json()
    as_file = httpx.post(wan_i2v.http + "/v1/videos", data={k: str(v) for k, v in common.items()},
                         files={"input_reference": ("ref.png", png(small), "image/png")}, timeout=30).json()
    mp4s = []
    for job in (as_json, as_file):
        doc = wait_video(wan_i2v, job["id"])
        assert doc["status"] == "completed", doc
        mp4s.append(httpx.get(f"{wan_i2v.http}/v1/videos/{job['id']}/content", timeout=30).content)
    assert mp4s[0] == mp4s[1]
    (tmp_path / "ref.png").write_bytes(png(small))
    (tmp_path / "p.json").write_text(json.dumps({"prompt": "a cat walks", "image": "ref.png", "width": 32, "height": 32,
                                                 "num_frames": 9, "num_inference_steps": 2, "seed": 4}))
    res = disagg("submit", str(tmp_path / "p.json"), "--endpoint", wan_i2v.endpoint, "--out", str(tmp_path / "o"),
                 timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    [mp4] = (tmp_path / "o").glob("*.mp4")
    assert mp4.read_bytes() == mp4s[0]


@ON_WAN_I2V
def test_image_to_video_without_an_image_names_what_the_model_takes(wan_i2v):
    job = httpx.post(wan_i2v.http + "/v1/videos", json={"prompt": "a cat", "size": "32x32", "num_frames": 9},
                     timeout=30).json()
    doc = wait_video(wan_i2v, job["id"])
    assert doc["status"] == "failed" and "WanImageToVideoPipeline" in doc["error"]["message"], doc
    assert "image-to-video (an image)" in doc["error"]["message"], doc


@ON_FLUX
def test_a_folder_checkpoint_is_listed_by_its_folder_name_not_the_servers_path(flux):
    """Issue 22 L1: /v1/models listed the server's absolute path, and clients had to send it."""
    [card] = httpx.get(f"{flux.http}/v1/models", timeout=10).json()["data"]
    assert card["id"] == "flux", card
    assert httpx.get(f"{flux.http}/v1/models/flux", timeout=10).status_code == 200


@ON_FLUX
def test_an_edit_without_size_keeps_the_input_images_size(flux):
    """Issue 22 L18: Flux img2img without `size` made 1024² from a 64x48 input; OpenAI's edits keep its size."""
    r = httpx.post(flux.http + "/v1/images/edits", data={"prompt": "a red cat", "seed": "3", "num_inference_steps": "2"},
                   files={"image": ("in.png", png(IMAGE), "image/png")}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["size"] == f"{IMAGE.width}x{IMAGE.height}"
    assert pixels(base64.b64decode(r.json()["data"][0]["b64_json"])).shape == (IMAGE.height, IMAGE.width, 3)
