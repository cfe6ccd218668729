"""Per-request LoRA adapters end to end: real adapters made with peft and saved with the pipeline's
save_lora_weights, loaded by the roles with diffusers' load_lora_weights + set_adapters, compared pixel by pixel
with diffusers' own pipeline loading the same adapters in this process (tiny Flux and tiny SDXL)."""

from __future__ import annotations

import base64
import io
import json
import shutil

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from disagg.client import Client
from disagg.transport.wire.messages import GenerationParams, LoraRef
from tests.checkpoints import save_tiny
from tests.conftest import Launched, disagg, launch_with_http, wait_http, wait_until
from tests.loras import make_lora, reference

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread")]

PROMPT = "a red cat on a beach"
#: the issue's three requests: adapter A at scale 1; A + B at 0.7 / 0.5; no adapter
CASES = {"A": [("A", 1.0)], "A+B": [("A", 0.7), ("B", 0.5)], "none": []}


def params(loras, seed: int = 3) -> GenerationParams:
    return GenerationParams(prompt=PROMPT, width=64, height=64, num_inference_steps=2, guidance_scale=3.5, seed=seed,
                            loras=[LoraRef(name=n, scale=s) for n, s in loras] or None)


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def expected(folder, lora_dir, loras, seed: int = 3) -> np.ndarray:
    pipe = reference(folder, [(n, lora_dir / n, s) for n, s in loras])
    image = pipe(prompt=PROMPT, width=64, height=64, num_inference_steps=2, guidance_scale=3.5,
                 generator=torch.Generator("cpu").manual_seed(seed)).images[0]
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def family_setup(tmp, family: str):
    folder, lora_dir = tmp / family, tmp / f"{family}-loras"
    save_tiny(family, folder)
    make_lora(folder, lora_dir / "A", seed=1)
    make_lora(folder, lora_dir / "B", seed=2)
    return folder, lora_dir


@pytest.fixture(scope="module")
def flux_files(module_tmp):
    folder, lora_dir = family_setup(module_tmp, "flux")
    sdxl = module_tmp / "sdxl-for-foreign"
    save_tiny("sdxl", sdxl)
    make_lora(sdxl, lora_dir / "foreign", seed=4)  # an SDXL UNet's adapter: it does not fit Flux
    (lora_dir / "corrupt.safetensors").write_bytes(b"not a safetensors file at all")
    refs = {name: expected(folder, lora_dir, loras) for name, loras in CASES.items()}
    return folder, lora_dir, refs


def served(tmp, name: str, folder, lora_dir, *flags: str, http: bool = False):
    """`disagg launch` 1:1:1 of the checkpoint with the adapters' folder, for `for dep in served(...)`."""
    (tmp / name).mkdir()
    args = ["--model", str(folder), "-e", "1", "-d", "1", "-k", "1", *flags, "--lora-dir", str(lora_dir),
            "--no-dashboard"]
    return (launch_with_http(args, tmp / name) if http else Launched(args, tmp / name)).serve(3)


@pytest.fixture(scope="module")
def flux(flux_files, module_tmp):
    folder, lora_dir, _ = flux_files
    for dep in served(module_tmp, "flux-run", folder, lora_dir, "--capacity", "1,3,1", http=True):
        wait_http(dep.http + "/health")
        yield dep


def run(dep, cases: list, concurrency: int = 4):
    with Client(dep.endpoint) as client:
        return client.run_all(cases, concurrency=concurrency, timeout_s=120)


def test_flux_adapters_in_flight_together_on_one_denoiser_match_diffusers(flux, flux_files):
    _, _, refs = flux_files
    outcomes = run(flux, [params(loras) for loras in CASES.values()])
    for name, o in zip(CASES, outcomes):
        assert o.ok, o.error
        diff = int(np.abs(pixels(o.images[0]) - refs[name]).max())
        assert diff <= 1, f"{name}: worst pixel {diff}"
    # the adapters change the image (else parity would prove nothing), and each request saw only its own
    assert np.abs(refs["A"] - refs["none"]).max() > 20 and np.abs(refs["A"] - refs["A+B"]).max() > 20
    def denoiser():
        [den] = [i for i in flux.status().instances if i.role == "denoiser"]
        return den if den.lora.loads >= 2 else None

    den = wait_until(denoiser, timeout=10)  # its next heartbeat tells
    assert set(den.lora.held) >= {"A", "B"} and den.lora.slots == 8 and den.lora.hits >= 1
    # the first request to name an adapter waited for its load: its timings say so
    assert any("lora_denoiser" in o.timings for o in outcomes)
    assert outcomes[1].resolved.get("loras") == "A:0.7,B:0.5"


