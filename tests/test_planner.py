"""The throughput model (disagg/orchestrator/parts/planner.py) and `rebalance` on a fake clock: no sockets, no processes."""

import msgspec
import pytest

from disagg.orchestrator.parts.placements import Placement, fluid_rps
from disagg.orchestrator.parts.planner import (
    Work,
    class_throughput,
    fmt,
    fmt_classes,
    plan,
    plan_by_class,
    splits,
    throughput,
)
from disagg.orchestrator.parts.rebalance import LAUNCHER_SILENCE_S
from disagg.orchestrator.router import Router, RouterConfig
from disagg.settings.devices import CLASSES, class_of
from disagg.settings.schema import RebalanceSettings
from disagg.transport.wire.messages import (
    Done,
    GenerationParams,
    Heartbeat,
    IdleDevice,
    LauncherPoll,
    MemoryStats,
    PoolInfo,
    Register,
    Reroles,
    Shutdown,
    SlotRef,
    Staged,
    Submit,
    TensorSpec,
)

# Flux.1 on an H200 (disagg/roles/pipelines/sim_profiles/flux-h200.yaml): 1024^2 at 2 steps, and at 28 steps
FEW = {"encoder": 0.024, "denoiser": 0.34, "decoder": 0.085}
MANY = {"encoder": 0.024, "denoiser": 4.76, "decoder": 0.085}


def split(e, d, k):
    return {"encoder": e, "denoiser": d, "decoder": k}


def test_throughput_is_the_slowest_roles_rate():
    w = Work(FEW, requests=1)
    assert throughput(split(1, 5, 2), w) == min(1 / 0.024, 5 / 0.34, 2 / 0.085)
    assert throughput(split(1, 6, 1), w) == 1 / 0.085  # now the decoder bounds it
    assert throughput(split(0, 7, 1), w) == 0.0  # a role with work and no device serves nothing


def test_the_best_split_follows_the_mix():
    few = plan(Work(FEW, requests=10), split(3, 3, 2))
    assert fmt(few.best) == "1:5:2"  # few steps: the decode is a quarter of the denoise, decoders matter
    many = plan(Work(MANY, requests=10), split(3, 3, 2))
    assert fmt(many.best) == "1:6:1"  # many steps: denoisers
    # every split of 8 with one device per role at least was weighed, best first
    assert len(few.considered) == 21 and few.considered[0] == (few.best, few.best_rps)
    assert all(r <= few.best_rps for _, r in few.considered)
    assert few.gain > 0.6 and few.moves() == [("encoder", "denoiser"), ("encoder", "denoiser")]


def test_ties_keep_the_current_split_and_min_per_role_holds():
    w = Work({"encoder": 0.0, "denoiser": 1.0, "decoder": 0.0}, requests=5)  # only denoisers matter
    p = plan(w, split(2, 4, 2), min_per_role=2)
    assert p.best == split(2, 4, 2) and p.gain == 0.0 and p.moves() == []
    assert all(min(s.values()) >= 2 for s in splits(8, 2))
    # one role's devices cannot move: they count, and stay
    p = plan(Work(MANY, requests=5), split(2, 4, 2), fixed={"encoder": 2})
    assert p.best["encoder"] >= 2 and fmt(p.best) == "2:5:1"


def test_large_budgets_are_searched_near_the_proportional_split():
    w = Work(MANY, requests=5)
    p = plan(w, split(1000, 1000, 1000))
    total = sum(MANY.values())
    assert abs(p.best["denoiser"] - 3000 * MANY["denoiser"] / total) <= 4
    assert len(p.considered) < 100


def test_work_is_the_mix_mean_with_transfers_over_the_slots():
    reqs = [("few", 3), ("many", 1)]
    w = Work.of(reqs, lambda role, r: (FEW if r == "few" else MANY)[role], transfer_s={"denoiser": 0.4},
                slots={"denoiser": 2})
    assert w.requests == 4
    assert abs(w.seconds["denoiser"] - ((3 * 0.34 + 4.76) / 4 + 0.2)) < 1e-9
    # a role measured for no request: nothing to plan with
    assert not Work.of(reqs, lambda role, r: None if role == "decoder" else 1.0).known


