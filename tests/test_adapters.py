"""The model-adapter interface (disagg/roles/pipelines/adapter.py): every adapter declares its capabilities and
implements what they name; a role's compute reports each failure by the exception's type, never by its name or
text (disagg/roles/compute.py)."""

from __future__ import annotations

import pytest

from disagg.roles.compute import Cancelled, StageRunner
from disagg.roles.errors import GroupBroken, RequestError
from disagg.roles.pipelines import model_spec
from disagg.roles.pipelines.adapter import Capabilities, ModelAdapter, check_adapter
from disagg.roles.pipelines.payload import PayloadAdapter
from disagg.roles.pipelines.sim import SimAdapter
from disagg.roles.stage import Stage
from disagg.transport.data.allocator import PoolFull
from disagg.transport.data.engines import TransferError
from disagg.transport.wire.messages import Dead, ErrorCode, Failed, GenerationParams, Run


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


@pytest.mark.parametrize("family", ["flux", "sd3", "sdxl", "wan21", "qwen"])
def test_every_checkpoint_familys_adapter_is_a_model_adapter_in_every_role(family, tmp_path):
    """Each family's adapter, built from a tiny checkpoint of it, passes the interface's check in every role
    (Qwen-Image, which has no encode of its own, was refused at boot: its roles never started)."""
    from disagg.roles.pipelines import load_adapter
    from tests.checkpoints import save_tiny

    save_tiny(family, tmp_path)
    for role in ("encoder", "denoiser", "decoder", "monolith"):
        caps = check_adapter(load_adapter(str(tmp_path), role, "cpu", "float32"))
        assert caps.family and caps.image_tasks, (family, role)


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


class GroupBrokenByName(RuntimeError):
    """Another error that a class-name match would take for a broken group."""


GroupBrokenByName.__name__ = "GroupBroken"


@pytest.mark.parametrize("error, code, retryable, param", [
    (RequestError("width: too wide", param="width"), ErrorCode.INVALID_INPUT, False, "width"),
    (TransferError("peer gone"), ErrorCode.GENERATION_FAILED, True, None),
    (PoolFull("pool full: need 512 bytes"), ErrorCode.GENERATION_FAILED, True, None),
    # a full pool is retried by its type, whatever its text says ("does not fit" was once matched)
    (PoolFull("this slot does not fit now"), ErrorCode.GENERATION_FAILED, True, None),
    (PoolFull("a payload of 9 bytes does not fit the 8-byte pool", transient=False), ErrorCode.GENERATION_FAILED,
     False, None),
    (ValueError("model bug"), ErrorCode.GENERATION_FAILED, False, None),
    (GroupBrokenByName("not a group's failure"), ErrorCode.GENERATION_FAILED, False, None),
])
def test_a_failed_compute_is_reported_by_its_exception_type(error, code, retryable, param):
    failed = run_failing(error)
    assert isinstance(failed, Failed) and failed.request_id == "r1" and failed.attempt == 2
    assert (failed.code, failed.retryable, failed.param) == (code, retryable, param)
    assert failed.error == f"{type(error).__name__}: {error}"


def test_a_broken_group_reports_the_instance_dead_and_a_cancel_reports_cancelled():
    runner = []
    dead = run_failing(GroupBroken("the instance's ranks lost each other"), runner)
    assert isinstance(dead, Dead) and dead.reason == "the instance's ranks lost each other" and runner[0].broken
    cancelled = run_failing(Cancelled("request r1 was cancelled by its client"))
    assert (cancelled.code, cancelled.retryable, cancelled.error) == (
        ErrorCode.CANCELLED, False, "request r1 was cancelled by its client")


def run_failing(error: Exception, keep: list | None = None):
    """Run one request on an encoder whose compute raises `error`; the one message it reports."""
    reports = []
    adapter = Plain()
    adapter.error = error
    runner = StageRunner("encoder-0", None, {}, lambda msg, *frames: reports.append(msg))
    runner.stage = Stage("encoder", adapter, model="plain")
    if keep is not None:
        keep.append(runner)
    runner.execute(Run(request_id="r1", attempt=2, params=GenerationParams(prompt="p")), [], 0.0)
    [message] = [m for m in reports if m is not None]
    assert reports[-1] is None  # and then: the compute finished
    return message
