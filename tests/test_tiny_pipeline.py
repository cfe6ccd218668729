"""The tiny Flux builder and adapter in one process: roles load only their components."""

import pytest
import torch

from disagg.roles.pipelines import ModelError, load_adapter
from disagg.roles.pipelines.tiny import TinyFluxAdapter, build_component
from disagg.roles.stage import Stage
from disagg.transport.wire.messages import GenerationParams


def test_each_role_loads_only_its_components():
    enc, den, dec = (TinyFluxAdapter(r) for r in ("encoder", "denoiser", "decoder"))
    assert set(enc.components_loaded()) == {"text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"}
    assert enc.pipe.transformer is None and enc.pipe.vae is None
    assert den.pipe.text_encoder is None and den.pipe.text_encoder_2 is None and den.pipe.vae is None
    assert dec.pipe.transformer is None and dec.pipe.text_encoder is None
    assert den.components_loaded()["transformer"] > 0 and dec.components_loaded()["vae"] > 0


def test_components_are_identical_across_builds():
    a, b = build_component("transformer"), build_component("transformer")
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n


def test_stages_chain_and_prompts_matter():
    stages = {r: Stage(r, TinyFluxAdapter(r)) for r in ("encoder", "denoiser", "decoder")}

    def run(prompt):
        params = GenerationParams(prompt=prompt, width=32, height=32, num_inference_steps=1, seed=1)
        emb = stages["encoder"].run(params, {}).tensors
        lat = stages["denoiser"].run(params, emb).tensors
        return emb, stages["decoder"].run(params, lat).images

    emb_a, png_a = run("a red cat")
    emb_b, png_b = run("a blue house")
    assert not torch.equal(emb_a["prompt_embeds"], emb_b["prompt_embeds"])
    assert png_a[0].startswith(b"\x89PNG") and png_a != png_b


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        load_adapter("nope", "encoder")
