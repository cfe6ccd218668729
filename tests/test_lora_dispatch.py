"""LoRA adapters on the orchestrator's side, on a fake clock: the catalog, validation at Submit, affinity and its
load rule, the patience for a busy holder; and the pieces around them (sim profiles from a path, bench's draws)."""

from __future__ import annotations

import random

import pytest

from disagg.client import Outcome
from disagg.launcher.bench.load import run_load, zipf_names
from disagg.orchestrator.scheduling.loras import LoraCatalog, scan
from disagg.orchestrator.scheduling.placement import LoraPatience, affinity_rule
from disagg.roles.extensions.lora_backends import SimLoras
from disagg.roles.extensions.loras import USE_WINDOW, LoraBank
from disagg.roles.pipelines.sim_profile import load_profile
from disagg.settings.schema import LoraSettings
from disagg.transport.wire.messages import (
    ErrorCode,
    GenerationParams,
    Heartbeat,
    LoraRef,
    LoraStats,
    Rejected,
    RequestCounts,
    StatusReport,
)
from tests.test_router import Harness, runs, staged


def lora_harness(tmp_path, affinity="on", **loras):
    (tmp_path / "A.safetensors").write_bytes(b"x")
    (tmp_path / "B").mkdir()
    (tmp_path / "B" / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    return Harness(loras=LoraSettings(dir=str(tmp_path), affinity=affinity, **loras))


def test_the_catalog_is_the_folders_adapters_and_the_named_ones_and_sees_new_files(tmp_path):
    (tmp_path / "A.safetensors").write_bytes(b"x")
    (tmp_path / "B").mkdir()
    (tmp_path / "B" / "weights.safetensors").write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "bad name!.safetensors").write_bytes(b"x")
    assert sorted(scan(str(tmp_path))) == ["A", "B"]
    cat = LoraCatalog(str(tmp_path), {"hub": "someone/some-lora"})
    assert cat.resolve([LoraRef(name="A"), LoraRef(name="hub")])[0] == {"A": str(tmp_path / "A.safetensors"),
                                                                          "hub": "someone/some-lora"}
    _, why = cat.resolve([LoraRef(name="C")])
    assert "unknown adapter 'C'" in why and "A, B, hub" in why
    (tmp_path / "C.safetensors").write_bytes(b"x")  # added while it runs: the folder changed, it is read again
    assert cat.resolve([LoraRef(name="C")])[1] == ""
    assert "named twice" in cat.resolve([LoraRef(name="A"), LoraRef(name="A", scale=0.5)])[1]
    assert "max_per_request (1)" in LoraCatalog(str(tmp_path), max_per_request=1).resolve(
        [LoraRef(name="A"), LoraRef(name="B")])[1]
    assert LoraCatalog(any_name=True).resolve([LoraRef(name="sim-lora-7")]) == ({"sim-lora-7": ""}, "")


def test_an_unknown_adapter_is_refused_at_submit_naming_it(tmp_path):
    h = lora_harness(tmp_path)
    h.add("encoder"), h.add("denoiser"), h.add("decoder")
    [out] = h.submit("r1", loras=[LoraRef(name="nope")])
    assert isinstance(out.msg, Rejected) and out.msg.param == "loras" and out.msg.code == ErrorCode.INVALID_REQUEST
    assert "'nope'" in out.msg.reason and h.router.requests == {}
    [(enc, run)] = runs(h.submit("r2", loras=[LoraRef(name="B", scale=0.5)]))
    assert run.lora_sources == {"B": str(tmp_path / "B")}


def to_denoiser(h, rid, names=("A",), **params):
    """Submit `rid` with adapters and let the encoder finish it: the Run that places it on a denoiser (or None)."""
    [(enc, _)] = runs(h.submit(rid, loras=[LoraRef(name=n) for n in names], **params))
    out = runs(h.role(enc, staged(enc, rid)))
    return out[0] if out else None


def holding(h, iid, names):
    h.role(iid, Heartbeat(instance_id=iid, lora=LoraStats(held=list(names), slots=4)))