def test_by_class_a_split_serves_what_the_fluid_model_says_and_the_plan_can_swap_two_classes_roles():
    """Devices of two classes: the counts per role may be right and the devices wrong (the denoisers on the slow
    ones). The rate is `disagg plan`'s fluid model for dedicated devices; the plan swaps roles within the counts."""
    speeds = {"H200": 1.0, "L40S": CLASSES["L40S"].speed}
    work = Work(dict(MANY), requests=10)
    current = {"H200": split(1, 2, 1), "L40S": split(0, 4, 0)}
    devices = [CLASSES["H200"]] * 4 + [CLASSES["L40S"]] * 4
    hosts = (("encoder",), ("denoiser",), ("denoiser",), ("decoder",)) + (("denoiser",),) * 4
    assert class_throughput(current, speeds, work) == pytest.approx(fluid_rps(Placement("split", hosts), devices, MANY))
    assert plan(work, split(1, 6, 1)).moves() == []  # by counts: nothing to move
    p = plan_by_class(work, current, speeds)
    assert fmt_classes(p.best_classes) == "H200 0:4:0, L40S 1:2:1" and fmt(p.best) == fmt(p.current) == "1:6:1"
    assert p.best_rps > 1.3 * p.current_rps
    assert sorted(p.class_moves()) == [("decoder", "denoiser", "H200"), ("denoiser", "decoder", "L40S"),
                                       ("denoiser", "encoder", "L40S"), ("encoder", "denoiser", "H200")]
    assert p.lacking("H200") == "denoiser" and p.lacking("L40S") in ("encoder", "decoder")
    # fixed devices stay, and every role keeps its minimum over all classes
    p = plan_by_class(work, current, speeds, min_per_role=1, fixed={"H200": split(1, 0, 1)})
    assert p.best_classes["H200"]["encoder"] == 1 and p.best_classes["H200"]["decoder"] == 1
    for split_, _ in p.considered:
        assert min(split_.values()) >= 1


def test_a_device_class_is_read_from_a_gpus_name_or_a_simulated_devices_class():
    assert class_of("NVIDIA H100 80GB HBM3").name == "H100" and class_of("NVIDIA H200").name == "H200"
    assert class_of("NVIDIA L40S").name == "L40S" and class_of("NVIDIA L4").name == "L4" and class_of("l40s").name == "L40S"
    assert class_of("") is None and class_of("NVIDIA A100-SXM4-80GB") is None


# --- rebalance in the router, on a fake clock ---------------------------------------------------------------

LAUNCHER = "host/1"


