"""One instance's ranks (disagg/roles/parallel.py Group), piece by piece: ring attention's backend, chosen before
diffusers' context parallelism is enabled (issue 44 H3), and followers that wait out any idleness for the next
request, over two real processes and a real gloo group (issue 44 H4)."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from disagg.launcher.ports import free_port_pair
from disagg.roles import parallel
from disagg.roles.parallel import RING_BACKEND, Group, ring_backend
from disagg.transport.wire.messages import GenerationParams

# --- ring attention's backend (H3) ----------------------------------------------------------------------------


def test_ring_attention_runs_a_backend_that_returns_its_log_sum_exp_or_is_refused_saying_why():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    assert ring_backend("cuda", torch.bfloat16) == ring_backend("cuda", torch.float16) == RING_BACKEND
    # diffusers runs it context parallel (enable_parallelism refuses a backend that does not)
    assert _AttentionBackendRegistry._is_context_parallel_available(AttentionBackendName(RING_BACKEND))
    with pytest.raises(ValueError, match="none does on cpu: use ulysses"):
        ring_backend("cpu", torch.float32)
    with pytest.raises(ValueError, match="this model's weights are float32: set dtype bfloat16"):
        ring_backend("cuda", torch.float32)


def test_diffusers_default_backend_refuses_what_ring_attention_asks():
    """Why a backend is set at all: the `native` forward op, the default's, refuses return_lse (diffusers 0.42.1)."""
    from diffusers.models.attention_dispatch import _native_attention_forward_op

    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="return_lse"):
        _native_attention_forward_op(None, q, q, q, return_lse=True, _save_ctx=False)


def test_a_ring_layout_sets_the_backend_on_every_attention_before_enabling_parallelism(monkeypatch):
    """Group.apply on a ring 2 rank of a GPU instance (no GPU touched: the backend is a name on each processor)."""
    from diffusers import FluxTransformer2DModel
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from disagg.roles.pipelines.tiny import TRANSFORMER_CONFIG

    # set_attention_backend also makes it the process's active backend: put the default back after the test
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", _AttentionBackendRegistry._active_backend)
    model = FluxTransformer2DModel(**TRANSFORMER_CONFIG).to(torch.bfloat16)
    seen = []

    def enable_parallelism(config):
        seen.append({getattr(m.processor, "_attention_backend", None) for m in model.modules() if hasattr(m, "processor")})
        seen.append(config.ring_degree)

    monkeypatch.setattr(model, "enable_parallelism", enable_parallelism)
    group = object.__new__(Group)
    group.layout, group.world, group.device = {"cfg": 1, "ulysses": 1, "ring": 2}, 2, torch.device("cuda")
    group.mesh = {("ring", "ulysses"): None}
    group.apply(model)
    assert seen == [{RING_BACKEND}, 2]


# --- an idle group (H4) ----------------------------------------------------------------------------------------

#: the collectives' timeout in this test: short, so the idleness below is many of them
TIMEOUT_S = 3.0
#: how long rank 0 stays idle before its request: five of the collectives' timeouts
IDLE_S = 5 * TIMEOUT_S


class Echo:
    """A stage whose request is a few of the steps' go-ons and one all_reduce of its input: run in lockstep."""

    def __init__(self, group: Group, out):
        self.group, self.out = group, out

    def run(self, params: GenerationParams, inputs: dict) -> None:
        import torch.distributed as dist

        for _ in range(params.num_inference_steps):
            assert self.group.go_on()
        x = inputs["x"].clone()
        dist.all_reduce(x)
        self.out.put(("ran", self.group.rank, params.prompt, x.tolist()))


def one_rank(rank: int, init: str, out, start) -> None:
    """A rank of a 2-rank Ulysses group on the CPU whose collectives time out after TIMEOUT_S."""
    parallel.COLLECTIVE_TIMEOUT_S = TIMEOUT_S  # read when the Group is made
    start.wait()  # both ranks imported torch: they join within the short timeout
    group = Group({"ulysses": 2}, rank, init, "cpu")
    stage = Echo(group, out)
    try:
        if rank == 0:
            threading.Event().wait(IDLE_S)  # idle: time itself must pass
            params = GenerationParams(prompt="after a long idle", num_inference_steps=3)
            try:
                group.share(params, {"x": torch.tensor([1.0, 2.0])})
                stage.run(params, {"x": torch.tensor([1.0, 2.0])})
            except Exception as exc:  # noqa: BLE001 - the follower is gone: say so
                out.put(("rank 0 failed", repr(exc)))
            group.stop()
            out.put(("exit", 0, 0))
        else:
            out.put(("exit", 1, parallel.serve_follower(group, stage)))
    finally:
        group.close()


@pytest.mark.timeout(300)
def test_an_idle_group_outlives_many_collective_timeouts_then_serves_a_request():
    ctx = multiprocessing.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(2)
    init = f"tcp://127.0.0.1:{free_port_pair()}"
    procs = [ctx.Process(target=one_rank, args=(rank, init, out, start), daemon=True) for rank in (0, 1)]
    for p in procs:
        p.start()
    got = []
    try:
        while sum(1 for g in got if g[0] == "exit") < 2:
            got.append(out.get(timeout=240))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert ("exit", 1, 0) in got, got  # the follower left because rank 0 said stop, not because it timed out
    ran = sorted(g for g in got if g[0] == "ran")
    assert ran == [("ran", 0, "after a long idle", [2.0, 4.0]), ("ran", 1, "after a long idle", [2.0, 4.0])], got