def test_a_denoiser_that_holds_the_adapter_gets_it_within_the_load_rule(tmp_path):
    h = lora_harness(tmp_path, affinity="slack")
    h.add("encoder", capacity=8), h.add("denoiser", 3, capacity=2), h.add("decoder")
    holding(h, "denoiser-2", ["A"])
    assert to_denoiser(h, "r1")[0] == "denoiser-2"  # all have 2 free: the holder
    assert to_denoiser(h, "r2")[0] == "denoiser-2"  # it has 1 free, others 2: within the slack, still it
    # now it is full: none holds A and is free, but it will be soon: r3 waits for it (a load takes longer)
    h.router.placement.lora_loads.load_s["denoiser"] = 0.8
    assert to_denoiser(h, "r3") is None
    # a request for B is placed meanwhile (the queue behind a waiting one moves on); it goes cold where a load
    # evicts nothing: denoiser-0 and -1 hold no adapter
    assert to_denoiser(h, "r4", names=("B",))[0] in ("denoiser-0", "denoiser-1")
    # after a load's time, r3 takes a cold instance (and A spreads)
    [(den, run)] = runs(h.tick(0.9))
    assert run.request_id == "r3" and den != "denoiser-2"


def test_the_slack_rule_sends_a_request_elsewhere_when_the_holder_is_much_busier(tmp_path):
    h = lora_harness(tmp_path, affinity="slack")
    h.add("encoder", capacity=8), h.add("denoiser", 2, capacity=4), h.add("decoder")
    holding(h, "denoiser-1", ["A"])
    for k in range(2):
        assert to_denoiser(h, f"w{k}")[0] == "denoiser-1"  # 4 free vs 4, then 3 vs 4: the holder
    # 2 free against 4: more than one slot more elsewhere, so the cold one
    assert to_denoiser(h, "w2")[0] == "denoiser-0"


def cost_harness(tmp_path, affinity="cost"):
    """The `cost` rule over two denoisers: one request alone costs 0.7 s on each, a load 0.8 s (the requests'
    waits for loads, before any heartbeat says better)."""
    h = lora_harness(tmp_path, affinity=affinity)
    h.add("encoder", capacity=8), h.add("decoder")
    d0, d1 = h.add("denoiser", 2, capacity=4)
    for iid in (d0, d1):
        h.router.registry.get(iid).solo_s = 0.7
    h.router.placement.lora_loads.load_s["denoiser"] = 0.8
    return h, d0, d1


def test_the_cost_rule_sends_a_request_where_it_is_expected_to_finish_first(tmp_path):
    h, d0, d1 = cost_harness(tmp_path)
    holding(h, d1, ["A"])
    assert to_denoiser(h, "r1")[0] == d1  # warm and idle: 0.7 s, against 0.8 + 0.7 cold
    assert to_denoiser(h, "r2")[0] == d1  # warm behind one: 1.4 s, against 1.5 cold
    assert to_denoiser(h, "r3")[0] == d0  # warm behind two: 2.1 s; the cold one loads while idle: 1.5 s
    # d1's two are nearly done (its heartbeat says so) and d0 holds A now too: both warm, d1 finishes first
    h.role(d1, Heartbeat(instance_id=d1, lora=LoraStats(held=["A"], slots=4), steps={"r1": [3, 4], "r2": [3, 4]}))
    assert to_denoiser(h, "r4")[0] == d1
    # a load that evicts an adapter costs half a load more: with B cold everywhere, the instance with a free
    # adapter slot gets it even with more work
    h.role(d0, Heartbeat(instance_id=d0, lora=LoraStats(held=["A", "C", "D", "E"], slots=4), steps={"r3": [3, 4]}))
    assert to_denoiser(h, "r5", names=("B",))[0] == d1
    # it never waits for a busy holder: with both full, the request queues for whichever frees first
    assert h.router.placement.step(LoraPatience) is None  # the cost rule leaves patience out of the chain


def test_the_cost_rule_counts_a_load_at_what_the_instances_own_loads_took(tmp_path):
    h, d0, d1 = cost_harness(tmp_path)
    holding(h, d1, ["A"])
    assert [to_denoiser(h, f"r{k}")[0] for k in range(2)] == [d1, d1]  # warm: 0.7 s, then 1.4 s; cold 1.5 s
    # d0's loads take it 3 s: A warm behind two (2.1 s) beats loading it there (3.7 s)
    h.role(d0, Heartbeat(instance_id=d0, lora=LoraStats(slots=4, load_s=3.0)))
    assert to_denoiser(h, "r2")[0] == d1
    # now they take 0.5 s: behind three (2.8 s) it loads on d0 instead (1.2 s)
    h.role(d0, Heartbeat(instance_id=d0, lora=LoraStats(slots=4, load_s=0.5)))
    assert to_denoiser(h, "r3")[0] == d0
    # a request without adapters is placed by the policy as ever
    assert to_denoiser(h, "n1", names=())[0] in (d0, d1)