class Deployment:
    def __init__(self, mode="auto", **rb):
        cfg = {**dict(interval_s=1.0, cooldown_s=10.0, window_s=20.0, min_requests=4), **rb}
        self.now = 100.0
        self.router = Router(RouterConfig(rebalance=RebalanceSettings(mode=mode, **cfg)), now=self.now)
        self.n = 0
        #: instance id -> the free device memory its heartbeats report (0: unknown)
        self.free: dict[str, int] = {}
        #: instance id -> the bytes of its weights, as its heartbeats say them once loaded
        self.weights: dict[str, int] = {}
        #: instance id -> its device's class, as its heartbeats name it ("": none; its stage times are then H200's)
        self.device: dict[str, str] = {}

    def add(self, role, iid=None, memory=0):
        iid = iid or f"{role}-{sum(1 for i in self.router.registry.by_id if i.startswith(role))}"
        pool = PoolInfo(host_id="h", engines=["shm"], pool_name=f"p-{iid}", pool_bytes=1 << 20)
        self.role(iid, Register(role=role, instance_id=iid, pid=1000, host_id="h", device="cpu", capacity=1, pool=pool,
                                launcher=LAUNCHER, memory_bytes=memory, ready=True))
        return iid

    def role(self, iid, msg):
        return self.router.handle_instance(iid, msg, [], self.now)

    def poll(self, ids=(), idle=()) -> Reroles:
        out = self.router.handle_client(b"launcher", LauncherPoll(launcher=LAUNCHER, ids=list(ids), idle=list(idle)), [],
                                        self.now)
        return next(o.msg for o in out if isinstance(o.msg, Reroles))

    def tick(self, dt):
        self.now += dt
        for inst in self.router.registry.alive():  # the instances are alive all along; their weights as they said
            memory = MemoryStats(free_bytes=self.free.get(inst.id, 0), weights_bytes=self.weights.get(inst.id, 0),
                                 device=self.device.get(inst.id, ""))
            self.role(inst.id, Heartbeat(instance_id=inst.id, memory=memory))
        return self.router.tick(self.now)

    def serve(self, steps, n, times=None):
        """`n` requests of `steps` steps, each stage reporting the device time `times`, else FEW or MANY says (over
        its device class's speed)."""
        times = times or (FEW if steps == 2 else MANY)
        for _ in range(n):
            rid = f"r{self.n}"
            self.n += 1
            out = self.router.handle_client(b"c", Submit(request_id=rid, params=GenerationParams(
                prompt="p", width=1024, height=1024, num_inference_steps=steps)), [], self.now)
            for role in ("encoder", "denoiser", "decoder"):
                run = next(o for o in out if type(o.msg).__name__ == "Run" and o.msg.request_id == rid)
                cls = class_of(self.device.get(run.to_instance, ""))
                took = times[role] / (cls.speed if cls is not None else 1.0)
                slot = SlotRef(instance_id=run.to_instance, offset=0, nbytes=256,
                               tensors=[TensorSpec("x", "float32", [64], 0, 256)])
                if role == "decoder":
                    out = self.role(run.to_instance, Done(request_id=rid, attempt=1, num_images=1,
                                                          compute_s=took, device_s=took))
                else:
                    out = self.role(run.to_instance, Staged(request_id=rid, attempt=1, slot=slot, compute_s=took,
                                                            device_s=took))


def two_encoders_moving() -> Deployment:
    """3:3:2 under auto, served 2-step requests: the plan (1:5:2) has just set two encoders draining."""
    d = Deployment(mode="auto", cooldown_s=30.0)
    for role in ("encoder", "encoder", "encoder", "denoiser", "denoiser", "denoiser", "decoder", "decoder"):
        d.add(role)
    d.poll()
    d.serve(2, 6)
    d.tick(1.0)
    return d


