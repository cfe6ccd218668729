"""LoRA adapters in one role's model, in this process (disagg/roles/extensions/lora_backends.py DiffusersLoras, with LoraBank): an
adapter's alpha, however its file carries it, applied as diffusers' own load of the file applies it; a compiled
denoiser's in-place scales, with no recompile for another scale, no adapter or a hotswap, and a hotswapped adapter at
its own scaling. The tiny Flux and SDXL, against diffusers' pipeline loading the same files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disagg.transport.wire.messages import LoraRef
from tests.checkpoints import save_tiny
from tests.loras import make_lora
from tests.test_loras import CASES, PROMPT, expected, flux_files  # noqa: F401 - flux_files: the same adapters' files

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread")]


@pytest.mark.parametrize("form", ["metadata", "alpha keys"])
def test_an_adapter_trained_with_another_alpha_applies_at_its_own_strength(flux_files, module_tmp, form):
    """An adapter with alpha 8 at rank 4, saved by diffusers (the alpha in the file's metadata) or with `.alpha` keys
    beside its weights, equals diffusers' own load of the file (scaling 2, not 1): diffusers reads the metadata from
    files only and returns the alphas apart from the weights, and a role installs from the weights in memory."""
    import diffusers
    import safetensors.torch

    from disagg.roles.extensions.lora_backends import DiffusersLoras

    folder, lora_dir, _ = flux_files
    where = module_tmp / f"alpha-{form.replace(' ', '-')}"
    if form == "metadata":
        make_lora(folder, where / "D", seed=4, alpha=8)
    else:
        state = safetensors.torch.load_file(lora_dir / "A" / "pytorch_lora_weights.safetensors")
        state.update({f"{k.rsplit('.lora_A', 1)[0]}.alpha": torch.tensor(8.0) for k in list(state) if ".lora_A" in k})
        (where / "D").mkdir(parents=True)
        safetensors.torch.save_file(state, where / "D" / "pytorch_lora_weights.safetensors")
    pipe = diffusers.FluxPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    bank = DiffusersLoras(pipe, "denoiser")
    state, _ = bank.read("D", str(where / "D"))
    bank.install("D", state)
    bank.activate((("D", 0.7),))
    got = np.asarray(pipe(prompt=PROMPT, width=64, height=64, num_inference_steps=2, guidance_scale=3.5,
                          generator=torch.Generator("cpu").manual_seed(3)).images[0].convert("RGB"), dtype=np.int16)
    want = expected(folder, where, [("D", 0.7)])
    assert int(np.abs(got - want).max()) <= 1


def test_a_kohya_sdxl_adapter_with_alphas_loads_at_diffusers_strength_on_the_denoiser_and_encoder(module_tmp):
    """kohya's SDXL format (lora_unet_* / lora_te1_*, lora_down / lora_up, an `.alpha` of 8 at rank 4 per layer): each
    LoRA layer's scaling times its up weight equals diffusers' own load of the file, on the UNet and the text encoder."""
    import diffusers
    import safetensors.torch
    from peft.tuners.lora import LoraLayer

    from disagg.roles.extensions.lora_backends import DiffusersLoras

    folder = module_tmp / "sdxl-kohya"
    save_tiny("sdxl", folder)
    peft_file = make_lora(folder, module_tmp / "sdxl-kohya-peft", seed=6, text_encoder=True)
    kohya = {}
    for key, value in safetensors.torch.load_file(peft_file / "pytorch_lora_weights.safetensors").items():
        component, rest = key.split(".", 1)
        module, _, ab = rest.rpartition(".lora_")
        name = {"unet": "lora_unet_", "text_encoder": "lora_te1_"}[component] + module.replace(".", "_")
        kohya[name + (".lora_down.weight" if ab.startswith("A") else ".lora_up.weight")] = value
        kohya[name + ".alpha"] = torch.tensor(8.0)
    (module_tmp / "sdxl-kohya-lora").mkdir()
    safetensors.torch.save_file(kohya, module_tmp / "sdxl-kohya-lora" / "pytorch_lora_weights.safetensors")

    def applied(pipe, component):
        return sorted(float(layer.scaling["K"]) * float(layer.lora_B["K"].weight.detach().abs().sum())
                      for layer in getattr(pipe, component).modules() if isinstance(layer, LoraLayer) and "K" in layer.scaling)

    ref = diffusers.StableDiffusionXLPipeline.from_pretrained(folder)
    ref.load_lora_weights(module_tmp / "sdxl-kohya-lora", adapter_name="K")
    for role, component in (("denoiser", "unet"), ("encoder", "text_encoder")):
        pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(folder)
        bank = DiffusersLoras(pipe, role)
        state, _ = bank.read("K", str(module_tmp / "sdxl-kohya-lora"))
        bank.install("K", state)
        got, want = applied(pipe, component), applied(ref, component)
        assert len(got) == len(want) > 0 and np.allclose(got, want, rtol=1e-5), (component, got[:3], want[:3])


def test_a_hotswapped_adapter_takes_its_own_scaling_on_a_compiled_denoiser(flux_files):
    """Issue 44 L1: the compiled bank writes weight x each layer's scaling at weight 1 into peft's scaling tensors;
    after a hotswap, that is the new adapter's (its alpha / rank, which peft wrote in place), not the old one's.
    C carries its alpha (8, rank 4) as diffusers-format `.alpha` keys, A none (alpha = rank)."""
    import diffusers
    from peft.tuners.lora import LoraLayer

    from disagg.roles.extensions.lora_backends import DiffusersLoras

    folder, lora_dir, _ = flux_files

    def scalings(pipe, name):
        return [float(layer.scaling[name]) for layer in pipe.transformer.modules()
                if isinstance(layer, LoraLayer) and name in layer.scaling]

    pipe = diffusers.FluxPipeline.from_pretrained(folder)
    bank = DiffusersLoras(pipe, "denoiser", compiled=True)
    a, _ = bank.read("A", str(lora_dir / "A"))
    c, _ = bank.read("C", str(lora_dir / "B"))
    c.update({f"{k.rsplit('.lora_A', 1)[0]}.alpha": torch.tensor(8.0) for k in list(c) if ".lora_A" in k})
    assert not bank.install("A", a)
    bank.activate((("A", 0.5),))
    assert bank.install("C", c, into="A")  # hotswapped: the same layers and rank
    bank.activate((("C", 0.5),))
    # diffusers' own: C loaded alone at weight 0.5
    ref = diffusers.FluxPipeline.from_pretrained(folder)
    ref.load_lora_weights(dict(c), adapter_name="C")
    ref.set_adapters(["C"], [0.5])
    want = scalings(ref, "C")
    assert set(want) == {1.0}  # 0.5 x 8 / 4: the alpha counts
    assert scalings(pipe, bank.alias["C"]) == want


def test_a_compiled_denoiser_takes_other_scales_no_adapter_and_a_hotswap_without_recompiling(flux_files, module_tmp):
    """The piece alone, in this process (dynamo's graph count is visible here): a compiled transformer whose bank
    keeps every adapter active and writes each request's scales in place."""
    import diffusers
    import torch._dynamo.utils as dynamo_utils

    from disagg.roles.extensions.lora_backends import DiffusersLoras
    from disagg.roles.extensions.loras import LoraBank

    folder, lora_dir, refs = flux_files
    make_lora(folder, module_tmp / "compiled-extra" / "C", seed=3)
    sources = {"A": str(lora_dir / "A"), "B": str(lora_dir / "B"), "C": str(module_tmp / "compiled-extra" / "C")}
    pipe = diffusers.FluxPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    bank = LoraBank(DiffusersLoras(pipe, "denoiser", compiled=True), slots=2, max_bytes=1 << 30)
    pipe.transformer.compile_repeated_blocks(fullgraph=True)

    def generate(loras):
        wanted = [LoraRef(name=n, scale=s) for n, s in loras]
        bank.acquire(wanted, sources)
        try:
            with bank.use(wanted):
                image = pipe(prompt=PROMPT, width=64, height=64, num_inference_steps=2, guidance_scale=3.5,
                             generator=torch.Generator("cpu").manual_seed(3)).images[0]
        finally:
            bank.release([n for n, _ in loras])
        return np.asarray(image.convert("RGB"), dtype=np.int16)

    got = {"A+B": generate(CASES["A+B"])}  # both adapters' layers appear: the one recompile
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    got["A"] = generate(CASES["A"])
    got["none"] = generate(CASES["none"])
    got["B 0.3"] = generate([("B", 0.3)])
    got["C"] = generate([("C", 1.0)])  # two slots: C is hotswapped into the least recently used one's place
    assert bank.backend.hotswaps == 1 and len(bank.held) == 2, (bank.backend.hotswaps, bank.held)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "a scale, no adapter or a hotswap recompiled"
    want = {**refs, "B 0.3": expected(folder, lora_dir, [("B", 0.3)]),
            "C": expected(folder, module_tmp / "compiled-extra", [("C", 1.0)])}
    for name, image in got.items():
        diff = int(np.abs(image - want[name]).max())
        assert diff <= 2, f"{name}: worst pixel {diff}"
