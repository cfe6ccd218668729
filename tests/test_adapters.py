"""The model-adapter interface (disagg/roles/pipelines/adapter.py): every adapter declares its capabilities and
implements what they name."""

from __future__ import annotations

import pytest

from disagg.roles.errors import RequestError
from disagg.roles.pipelines import model_spec
from disagg.roles.pipelines.adapter import Capabilities, ModelAdapter, check_adapter
from disagg.roles.pipelines.payload import PayloadAdapter
from disagg.roles.pipelines.sim import SimAdapter
from disagg.roles.stage import Stage
from disagg.transport.messages import GenerationParams


def built_in_adapters():
    from disagg.roles.pipelines.tiny import TinyFluxAdapter

    for role in ("encoder", "denoiser", "decoder", "monolith"):
        yield "payload", PayloadAdapter(role)
        yield "sim:zero", SimAdapter("zero", role)
        yield "tiny", TinyFluxAdapter("all" if role == "monolith" else role)


def test_every_built_in_adapter_declares_capabilities_that_its_methods_and_its_model_spec_agree_with():
    for model, adapter in built_in_adapters():
        caps = check_adapter(adapter)
        assert isinstance(caps, Capabilities)
        # the launcher's torch-free view of the model (pool sizes, max_batch) says what its adapter can do
        assert model_spec(model).step_batching == caps.batching, model


class Plain:
    """The least an adapter is: its capabilities and the stage methods."""

    capabilities = Capabilities()

    @staticmethod
    def defaults() -> dict:
        return dict(width=8, height=8, num_inference_steps=1, num_images_per_prompt=1, seed=0)

    def encode(self, p):
        raise self.error

    def denoise(self, inputs, p, progress=None):
        return inputs

    def decode(self, inputs, p):
        return []

    def components_loaded(self):
        return {}


def test_an_adapter_is_checked_against_what_it_declares():
    assert isinstance(Plain(), ModelAdapter) and check_adapter(Plain()) == Capabilities()

    class ClaimsBatching(Plain):
        capabilities = Capabilities(batching=True)

    with pytest.raises(TypeError, match="ClaimsBatching declares batching but does not implement StepBatching"):
        Stage("denoiser", ClaimsBatching())

    class NoCapabilities:
        def defaults(self):
            return {}

    with pytest.raises(TypeError, match="NoCapabilities is not a model adapter"):
        Stage("encoder", NoCapabilities())


def test_a_model_without_image_capabilities_refuses_an_image_whatever_it_has_else():
    adapter = Plain()
    adapter.error = AssertionError("not reached: the request is refused before any compute")
    with pytest.raises(RequestError, match="takes text-to-image") as err:
        Stage("encoder", adapter, model="plain").run(GenerationParams(prompt="p", image=b"png"), {})
    assert err.value.param == "image"