def test_advise_recommends_and_auto_moves_a_device_through_its_launcher():
    d = two_encoders_moving()
    rb = d.router.snapshot(d.now).rebalance
    # the plan was made on 3:3:2; the split shown is the one serving (the draining encoders count for no role)
    assert (rb.current, rb.recommended, rb.budget) == ("1:3:2", "1:5:2", 8)
    assert rb.recommended_rps > 1.6 * rb.current_rps
    # two encoders drain (they hold nothing: they are shut down at once), then their launcher is told
    movers = [m.instance_id for m in rb.moving]
    assert sorted(movers) == ["encoder-0", "encoder-1"] and {m.to_role for m in rb.moving} == {"denoiser"}
    out = d.tick(0.05)
    assert {o.to_instance for o in out if isinstance(o.msg, Shutdown)} == set(movers)
    d.tick(0.05)
    orders = d.poll().orders
    assert sorted((o.instance_id, o.new_id, o.role) for o in orders) == [
        ("encoder-0", "denoiser-3", "denoiser"), ("encoder-1", "denoiser-4", "denoiser")]
    for o in orders:
        d.add("denoiser", iid=o.new_id)
    d.tick(0.05)
    rb = d.router.snapshot(d.now).rebalance
    assert rb.moving == [] and rb.moves == 2 and rb.current == "1:5:2" and d.poll().orders == []
    # the mix turns to 28 steps: 1:6:1 is better; a device moves on in the same direction (to the denoisers) at once
    d.serve(28, 40)
    d.tick(1.0)
    rb = d.router.snapshot(d.now).rebalance
    assert rb.recommended == "1:6:1" and [(m.from_role, m.to_role) for m in rb.moving] == [("decoder", "denoiser")]
    d.tick(0.05)
    for o in d.poll().orders:
        d.add(o.role, iid=o.new_id)
    d.tick(0.05)
    assert d.router.snapshot(d.now).rebalance.moves == 3
    # back to 2-step images: 1:5:2 again, but that undoes the last move, so the cooldown holds it back
    d.now += 21.0  # the 28-step requests leave the window
    d.poll()
    d.serve(2, 20)
    d.tick(1.0)
    rb = d.router.snapshot(d.now).rebalance
    assert rb.recommended == "1:5:2" and rb.moving == [] and "cooldown" in rb.holding, rb
    d.now += 9.0
    d.poll()  # the launcher polls on
    d.tick(1.0)
    rb = d.router.snapshot(d.now).rebalance
    assert [(m.from_role, m.to_role) for m in rb.moving] == [("denoiser", "decoder")]


def test_a_move_whose_instance_restarts_in_its_old_role_is_called_off():
    """A draining instance killed on its way out and restarted by its supervisor before its launcher took the order
    (the chaos day's decoder kill during a move): its device serves its old role again, so the move is called off
    and no order is given for it; it must not hang as `restarting` with the split miscounted."""
    d = two_encoders_moving()
    assert sorted(m.instance_id for m in d.router.snapshot(d.now).rebalance.moving) == ["encoder-0", "encoder-1"]
    d.add("encoder", iid="encoder-0")  # restarted while draining (its death not even seen)
    out = d.tick(0.05)
    assert {o.to_instance for o in out if isinstance(o.msg, Shutdown)} == {"encoder-1"}
    d.tick(0.05)
    rb = d.router.snapshot(d.now).rebalance
    assert [(m.instance_id, m.state) for m in rb.moving] == [("encoder-1", "restarting")]
    d.add("encoder", iid="encoder-1")  # died on its way out, restarted before its launcher took the order
    d.tick(0.05)
    rb = d.router.snapshot(d.now).rebalance
    assert rb.moving == [] and rb.current == "3:3:2" and d.poll().orders == [], rb
    assert sum("the move is called off" in w for w in d.router.snapshot(d.now).warnings) == 2


def test_a_restarted_orchestrator_never_gives_a_move_an_id_the_deployment_used():
    """Issue 42 D1: the successor's registry lacks decoder-0 (it moved to denoiser-4 before the restart), but its
    launcher lists it among the ids it started: a move back to the decoders takes decoder-2."""
    d = Deployment(mode="auto")
    for iid in ("encoder-0", "denoiser-0", "denoiser-1", "denoiser-2", "denoiser-3", "denoiser-4", "decoder-1"):
        d.add(iid.split("-")[0], iid=iid)
    used = ["encoder-0", "encoder-1", "denoiser-0", "denoiser-1", "denoiser-2", "denoiser-3", "denoiser-4", "decoder-0",
            "decoder-1"]
    d.poll(ids=used)
    d.serve(1, 8, times={"encoder": 0.024, "denoiser": 0.05, "decoder": 0.5})  # decoder-bound
    d.tick(1.0)
    d.tick(0.05)
    orders = d.poll(ids=used).orders
    assert orders and all(o.role == "decoder" for o in orders)
    assert not {o.new_id for o in orders} & set(used), orders
    assert sorted(o.new_id for o in orders)[0] == "decoder-2"