def test_auto_is_on_without_host_memory_and_cost_once_a_denoiser_keeps_adapters_there(tmp_path):
    """loras.affinity auto, the default: each rule where BENCHMARKS.md measured it best."""
    assert LoraSettings().affinity == "auto"
    for tier in (False, True):
        (tmp_path / str(tier)).mkdir()
        h, d0, d1 = cost_harness(tmp_path / str(tier), affinity="auto")
        assert affinity_rule(h.router.config, h.router.registry) == "on"
        if tier:  # host memory comes with a heartbeat, after registration
            h.role(d0, Heartbeat(instance_id=d0, lora=LoraStats(slots=4, host_slots=8)))
        assert affinity_rule(h.router.config, h.router.registry) == ("cost" if tier else "on")
        holding(h, d1, ["A"])
        picks = [to_denoiser(h, f"r{k}")[0] for k in range(3)]
        # on: the holder while it has a free slot; cost: the third loads on the idle one (1.5 s against 2.1 s)
        assert picks == ([d1, d1, d0] if tier else [d1, d1, d1]), tier


@pytest.mark.parametrize("affinity", ["off", "on", "two-choices"])
def test_the_other_rules(tmp_path, affinity):
    h = lora_harness(tmp_path, affinity=affinity)
    h.add("encoder", capacity=8), h.add("denoiser", 2, capacity=4), h.add("decoder")
    holding(h, "denoiser-1", ["A"])
    picks = [to_denoiser(h, f"r{k}")[0] for k in range(4)]
    if affinity == "off":  # adapters play no part: the most free slots, in turn
        assert set(picks) == {"denoiser-0", "denoiser-1"}
    else:  # a holder whenever one is free, however busy (two-choices: of the two, both holders here)
        assert set(picks) == {"denoiser-1"}


def test_batching_joins_only_a_batch_with_the_same_adapters_and_scales(tmp_path):
    h = lora_harness(tmp_path, affinity="off")
    h.add("encoder", capacity=8), h.add("decoder")
    [d0, d1] = h.add("denoiser", 2, capacity=4)
    for iid in (d0, d1):
        h.router.registry.get(iid).max_batch = 4
    first = to_denoiser(h, "a1", width=64, height=64)[0]
    other = to_denoiser(h, "b1", names=("B",), width=64, height=64)[0]
    assert other != first  # its adapters differ: it cannot join that batch
    assert to_denoiser(h, "a2", width=64, height=64)[0] == first