def test_the_openai_client_gives_the_pixels_of_disagg_submit(flux, flux_files, tmp_path):
    from openai import OpenAI

    _, _, refs = flux_files
    api = OpenAI(base_url=flux.http + "/v1", api_key="unused")
    loras = [{"name": "A", "scale": 0.7}, {"name": "B", "scale": 0.5}]
    img = api.images.generate(prompt=PROMPT, size="64x64", extra_body={
        "loras": loras, "seed": 3, "num_inference_steps": 2, "guidance_scale": 3.5})
    http_pixels = pixels(base64.b64decode(img.data[0].b64_json))
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps({"prompt": PROMPT, "width": 64, "height": 64, "num_inference_steps": 2,
                                   "guidance_scale": 3.5, "seed": 3, "loras": loras}))
    res = disagg("submit", str(prompts), "--endpoint", flux.endpoint, "--out", str(tmp_path / "out"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    [png] = (tmp_path / "out").glob("*.png")
    assert np.array_equal(http_pixels, pixels(png.read_bytes()))
    assert np.abs(http_pixels - refs["A+B"]).max() <= 1
    # the manifest and the PNG's text chunks record the adapters and scales
    [line] = (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()
    assert json.loads(line)["loras"] == "A:0.7,B:0.5"
    assert Image.open(png).text.get("loras") == "A:0.7,B:0.5"
    # model: "<adapter>" is shorthand for that adapter at scale 1
    img = api.images.generate(model="A", prompt=PROMPT, size="64x64",
                              extra_body={"seed": 3, "num_inference_steps": 2, "guidance_scale": 3.5})
    assert np.abs(pixels(base64.b64decode(img.data[0].b64_json)) - refs["A"]).max() <= 1
    models = {m.id: m for m in api.models.list().data}
    assert {"A", "B", "foreign", "flux"} <= set(models), models
    assert getattr(models["A"], "parent", None) == "flux"


def test_an_edit_with_adapters_in_the_form_equals_disagg_submit_and_the_adapters_change_it(flux, tmp_path):
    """/v1/images/edits: `loras` is a form field holding the list as JSON."""
    image = Image.fromarray(np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    (tmp_path / "in.png").write_bytes(buf.getvalue())
    form = {"prompt": PROMPT, "size": "64x64", "seed": "3", "strength": "0.8", "num_inference_steps": "3",
            "guidance_scale": "3.5"}
    loras = [{"name": "A", "scale": 0.7}, {"name": "B", "scale": 0.5}]

    def edit(**extra):
        r = httpx.post(flux.http + "/v1/images/edits", data={**form, **extra},
                       files={"image": ("in.png", buf.getvalue(), "image/png")}, timeout=120)
        assert r.status_code == 200, r.text
        return pixels(base64.b64decode(r.json()["data"][0]["b64_json"]))

    with_loras, without = edit(loras=json.dumps(loras)), edit()
    assert np.abs(with_loras - without).max() > 20, "the adapters made no difference to the edit"
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps({"prompt": PROMPT, "image": "in.png", "strength": 0.8, "width": 64, "height": 64,
                                   "seed": 3, "num_inference_steps": 3, "guidance_scale": 3.5, "loras": loras}))
    res = disagg("submit", str(prompts), "--endpoint", flux.endpoint, "--out", str(tmp_path / "out"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    [png] = (tmp_path / "out").glob("*.png")
    assert np.array_equal(with_loras, pixels(png.read_bytes()))
    r = httpx.post(flux.http + "/v1/images/edits", data={**form, "loras": "[not json"},
                   files={"image": ("in.png", buf.getvalue(), "image/png")}, timeout=30)
    assert r.status_code == 400 and "loras" in r.text


def test_bad_adapters_get_clear_errors_and_the_deployment_keeps_serving(flux, flux_files, tmp_path):
    _, lora_dir, refs = flux_files
    body = {"prompt": PROMPT, "size": "64x64"}
    r = httpx.post(flux.http + "/v1/images/generations", json={**body, "loras": [{"name": "nope"}]}, timeout=30)
    assert r.status_code == 400 and "'nope'" in r.text and r.json()["error"]["param"] == "loras", r.text
    r = httpx.post(flux.http + "/v1/images/generations",
                   json={**body, "extra_body": {"loras": [{"name": n} for n in ("A", "B", "foreign", "corrupt", "x")]}},
                   timeout=30)
    assert r.status_code == 400 and "max_per_request" in r.text and r.json()["error"]["param"] == "loras", r.text
    r = httpx.post(flux.http + "/v1/images/generations", json={**body, "loras": [{"name": "A", "scale": 9}]}, timeout=30)
    assert r.status_code == 400 and "scale" in r.text, r.text
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps({"prompt": PROMPT, "loras": [{"name": "nope"}]}))
    res = disagg("submit", str(prompts), "--endpoint", flux.endpoint, "--out", str(tmp_path / "out"), timeout=60)
    assert res.returncode == 2 and "nope" in res.stdout + res.stderr, res.stdout + res.stderr
    # refused when loaded, with the role's reason; the instance and the other adapters go on
    corrupt, foreign, good = run(flux, [params([("corrupt", 1.0)]), params([("foreign", 1.0)]), params(CASES["A"])])
    assert not corrupt.ok and "corrupt" in corrupt.error and "cannot be read" in corrupt.error, corrupt.error
    assert str(lora_dir) not in corrupt.error, corrupt.error  # issue 43 F11: the file, not the server's path
    assert not foreign.ok and "foreign" in foreign.error and "does not fit" in foreign.error, foreign.error
    assert good.ok and np.abs(pixels(good.images[0]) - refs["A"]).max() <= 1
    # an adapter added to the folder is picked up without a restart
    shutil.copytree(lora_dir / "A", lora_dir / "C")
    [c] = run(flux, [params([("C", 1.0)])])
    assert c.ok and np.abs(pixels(c.images[0]) - refs["A"]).max() <= 1, c.error
    metrics = httpx.get(flux.http + "/metrics", timeout=10).text
    assert 'disagg_lora_loads_total{instance="denoiser-0",role="denoiser"}' in metrics, metrics[-2000:]
    assert 'disagg_lora_hits_total{instance="denoiser-0",role="denoiser"}' in metrics


def test_flux_with_batching_a_batch_holds_one_set_of_adapters(flux_files, module_tmp):
    folder, lora_dir, refs = flux_files
    for dep in served(module_tmp, "batch-run", folder, lora_dir, "--max-batch", "4"):
        # two requests with adapter A may share forwards; the others each run with their own
        cases = [params(loras) for loras in CASES.values()] + [params(CASES["A"], seed=8)]
        outcomes = run(dep, cases)
        extra = expected(folder, lora_dir, CASES["A"], seed=8)
        for name, o, ref in zip([*CASES, "A seed 8"], outcomes, [*refs.values(), extra]):
            assert o.ok, o.error
            diff = int(np.abs(pixels(o.images[0]) - ref).max())
            assert diff <= 1, f"{name}: worst pixel {diff}"


def test_with_one_slot_the_next_adapter_is_hotswapped_into_the_last_ones_place(flux_files, module_tmp):
    folder, lora_dir, refs = flux_files
    b_ref = expected(folder, lora_dir, [("B", 0.5)])
    for dep in served(module_tmp, "flux-one-slot", folder, lora_dir, "--lora-slots", "1"):
        for name, loras, ref in (("A", CASES["A"], refs["A"]), ("B", [("B", 0.5)], b_ref), ("A again", CASES["A"], refs["A"])):
            (o,) = run(dep, [params(loras)])  # one at a time: each evicts the last one
            assert o.ok, o.error
            diff = int(np.abs(pixels(o.images[0]) - ref).max())
            assert diff <= 1, f"{name}: worst pixel {diff}"
        logs = "".join(f.read_text(errors="replace") for f in dep.run_dir.rglob("*.log"))
        assert "loaded adapter B (" in logs and "in place of A (hotswap)" in logs, logs[-3000:]
        assert "in place of B (hotswap)" in logs, logs[-3000:]
        with Client(dep.endpoint) as client:
            held = {i.role: list(i.lora.held) for i in client.status().instances}
        assert held["denoiser"] == ["A"], held


def test_an_adapter_file_rewritten_in_place_does_not_fault_the_instance_that_loaded_it(flux_files, module_tmp):
    import diffusers

    from disagg.roles.extensions.lora_backends import DiffusersLoras
    from disagg.roles.extensions.loras import LoraBank

    folder, lora_dir, refs = flux_files
    shutil.copytree(lora_dir / "A", module_tmp / "rewritten" / "A")
    pipe = diffusers.FluxPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    bank = LoraBank(DiffusersLoras(pipe, "denoiser"), slots=2, max_bytes=1 << 30)
    wanted = [LoraRef(name="A")]
    bank.acquire(wanted, {"A": str(module_tmp / "rewritten" / "A")})
    # a user copies a new version over the file (safetensors had mapped it: the next forward faulted, SIGBUS)
    (module_tmp / "rewritten" / "A" / "pytorch_lora_weights.safetensors").write_bytes(b"a newer version")
    with bank.use(wanted):
        image = pipe(prompt=PROMPT, width=64, height=64, num_inference_steps=2, guidance_scale=3.5,
                     generator=torch.Generator("cpu").manual_seed(3)).images[0]
    bank.release(["A"])
    assert int(np.abs(np.asarray(image.convert("RGB"), dtype=np.int16) - refs["A"]).max()) <= 1


def test_with_host_slots_an_unloaded_adapter_comes_back_from_host_memory_without_its_file(flux_files, module_tmp):
    folder, lora_dir, refs = flux_files
    b_ref = expected(folder, lora_dir, [("B", 0.5)])
    mine = module_tmp / "host-loras"  # a copy: A's file is broken below
    for name in ("A", "B"):
        shutil.copytree(lora_dir / name, mine / name)
    for dep in served(module_tmp, "flux-host", folder, mine, "--lora-slots", "1", "--lora-host-slots", "4"):
        for name, loras, ref in (("A", CASES["A"], refs["A"]), ("B", [("B", 0.5)], b_ref)):
            (o,) = run(dep, [params(loras)])  # B's load moves A to host memory
            assert o.ok, o.error
            assert int(np.abs(pixels(o.images[0]) - ref).max()) <= 1, name
        # A's file is no longer readable: only its copy in host memory can serve it
        (mine / "A" / "pytorch_lora_weights.safetensors").write_bytes(b"broken")
        (o,) = run(dep, [params(CASES["A"])])
        assert o.ok, o.error
        diff = int(np.abs(pixels(o.images[0]) - refs["A"]).max())
        assert diff <= 1, f"A restored: worst pixel {diff}"

        def denoiser(dep=dep):
            with Client(dep.endpoint) as client:
                [den] = [i for i in client.status().instances if i.role == "denoiser"]
            return den if den.lora.restores >= 1 else None

        den = wait_until(denoiser, timeout=10)  # its next heartbeat tells
        assert den.lora.held == ["A"] and den.lora.host == ["B"] and den.lora.loads == 2 and den.lora.restores == 1
        logs = "".join(f.read_text(errors="replace") for f in dep.run_dir.rglob("*.log"))
        assert "restored adapter A from host memory" in logs and "hotswap" not in logs, logs[-3000:]


def test_sdxl_adapters_in_flight_together_match_diffusers(module_tmp):
    folder, lora_dir = family_setup(module_tmp, "sdxl")
    # T carries a text-encoder part too: it loads into the encoder, its UNet part into the denoiser. U is T's UNet
    # part alone (same seed), for the check that the text-encoder part changes the image.
    make_lora(folder, lora_dir / "T", seed=5, text_encoder=True)
    make_lora(folder, module_tmp / "sdxl-unet-only" / "U", seed=5)
    cases = {**CASES, "T": [("T", 0.8)], "T+A": [("T", 1.0), ("A", 0.5)]}
    refs = {name: expected(folder, lora_dir, loras) for name, loras in cases.items()}
    unet_only = expected(folder, module_tmp / "sdxl-unet-only", [("U", 0.8)])
    assert np.abs(refs["T"] - unet_only).max() > 8, "the text-encoder part must change diffusers' image"
    for dep in served(module_tmp, "sdxl-run", folder, lora_dir, "--capacity", "3,3,1"):
        outcomes = run(dep, [params(loras) for loras in cases.values()], concurrency=5)
        for name, o in zip(cases, outcomes):
            assert o.ok, o.error
            diff = int(np.abs(pixels(o.images[0]) - refs[name]).max())
            assert diff <= 1, f"{name}: worst pixel {diff}"

        def held(dep=dep):
            with Client(dep.endpoint) as client:
                return {i.role: set(i.lora.held) for i in client.status().instances}

        # an instance's adapters reach the orchestrator with its next heartbeat (each second), which may come after
        # the last image: T's requests can pass the denoiser and decoder in less than that, and a denoiser's
        # heartbeat between T's load and B's said {A, T} once
        wait_until(lambda: "T" in (h := held())["encoder"] and {"A", "B", "T"} <= h["denoiser"], timeout=10, why=held)
        # issue 42 L4: the encoder holds A and B as names only (no text-encoder part): they take none of its slots,
        # and its status says how many of its adapters are such
        with Client(dep.endpoint) as client:
            encoder = next(i for i in client.status().instances if i.role == "encoder")
        assert encoder.lora.names_only == len(set(encoder.lora.held) - {"T"}) >= 2, encoder