def test_a_move_cut_by_an_orchestrator_restart_is_finished_by_the_successor():
    """Issue 42 D5: encoder-0 and decoder-0 exited to become denoisers when the orchestrator died. The successor
    hears of their devices from the launcher (idle), orders each a role (no plan yet: back to the one it left),
    and counts them in the budget; once they serve, every device of the launch does, and status says so."""
    d = Deployment(mode="auto")
    for iid in ("encoder-1", "denoiser-0", "denoiser-1", "denoiser-2", "decoder-1"):
        d.add(iid.split("-")[0], iid=iid)
    used = ["encoder-0", "encoder-1", "denoiser-0", "denoiser-1", "denoiser-2", "decoder-0", "decoder-1"]
    idle = [IdleDevice(instance_id="encoder-0", role="encoder"), IdleDevice(instance_id="decoder-0", role="decoder")]
    orders = d.poll(ids=used, idle=idle).orders
    assert sorted((o.instance_id, o.new_id, o.role) for o in orders) == [
        ("decoder-0", "decoder-2", "decoder"), ("encoder-0", "encoder-2", "encoder")]
    rb = d.router.snapshot(d.now).rebalance
    assert rb.budget == 7 and rb.current == "1:3:1" and {m.state for m in rb.moving} == {"restarting"}
    assert any("encoder-0's device" in w for w in d.router.snapshot(d.now).warnings)
    assert sorted(o.new_id for o in d.poll(ids=used, idle=idle).orders) == ["decoder-2", "encoder-2"]  # asked again
    for o in orders:
        d.add(o.role, iid=o.new_id)
    d.tick(0.05)
    rb = d.router.snapshot(d.now).rebalance
    assert rb.moving == [] and rb.current == "2:3:2" and rb.budget == 7
    assert d.poll(ids=used + ["encoder-2", "decoder-2"]).orders == []


def test_advise_never_moves_and_silent_launchers_and_small_devices_keep_their_instances():
    d = Deployment(mode="advise")
    for role in ("encoder", "encoder", "encoder", "denoiser", "decoder"):
        d.add(role)
    d.poll()
    d.serve(2, 6)
    d.tick(1.0)
    rb = d.router.snapshot(d.now).rebalance
    assert rb.recommended == "1:3:1" and rb.moving == [] and rb.holding == ""
    # auto, but the launcher went quiet: nothing may move (nobody would start the instance again)
    d = Deployment(mode="auto")
    for role in ("encoder", "encoder", "encoder", "denoiser", "decoder"):
        d.add(role)
    d.poll()
    d.serve(2, 6)
    d.tick(LAUNCHER_SILENCE_S + 1)
    rb = d.router.snapshot(d.now).rebalance
    assert rb.moving == [] and rb.fixed == {"encoder": 3, "denoiser": 1, "decoder": 1} and rb.budget == 0
    # a device whose memory cannot hold a denoiser's weights and pool keeps its role
    d = Deployment(mode="auto")
    for role in ("encoder", "encoder", "denoiser", "decoder"):
        d.add(role, memory=1 << 20)  # 1 MiB: the pool alone
    d.weights["denoiser-0"] = 40_000
    d.role("denoiser-0", Heartbeat(instance_id="denoiser-0", components={"transformer": 10_000},
                                   memory=MemoryStats(weights_bytes=40_000)))
    d.poll()
    d.serve(2, 6)
    d.tick(1.0)
    rb = d.router.snapshot(d.now).rebalance
    assert rb.recommended == "1:2:1" and rb.moving == [] and "fit" in rb.holding