def test_sim_profiles_load_from_a_path_and_take_a_lora_cost(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("denoiser: {per_step_ms: 10}\nlora: {load_ms: 800, slots: 4, host_slots: 32, restore_ms: 50}\n")
    profile = load_profile(str(path))
    assert profile.lora.load_ms == 800 and profile.lora.slots == 4 and profile.denoiser.per_step_ms == 10
    assert profile.lora.host_slots == 32 and profile.lora.restore_ms == 50
    with pytest.raises(ValueError, match="no simulation profile"):
        load_profile(str(tmp_path / "missing.yaml"))


def test_bench_draws_adapters_with_zipf():
    names = zipf_names(32, 1.1, 5000, random.Random(0))
    counts = [names.count(f"sim-lora-{k}") for k in range(32)]
    assert counts[0] > counts[1] > counts[3] > counts[15] > 0 and abs(counts[0] / counts[1] - 2 ** 1.1) < 0.4
    assert set(zipf_names(4, 0.0, 400, random.Random(1))) == {f"sim-lora-{k}" for k in range(4)}


def test_bench_sends_requests_with_adapters_at_the_times_it_sends_them_without():
    """A run with --loras meets the same arrival times as the same seed's run without: the p95 target compares
    the two, so the adapters must be all that differs."""

    class Recorder:  # the client's side of run_load: what it was asked to send, and when
        def __init__(self):
            self.sent = []

        def status(self):
            return StatusReport(orchestrator={}, instances=[], queues={}, requests=RequestCounts())

        def run_all(self, params, concurrency=1, arrivals=None):
            params = list(params)
            self.sent.append((params, arrivals))
            return [Outcome(request_id=str(k), params=p, ok=True, latency_s=0.5) for k, p in enumerate(params)]

    plain, with_loras = Recorder(), Recorder()
    workload = [GenerationParams(prompt="x")]
    run_load(plain, workload, 50, request_rate=4.0, warmup=1, seed=3)
    report = run_load(with_loras, workload, 50, request_rate=4.0, warmup=1, seed=3, loras=32)
    (bare, times), (named, same_times) = plain.sent[-1], with_loras.sent[-1]
    assert times == same_times and len(set(times)) == 50
    assert all(not p.loras for p in bare) and len({p.loras[0].name for p in named}) > 5
    assert report["lora"]["adapters"] == 32
    run_load(plain, workload, 50, request_rate=4.0, warmup=1, seed=4)
    assert plain.sent[-1][1] != times  # another seed: another draw


def test_bench_over_http_sends_the_adapters():
    from disagg.launcher.bench.http import image_body

    body = image_body(GenerationParams(prompt="x", loras=[LoraRef(name="sim-lora-3", scale=0.5)]))
    assert body["loras"] == [{"name": "sim-lora-3", "scale": 0.5}]
    assert "loras" not in image_body(GenerationParams(prompt="x"))


def test_a_bank_unloads_the_adapter_least_used_of_late_not_a_popular_one():
    bank = LoraBank(SimLoras(0.0), slots=2, max_bytes=1 << 30)

    def use(name):
        ref = [LoraRef(name=name)]
        bank.acquire(ref, {})
        bank.release([name])

    for name in ("A", "A", "A", "B"):
        use(name)
    assert bank.names() == ["B", "A"]  # the next to unload first: B, used once, though A was used before it
    use("C")  # least recently used would unload A; B goes
    assert sorted(bank.names()) == ["A", "C"] and bank.loads == 3 and bank.hits == 2
    # uses age out: after a window of C alone, A is no more used than C, and the least recent goes
    for _ in range(USE_WINDOW * 2):
        use("C")
    use("D")
    assert sorted(bank.names()) == ["C", "D"]


def test_an_adapter_with_no_part_for_the_instance_takes_no_slot():
    class TextEncoders:  # an encoder's backend: "u*" adapters have no text-encoder part
        components = ("text_encoder",)

        def __init__(self):
            self.installed, self.forgotten = [], []

        def modules(self):
            return []

        def read(self, name, source):
            return ({}, 0) if name.startswith("u") else ({"text_encoder.w": 1}, 10)

        def install(self, name, state, into=None):
            if into is not None:
                self.forget(into)
            self.installed.append(name)
            return False

        def forget(self, name):
            self.forgotten.append(name)

    backend = TextEncoders()
    bank = LoraBank(backend, slots=1, max_bytes=1 << 30)
    for name in ("T1", "u1", "u2", "u1"):
        bank.acquire([LoraRef(name=name)], {name: f"/{name}"})
        bank.release([name])
    # T1 keeps the one slot: the names-only ones took none, unloaded nothing, and u1 was not read again
    assert sorted(bank.names()) == ["T1", "u1", "u2"] and backend.installed == ["T1"] and backend.forgotten == []
    assert bank.loads == 3 and bank.hits == 1
    bank.acquire([LoraRef(name="T2")], {"T2": "/T2"})
    assert backend.forgotten == ["T1"] and sorted(bank.names()) == ["T2", "u1", "u2"]


class Recorder(SimLoras):
    """SimLoras that records what the bank asks of it."""

    def __init__(self, offloads=True):
        super().__init__(0.0)
        self.offloads, self.calls = offloads, []

    def read(self, name, source):
        self.calls.append(("read", name))
        return {}, 0

    def offload(self, name):
        self.calls.append(("offload", name))

    def restore(self, name):
        self.calls.append(("restore", name))

    def forget(self, name):
        self.calls.append(("forget", name))


def test_with_host_slots_an_unloaded_adapter_waits_in_host_memory_and_comes_back_without_a_read():
    backend = Recorder()
    bank = LoraBank(backend, slots=1, max_bytes=1 << 30, host_slots=2)

    def use(name):
        bank.acquire([LoraRef(name=name)], {})
        bank.release([name])

    for name in ("A", "B", "C"):
        use(name)
    # one device slot: A then B went to host memory, nothing forgotten yet
    assert bank.names() == ["C"] and bank.host_names() == ["A", "B"] and bank.loads == 3
    use("A")  # back from host memory: copied, not read; C takes its place there
    assert backend.calls[-2:] == [("offload", "C"), ("restore", "A")] and ("read", "A") not in backend.calls[1:]
    assert bank.names() == ["A"] and bank.host_names() == ["B", "C"] and bank.restores == 1 and bank.loads == 3
    use("D")  # A to host memory: past 2 there, B (the least recently unloaded) is forgotten
    assert bank.host_names() == ["C", "A"] and ("forget", "B") in backend.calls
    use("B")  # forgotten: read and installed again (a load); D to host memory, C forgotten
    assert backend.calls[-3:] == [("read", "B"), ("offload", "D"), ("forget", "C")]
    assert bank.loads == 5 and bank.restores == 1
    assert bank.restore_s >= 0 and bank.hits == 0


def test_a_backend_that_cannot_offload_forgets_as_before():
    backend = Recorder(offloads=False)  # a compiled denoiser: every adapter it holds stays active
    bank = LoraBank(backend, slots=1, max_bytes=1 << 30, host_slots=4)
    for name in ("A", "B"):
        bank.acquire([LoraRef(name=name)], {})
        bank.release([name])
    # A was unloaded for B (install(into=A): a hotswap or its unload), not moved to host memory
    assert bank.host_slots == 0 and bank.host_names() == [] and bank.names() == ["B"]
    assert [c for c in backend.calls if c[0] != "read"] == []


def test_dispatch_prefers_an_instance_that_keeps_the_adapter_in_host_memory(tmp_path):
    for affinity in ("on", "cost"):
        (tmp_path / affinity).mkdir()
        h = lora_harness(tmp_path / affinity, affinity=affinity)
        h.add("encoder", capacity=8), h.add("decoder")
        d0, d1, d2 = h.add("denoiser", 3, capacity=4)
        for iid in (d0, d1, d2):
            h.router.registry.get(iid).solo_s = 0.7
        h.router.placement.lora_loads.load_s["denoiser"] = 0.8
        full = ["C", "D", "E", "F"]
        h.role(d0, Heartbeat(instance_id=d0, lora=LoraStats(held=full, slots=4, load_s=0.8)))
        h.role(d1, Heartbeat(instance_id=d1, lora=LoraStats(held=full, slots=4, load_s=0.8, host=["A"],
                                                                  host_slots=8, restore_s=0.05)))
        h.role(d2, Heartbeat(instance_id=d2, lora=LoraStats(held=full, slots=4, load_s=0.8)))
        assert to_denoiser(h, "r1")[0] == d1, affinity  # A is a restore there, a load elsewhere
        inst = h.router.registry.get(d1)
        assert "A" in inst.lora.held and "A" not in inst.lora.host and "C" in inst.lora.host  # until its heartbeat


def test_the_cost_rule_prices_a_load_that_pushes_an_adapter_out_of_full_host_memory(tmp_path):
    h, d0, d1 = cost_harness(tmp_path)
    # both hold 4 adapters on the device and keep unloaded ones in host memory: d0's is full, d1's has room
    h.role(d0, Heartbeat(instance_id=d0, lora=LoraStats(held=["D", "E", "F", "G"], slots=4, load_s=0.8,
                                                              host=["X", "Y"], host_slots=2, restore_s=0.05)))
    h.role(d1, Heartbeat(instance_id=d1, lora=LoraStats(held=["B", "D", "E", "F"], slots=4, load_s=0.8,
                                                              host=["X"], host_slots=2, restore_s=0.05)))
    assert to_denoiser(h, "r0", names=("B",))[0] == d1  # warm there
    # A is cold on both: 0.8 s to load, the device's work meanwhile, 0.7 s to compute. Where host memory is full,
    # the adapter the load evicts pushes X or Y out for good (half a load more: one will be loaded again); so A
    # goes to d1, though it is the busier (a load with room to spare in host memory costs half a restore more)
    assert to_denoiser(h, "r1")[0] == d1