def test_the_fit_check_counts_what_else_the_device_holds_from_the_free_memory_its_instance_reports():
    """Review M6: a GPU shared by several processes (or full of activations and caches) may not hold a role its
    total memory would: the instance's reported free memory, plus what it frees by exiting, decides."""
    def encoders_moving(free: int) -> list:
        d = Deployment(mode="auto")
        for role in ("encoder", "encoder", "denoiser", "decoder"):
            d.add(role, memory=1 << 30)  # 1 GiB in all: the denoiser's 40 kB of weights and 1 MiB pool fit that
        d.free = {"encoder-0": free, "encoder-1": free}
        d.weights["denoiser-0"] = 40_000
        d.role("denoiser-0", Heartbeat(instance_id="denoiser-0", components={"transformer": 10_000},
                                       memory=MemoryStats(weights_bytes=40_000)))
        d.poll()
        d.serve(2, 6)
        d.tick(1.0)
        return d.router.snapshot(d.now).rebalance

    rb = encoders_moving(free=20_000)  # other processes hold the rest: the encoder's 1 MiB pool + 20 kB free < need
    assert rb.recommended == "1:2:1" and rb.moving == [] and "fit" in rb.holding, rb
    rb = encoders_moving(free=40_000)  # with the pool it frees, enough
    assert [(m.from_role, m.to_role) for m in rb.moving] == [("encoder", "denoiser")], rb
    rb = encoders_moving(free=0)  # unknown (the CPU): the device's total decides, as before
    assert [(m.from_role, m.to_role) for m in rb.moving] == [("encoder", "denoiser")], rb


def test_rebalance_off_reports_nothing():
    d = Deployment(mode="off")
    d.add("encoder")
    assert d.router.snapshot(d.now).rebalance is None
    assert msgspec.json.decode(msgspec.json.encode(Deployment().router.snapshot(0).rebalance)) is not None


def test_a_mix_alternating_faster_than_the_cooldown_moves_no_device_to_and_fro():
    d = Deployment(mode="auto", cooldown_s=15.0, window_s=20.0)
    for role in ("encoder", "denoiser", "denoiser", "denoiser", "denoiser", "denoiser", "decoder", "decoder"):
        d.add(role)
    moves = []
    for second in range(180):  # 5 s of 2-step images (14 a second), then 5 s of 28-step ones (1 a second)
        d.poll()
        d.serve(2, 14) if (second // 5) % 2 == 0 else d.serve(28, 1)
        for o in d.tick(1.0):
            pass
        for order in d.poll().orders:  # the launcher starts what it is told
            d.add(order.role, iid=order.new_id)
        rb = d.router.snapshot(d.now).rebalance
        moves.append(rb.moves + len(rb.moving))
    # the window's mix hardly changes: at most the first move to its best split, then nothing
    assert moves[-1] <= 1, moves


def test_the_live_table_and_metrics_show_the_recommendation():
    import io

    from prometheus_client import CollectorRegistry, generate_latest
    from rich.console import Console

    from disagg.gateway.metrics import StatusCollector
    from disagg.launcher.cli.dashboard import events_between, status_view

    d = Deployment(mode="advise")
    for role in ("encoder", "encoder", "encoder", "denoiser", "decoder"):
        d.add(role)
    d.serve(2, 6)
    d.tick(1.0)
    report = d.router.snapshot(d.now)
    console = Console(record=True, file=io.StringIO(), width=200)
    console.print(status_view(report, width=200))
    text = console.export_text()
    assert "rebalance advise" in text and "recommended 1:3:1" in text and "split 3:1:1" in text
    assert any("1:3:1 recommended" in line for line in events_between(None, report))
    collector = StatusCollector()
    collector.report = report
    registry = CollectorRegistry()
    registry.register(collector)
    metrics = generate_latest(registry).decode()
    assert 'disagg_rebalance_devices{role="denoiser",split="recommended"} 3.0' in metrics
    assert 'disagg_rebalance_predicted_rps{split="current"}' in metrics and "disagg_rebalance_moves_total 0.0" in metrics


def test_a_shape_counts_in_the_mix_once_every_role_measured_it():
    d = Deployment(mode="advise")
    for role in ("encoder", "encoder", "denoiser", "denoiser", "denoiser", "decoder", "decoder"):
        d.add(role)
    d.serve(2, 6)
    for i in range(20):  # 512^2 requests submitted, not yet measured anywhere
        d.router.handle_client(b"c", Submit(request_id=f"u{i}", params=GenerationParams(
            prompt="p", width=512, height=512, num_inference_steps=2)), [], d.now)
    d.tick(1.0)
    rb = d.router.snapshot(d.now).rebalance
    assert rb.window_requests == 6 and rb.work_s["denoiser"] == FEW["denoiser"]


def test_disagg_plan_recommends_the_split_for_a_trace_offline(tmp_path):
    import json

    from tests.conftest import disagg

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"t": k * 0.1, "width": 1024, "height": 1024, "num_inference_steps": 2}) + "\n"
                             for k in range(20)))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: sim:flux-h200\nencoders: {count: 3}\ndenoisers: {count: 3, max_batch: 4}\ndecoders: {count: 2}\n")
    res = disagg("plan", "--config", str(cfg), "--trace", str(trace), "--json", timeout=60)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert (doc["current"], doc["recommended"], doc["requests"], len(doc["considered"])) == ("3:3:2", "1:5:2", 20, 21)
    # flux-h200 at 1024^2: 170 ms a step, 3.971x for a batch of 4: each request's share of 2 steps
    assert abs(doc["work_s"]["denoiser"] - 2 * 0.170058 * 3.971 / 4) < 1e-3
    res = disagg("plan", "--config", str(cfg), "--trace", str(trace), timeout=60)
    assert "recommended 1:5:2" in res.stdout and "(current)" in res.stdout
    cfg.write_text("model: tiny\n")
    res = disagg("plan", "--config", str(cfg), "--trace", str(trace), timeout=60)
    assert res.returncode == 2 and "sim profile" in res.stderr


def test_live_previews_count_as_decodes_in_the_window():
    """Issue 42 L3: each preview a request asks for is decoded on a decoder, so the plan counts it as a decode of
    the request's size; the decoders' share of the work is not underestimated while previews keep them busy."""
    d = Deployment(mode="advise")
    for role in ("encoder", "denoiser", "decoder"):
        d.add(role)
    d.poll()
    d.serve(2, 6)
    plain = d.router.rebalance.window_work(d.now).seconds
    for _ in range(6):
        d.router.rebalance.note_arrival(GenerationParams(prompt="p", width=1024, height=1024, num_inference_steps=2, previews=2),
                              d.now)
    mixed = d.router.rebalance.window_work(d.now).seconds
    assert abs(mixed["decoder"] - 2 * plain["decoder"]) < 1e-9  # (6 x 1 + 6 x 3 decodes) / 12 requests
    assert abs(mixed["denoiser"] - plain["denoiser"]) < 1e-9


def test_a_planned_move_is_logged_as_a_move_and_advise_drops_a_stale_holding(caplog):
    """Issue 44 (newcomer D12): the encoders drained to move were logged "is dead: drained"; and in advise mode
    `holding` kept its "too few requests measured" from before the window filled, beside the recommendation."""
    import logging

    d = Deployment(mode="advise")
    for role in ("encoder", "encoder", "encoder", "denoiser", "decoder"):
        d.add(role)
    d.poll()
    d.tick(1.0)  # nothing measured yet
    assert "too few requests" in d.router.snapshot(d.now).rebalance.holding
    d.serve(2, 6)
    d.tick(1.0)
    rb = d.router.snapshot(d.now).rebalance
    assert rb.recommended == "1:3:1" and rb.holding == "", rb
    d = Deployment(mode="auto")
    for role in ("encoder", "encoder", "encoder", "denoiser", "denoiser", "denoiser", "decoder", "decoder"):
        d.add(role)
    d.poll()
    d.serve(2, 6)
    with caplog.at_level(logging.INFO, logger="disagg.orchestrator"):
        d.tick(1.0)
        d.tick(0.05)
    movers = sorted(o.instance_id for o in d.poll().orders)
    assert movers == ["encoder-0", "encoder-1"]
    text = caplog.text
    assert "is dead" not in text, text
    for mover in movers:
        assert f"instance {mover} drained and stopped to move: its device becomes denoiser-" in text, text


def test_auto_on_devices_of_two_classes_swaps_the_denoisers_onto_the_fast_ones():
    """4 H200s and 4 L40Ss, 1:6:1 with the denoisers mostly on the L40Ss, 28-step images: by counts the split is
    right; by class, the H200s' encoder and decoder swap with two L40S denoisers. The stage times each instance
    reports are its class's; the plan reads them in H200-seconds. A move back on the same class is held by the
    cooldown, a move of the other class is not."""
    import io

    from rich.console import Console

    from disagg.launcher.cli.dashboard import status_view

    d = Deployment(mode="auto", cooldown_s=30.0)
    for iid, cls in (("encoder-0", "H200"), ("denoiser-0", "H200"), ("denoiser-1", "H200"), ("decoder-0", "H200"),
                     ("denoiser-2", "L40S"), ("denoiser-3", "L40S"), ("denoiser-4", "L40S"), ("denoiser-5", "L40S")):
        d.add(iid.split("-")[0], iid=iid)
        d.device[iid] = cls
    d.poll()
    d.tick(0.05)  # the heartbeats name the devices
    d.serve(28, 12)
    d.tick(1.0)
    rb = d.router.snapshot(d.now).rebalance
    assert (rb.current_classes, rb.recommended_classes) == ("H200 1:2:1, L40S 0:4:0", "H200 0:4:0, L40S 1:2:1"), rb
    # the same counts (the split serving now lacks the two draining L40S denoisers)
    assert (rb.recommended, rb.current) == ("1:6:1", "1:4:1") and rb.recommended_rps > 1.3 * rb.current_rps
    assert rb.work_s["denoiser"] == pytest.approx(MANY["denoiser"], rel=0.01)  # in H200-seconds
    # the lone H200 encoder and decoder wait for the L40S ones (each role keeps min_per_role)
    assert sorted((m.instance_id in ("denoiser-2", "denoiser-3", "denoiser-4", "denoiser-5"), m.to_role)
                  for m in rb.moving) == [(True, "decoder"), (True, "encoder")], rb.moving
    for _ in range(3):
        d.tick(0.05)
        for o in d.poll().orders:
            d.device[o.new_id] = d.device[o.instance_id]  # the same device
            d.add(o.role, iid=o.new_id)
        d.now += 1.0
        d.router.tick(d.now)  # before the new instances' first heartbeat: each is of its device's class already
        assert d.router.snapshot(d.now).rebalance.recommended_classes
    report = d.router.snapshot(d.now)
    rb = report.rebalance
    assert rb.current_classes == "H200 0:4:0, L40S 1:2:1" and rb.moves == 4 and rb.moving == [], rb
    # the live table: each instance's device class, and the split per class
    console = Console(record=True, file=io.StringIO(), width=250)
    console.print(status_view(report, width=250))
    text = console.export_text()
    assert "cpu [L40S]" in text and "cpu [H200]" in text and "split H200 0:4:0, L40S 1:2:1" in text, text
    # the same deployment with no class known: planned by counts, as before, and nothing moves
    d = Deployment(mode="auto")
    for iid in ("encoder-0", "denoiser-0", "denoiser-1", "decoder-0", "denoiser-2", "denoiser-3", "denoiser-4",
                "denoiser-5"):
        d.add(iid.split("-")[0], iid=iid)
    d.poll()
    d.serve(28, 12)
    d.tick(1.0)
    rb = d.router.snapshot(d.now).rebalance
    assert rb.recommended == "1:6:1" and rb.recommended_classes == "" and rb.moving == []
