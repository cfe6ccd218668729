"""A production day: one deployment with everything on, a mixed trace, and SIGKILLs of every process in turn.

    python benchmarks/chaos_day.py                                   # 1 run of both parts
    python benchmarks/chaos_day.py --runs 3 --out benchmarks/results/chaos-day.json
    python benchmarks/chaos_day.py --short --part sim               # one kill of each kind (the test suite's)

Each run has two parts, each a deployment with every feature on that its model has:
- sim: a copy of configs/sim/mixed-h200.yaml with `lora: {load_ms: 300, slots: 2, host_slots: 4, restore_ms: 30}`,
  `--gpus 0,...,6 -e 2 -d 3 -k 2 --max-batch 4 --rebalance auto --schedule slo --http-port`: 7 simulated devices
  whose split follows the traffic, adapters loaded, offloaded to host memory and restored, batching, priorities
  and deadlines, the conditioning cache (repeated prompts), live previews. The trace alternates phases that want
  different splits (denoiser-heavy images, then 1-step 1024² images that want decoders), so devices move.
  The sim model's payloads are request-specific (roles/pipelines/sim.py): each image is checked against the
  reference run's, and against the model's own function of the request (`expected_pixels`); previews too.
- demo: the trained demo model 1:2:1 `--lora-dir DIR --lora-host-slots 2 --max-batch 4 --schedule slo --http-port`,
  with three peft adapters made here, step caches of several types, previews, repeated prompts.

Each part sends one request list twice (sim's --short once: the model's function of the request stands for the
reference image): first to a deployment without kills (the reference images), then, with
the same ids, seeds and parameters at the same times, to a fresh one while processes are SIGKILLed in turn:
every role kind (encoder, denoiser, decoder, the HTTP gateway) and the orchestrator, several times, some of the
orchestrator's kills timed while a rebalance move is in progress (status: rebalance.moving non-empty). Clients:
`client.Client` (ZeroMQ, as `disagg submit`, previews through on_partial) and the official `openai` package
against the gateway (plain and `stream=True, partial_images=N`); an HTTP client retries a dropped connection or
a 502/503 under the same X-Request-Id.

It reports per run and part: requests, answered once, lost, duplicated, wrong images (pixels differ from the
reference's: any difference on sim, more than 1/255 on demo), previews asked / delivered / reported skipped or
lost by the orchestrators (`previews_skipped`, `previews_lost` where the orchestrator reports it) / unaccounted
for, kills per role, and after each orchestrator restart whether the deployment converged within --converge-s:
`rebalance.moving` empty, every instance of the launch ready (on sim: each of the 7 devices serves a role) and
`rebalance.current` equal to the split of the ready instances. It prints a markdown table, writes JSON (--out),
and exits 1 on any loss, duplicate, wrong image, unconverged restart, or a kill plan it could not carry out.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import msgspec  # noqa: E402

from chaos import pct  # noqa: E402
from client import Client, Unreachable  # noqa: E402
from roles.compute import preview_steps  # noqa: E402
from transport.messages import GenerationParams  # noqa: E402

ROLES = ("encoder", "denoiser", "decoder")
#: the sim part's simulated devices (one instance each) and its launch
SIM_DEVICES = 7
SIM_LORA = "lora: {load_ms: 300, slots: 2, host_slots: 4, restore_ms: 30}\n"
SIM_ADAPTERS = ("ink-a", "ink-b", "ink-c", "ink-d", "ink-e", "ink-f")
DEMO_ADAPTERS = (("inkA", 1, 50.0), ("inkB", 2, 50.0), ("inkC", 3, 30.0))
#: step caches the demo model takes (README, Step caches: the thresholds the tests document for 8 steps)
DEMO_CACHES = ({"type": "first_block", "threshold": 0.3}, {"type": "mag"},
               {"type": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1}, {"type": "faster"},
               {"type": "pyramid_attention_broadcast", "spatial_attention_block_skip_range": 2}, {"type": "none"})


# --- ports --------------------------------------------------------------------------------------------------------

def _free(port: int) -> bool:
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def pick_ports(lo: int, hi: int, rng: random.Random) -> tuple[int, int]:
    """(P, H) in [lo, hi]: P and P+1 free for the orchestrator, H free for the gateway, H not P or P+1."""
    for _ in range(200):
        port = rng.randrange(lo, hi - 1)
        if _free(port) and _free(port + 1):
            http = [h for h in range(lo, hi + 1) if h not in (port, port + 1) and _free(h)]
            if http:
                return port, rng.choice(http)
    raise SystemExit(f"no free ports in {lo}-{hi}")


# --- the request lists ---------------------------------------------------------------------------------------------

def _schedule(rng: random.Random, standalone_s: float) -> dict:
    """Priorities and deadlines: 30% a priority and a deadline of 3-12x its standalone time, 20% a priority only."""
    r = rng.random()
    if r < 0.3:
        return {"priority": rng.choice([0, 1, 2, 5]), "slo_ms": round(standalone_s * rng.choice([3, 6, 12]) * 1000)}
    if r < 0.5:
        return {"priority": rng.choice([-1, 3])}
    return {}


def _adapters(rng: random.Random, names) -> dict:
    r = rng.random()
    if r < 0.5:
        return {}
    n = 1 if r < 0.85 else 2
    return {"loras": [{"name": name, "scale": rng.choice([1.0, 0.5, 0.8])} for name in rng.sample(list(names), n)]}


def _path(rng: random.Random) -> str:
    r = rng.random()
    return "zmq" if r < 0.6 else "http" if r < 0.8 else "stream"


def _previews(rng: random.Random, path: str) -> dict:
    if path == "stream":
        return {"previews": rng.choice([1, 2, 3])}
    if path == "zmq" and rng.random() < 0.4:
        return {"previews": rng.choice([1, 2, 3])}
    return {}


def sim_trace(seed: int, short: bool) -> list[dict]:
    """Phases that want different splits of the 7 devices: images of 512² x 4 and 1024² x 28 steps (denoisers:
    1:5:1), then 1024² x 1 step (decoders: 1:4:2), and back. --short: 1-step first (a move at once), large
    images of 8 steps, 24 s."""
    rng = random.Random(seed)
    large = 8 if short else 28
    mixed = (((512, 4), 0.7), ((1024, large), 0.3))
    quick = (((1024, 1), 1.0),)
    phases = [(0, 8, 3.0, quick), (8, 24, 2.0, mixed)] if short else [
        (0, 40, 1.5, mixed), (40, 70, 3.0, quick), (70, 110, 1.5, mixed), (110, 140, 3.0, quick), (140, 200, 1.5, mixed)]
    prompts = [f"a production day prompt {k}" for k in range(8)]  # few: repeats hit the conditioning cache
    specs, t = [], 0.0
    for start, end, rate, mix in phases:
        t = max(t, start)
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            (size, steps), = rng.choices([m for m, _ in mix], weights=[w for _, w in mix])
            path = _path(rng)
            standalone = 0.03 + steps * (0.058 + 0.000106812 * size * size / 1000) + 0.085 * size * size / 2**20
            params = {"prompt": rng.choice(prompts), "width": size, "height": size, "num_inference_steps": steps,
                      "seed": rng.randrange(2**31), **_adapters(rng, SIM_ADAPTERS), **_schedule(rng, standalone),
                      **_previews(rng, path)}
            specs.append({"id": f"s{len(specs):04d}", "t": round(t, 3), "path": path, "params": params})
    return specs


def demo_trace(seed: int, short: bool) -> list[dict]:
    """The demo model's own prompts (12 of them: repeats), adapters, step caches, previews, deadlines."""
    from roles.pipelines.demo import COLOURS, POSITIONS, SHAPES, caption

    rng = random.Random(seed)
    prompts = [caption(rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(POSITIONS)) for _ in range(12)]
    duration, rate = (25, 3.0) if short else (90, 3.0)
    specs, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        path = _path(rng)
        params = {"prompt": rng.choice(prompts), "seed": rng.randrange(2**31), **_adapters(rng, [n for n, *_ in DEMO_ADAPTERS]),
                  **_schedule(rng, 0.5), **_previews(rng, path)}
        if rng.random() < 0.5:
            params["cache"] = rng.choice(DEMO_CACHES)
        specs.append({"id": f"d{len(specs):04d}", "t": round(t, 3), "path": path, "params": params})
    return specs


def previews_asked(params: dict) -> int:
    """Previews a request can get: evenly spaced steps, never the last (roles/compute.py)."""
    steps = params.get("num_inference_steps") or 8
    return len(preview_steps(steps, params.get("previews") or 0))


# --- the demo's adapters -------------------------------------------------------------------------------------------

def make_demo_loras(folder: Path) -> Path:
    """Three peft adapters on the demo transformer (random, nonzero: each visibly changes the image), as
    /work/shared/notes/combo-2026-12-04/mklora.py and tests/loras.py make them: FOLDER/NAME.safetensors."""
    import torch
    from diffusers import FluxPipeline
    from peft import LoraConfig, get_peft_model_state_dict

    from roles.pipelines.demo import build_demo_component

    folder.mkdir(parents=True, exist_ok=True)
    for name, seed, mul in DEMO_ADAPTERS:
        if (folder / f"{name}.safetensors").exists():
            continue
        module = build_demo_component("transformer")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                          init_lora_weights=False))
            layers = get_peft_model_state_dict(module)
        for key, value in layers.items():
            if "lora_B" in key:
                value.mul_(mul)
        with tempfile.TemporaryDirectory() as tmp:
            FluxPipeline.save_lora_weights(tmp, transformer_lora_layers=layers)
            shutil.copy(Path(tmp) / "pytorch_lora_weights.safetensors", folder / f"{name}.safetensors")
    return folder


# --- a deployment --------------------------------------------------------------------------------------------------

class Deployment:
    """`disagg launch` of one part in the background (its own session), stopped with SIGTERM."""

    def __init__(self, part: str, work: Path, tag: str, ports: tuple[int, int], loras: Path | None):
        self.part = part
        self.port, self.http_port = ports
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.run_dir = work / f"{part}-{tag}"
        self.log_path = work / f"{part}-{tag}.log"
        common = ["--port", str(self.port), "--http-port", str(self.http_port), "--run-dir", str(self.run_dir),
                  "--no-dashboard", "--max-batch", "4", "--schedule", "slo"]
        if part == "sim":
            profile = work / "mixed-lora.yaml"
            if not profile.exists():
                profile.write_text((ROOT / "configs" / "sim" / "mixed-h200.yaml").read_text() + SIM_LORA)
            self.instances = SIM_DEVICES
            self.devices = {f"sim:{k}" for k in range(SIM_DEVICES)}
            args = ["--model", f"sim:{profile}", "--gpus", ",".join(map(str, range(SIM_DEVICES))), "-e", "2", "-d", "3",
                    "-k", "2", "--rebalance", "auto"]
        else:
            self.instances = 4
            self.devices = set()
            # 2 slots for 3 adapters: unloads, so the host tier restores
            args = ["-e", "1", "-d", "2", "-k", "1", "--lora-dir", str(loras), "--lora-slots", "2", "--lora-host-slots", "2"]
        self.cmd = [sys.executable, "-m", "launcher", "launch", *args, *common]
        self.proc: subprocess.Popen | None = None

    def status(self, timeout_s: float = 3.0) -> dict:
        with Client(self.endpoint) as client:
            return msgspec.to_builtins(client.status(timeout_s=timeout_s))

    def start(self, timeout: float = 240) -> float:
        t0 = time.monotonic()
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        while time.monotonic() < t0 + timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.part} deployment exited {self.proc.returncode}: see {self.log_path}")
            try:
                st = self.status(2)
                ready = sum(i["state"] == "ready" for i in st["instances"])
                if ready >= self.instances and st["gateways"] and " ready: " in self.log_path.read_text():
                    return time.monotonic() - t0
            except (Unreachable, RuntimeError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the {self.part} deployment was not ready in {timeout} s: see {self.log_path}")

    def stop(self) -> bool:
        """SIGTERM to the launcher (it stops what it started); its process group killed if it does not exit in 60 s.
        True when nothing of the group is left."""
        if self.proc is None:
            return True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.2)
        os.killpg(self.proc.pid, signal.SIGKILL)
        return False


def settled_status(dep: Deployment, timeout: float = 10.0) -> dict | None:
    """The status once its orchestrator has heard a heartbeat from every instance since it started (a successor
    knows the roles' counters from their heartbeats, not their registration); the last one read after `timeout`."""
    deadline, st = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            st = dep.status(3)
        except (Unreachable, RuntimeError):
            time.sleep(0.5)
            continue
        uptime = float(st["orchestrator"].get("uptime_s", 0))
        if all(i["last_seen_s"] < uptime - 1.5 for i in st["instances"] if i["state"] == "ready"):
            return st
        time.sleep(0.5)
    return st


def ready_split(st: dict) -> tuple[str, int, set]:
    """The split E:D:K of the ready instances, how many are ready, and their devices."""
    ready = [i for i in st["instances"] if i["state"] == "ready"]
    counts = Counter(i["role"] for i in ready)
    return ":".join(str(counts[r]) for r in ROLES), len(ready), {i["device"] for i in ready}


# --- one pass of the request list over a deployment ----------------------------------------------------------------

class Pass:
    """The request list sent once (at its arrival times) through both clients, optionally while a kill plan runs."""

    def __init__(self, dep: Deployment, specs: list[dict], plan: list[str] | None, args, rng: random.Random):
        self.dep, self.specs, self.plan, self.args, self.rng = dep, specs, plan, args, rng
        self.lock = threading.Lock()
        self.answers: dict[str, list[dict]] = defaultdict(list)  # id -> every answer it got
        self.errors: dict[str, str] = {}
        self.partials: dict[str, dict[int, tuple[int | None, bytes]]] = defaultdict(dict)  # id -> index -> (step, image)
        self.partial_events = 0
        self.latency: dict[str, float] = {}  # id -> seconds from its (first) send to its answer
        self.retried: dict[str, int] = {}  # HTTP requests sent again (a dropped connection, a 502/503): how often
        self.counters: dict[str, dict[str, int]] = {}  # orchestrator id -> previews_sent/skipped/lost, its last values
        self.kills: list[dict] = []
        self.restarts: list[dict] = []
        self.events: list[tuple[float, str]] = []
        self.moves_seen = 0
        self.final: dict = {}
        self.done = threading.Event()
        self.abort = threading.Event()  # stopped early (Ctrl-C, SIGTERM): the HTTP clients give up at once
        self.t0 = 0.0

    def say(self, what: str) -> None:
        t = time.monotonic() - self.t0
        with self.lock:
            self.events.append((round(t, 2), what))
        if self.args.verbose:
            print(f"    {t:7.2f}s {what}", flush=True)

    def note_counters(self, st: dict) -> None:
        orch = st["orchestrator"]
        with self.lock:
            self.counters[str(orch["id"])] = {k: int(orch.get(k, 0) or 0)
                                              for k in ("previews_sent", "previews_skipped", "previews_lost")}

    # --- clients ---

    def zmq(self) -> None:
        todo = [s for s in self.specs if s["path"] == "zmq"]
        if not todo:
            return

        def outcome(o) -> None:
            with self.lock:
                if o.ok:
                    self.answers[o.request_id].append({"images": list(o.images), "resolved": dict(o.resolved)})
                    self.latency[o.request_id] = o.latency_s
                else:
                    self.errors[o.request_id] = str(o.error)

        def partial(p, data: bytes) -> None:
            with self.lock:
                self.partial_events += 1
                self.partials[p.request_id].setdefault(p.index, (p.step, data))

        try:
            with Client(self.dep.endpoint) as client:
                client.run_all([msgspec.convert(s["params"], GenerationParams) for s in todo], ids=[s["id"] for s in todo],
                               arrivals=[s["t"] for s in todo], timeout_s=self.args.request_timeout,
                               on_outcome=outcome, on_partial=partial)
        except Exception as exc:  # noqa: BLE001 - what was not answered counts as lost
            self.say(f"zmq client: {type(exc).__name__}: {exc}")

    def http_one(self, api, spec: dict) -> None:
        import openai

        attempts = 0

        if self.abort.wait(max(0.0, self.t0 + spec["t"] - time.monotonic())):
            return
        p = dict(spec["params"])
        prompt = p.pop("prompt")
        size = f"{p.pop('width', 64)}x{p.pop('height', 64)}"
        previews = p.pop("previews", None)
        headers = {"X-Request-Id": spec["id"]}
        sent = time.monotonic()
        deadline = sent + self.args.request_timeout
        error = "no answer"
        while time.monotonic() < deadline and not self.abort.is_set():
            attempts += 1
            if attempts > 1:
                with self.lock:
                    self.retried[spec["id"]] = attempts - 1
            try:
                if spec["path"] == "stream":
                    final = None
                    for ev in api.images.generate(prompt=prompt, size=size, stream=True, partial_images=previews,
                                                  extra_body=p, extra_headers=headers):
                        if ev.type.endswith("partial_image"):
                            with self.lock:
                                self.partial_events += 1
                                self.partials[spec["id"]].setdefault(ev.partial_image_index,
                                                                     (None, base64.b64decode(ev.b64_json)))
                        elif ev.type.endswith("completed"):
                            final = ev
                            extra = ev.model_extra or {}
                            with self.lock:
                                self.answers[spec["id"]].append({"images": [base64.b64decode(ev.b64_json)],
                                                                 "resolved": extra.get("disagg") or {}})
                    if final is not None:
                        self.latency[spec["id"]] = time.monotonic() - sent
                        return
                    error = "the stream ended without an image"
                else:
                    r = api.images.generate(prompt=prompt, size=size, response_format="b64_json", extra_body=p,
                                            extra_headers=headers)
                    with self.lock:
                        self.answers[spec["id"]].append({"images": [base64.b64decode(d.b64_json) for d in r.data],
                                                         "resolved": (r.model_extra or {}).get("disagg") or {}})
                        self.latency[spec["id"]] = time.monotonic() - sent
                    return
            except (openai.APIConnectionError, openai.APITimeoutError) as exc:  # the gateway died: again, same id
                error = f"{type(exc).__name__}: {exc}"
            except openai.APIStatusError as exc:
                error = f"{exc.status_code}: {str(exc)[:300]}"
                if exc.status_code not in (502, 503):  # the orchestrator restarting says 502/503; else an answer
                    break
            except Exception as exc:  # noqa: BLE001 - a stream cut mid-event, an error event: again, same id
                error = f"{type(exc).__name__}: {str(exc)[:300]}"
            time.sleep(0.3)
        with self.lock:
            self.errors.setdefault(spec["id"], error)

    def http(self) -> None:
        import openai

        todo = [s for s in self.specs if s["path"] != "zmq"]
        if not todo:
            return
        api = openai.OpenAI(base_url=self.dep.http + "/v1", api_key="none", max_retries=0,
                            timeout=self.args.request_timeout)
        with ThreadPoolExecutor(max(1, min(32, len(todo)))) as pool:
            list(pool.map(lambda s: self.http_one(api, s), todo))

    # --- watching and killing ---

    def monitor(self) -> None:
        """Status every 0.5 s: the preview counters of each orchestrator, moves as they start."""
        moving_before: set = set()
        while not self.done.wait(0.5):
            try:
                st = self.dep.status(2)
            except (Unreachable, RuntimeError):
                continue
            self.note_counters(st)
            moving = {(m["instance_id"], m["new_id"]) for m in (st.get("rebalance") or {}).get("moving") or ()}
            for old, new in moving - moving_before:
                self.moves_seen += 1
                self.say(f"move {old} -> {new}")
            moving_before = moving

    def victims(self) -> tuple[dict, dict]:
        st = self.dep.status(2)
        self.note_counters(st)
        pids: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for i in st["instances"]:
            if i["state"] == "ready" and i["pid"]:
                pids[i["role"]].append((i["id"], int(i["pid"])))
        pids["orchestrator"] = [("orchestrator", int(st["orchestrator"]["pid"]))]
        for g in st["gateways"]:
            pids["gateway"] = [("gateway", int(g["pid"]))]
        return st, pids

    def kill(self, kind: str, st: dict, pids: dict) -> bool:
        if not pids.get(kind):
            return False
        name, pid = self.rng.choice(pids[kind])
        moving = (st.get("rebalance") or {}).get("moving") or []
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        with self.lock:
            self.kills.append({"t": round(time.monotonic() - self.t0, 2), "kind": kind, "name": name, "pid": pid,
                               "during_move": bool(moving), "moving": [f"{m['instance_id']}->{m['new_id']} {m['state']}"
                                                                       for m in moving]})
        self.say(f"kill -9 {name} (pid {pid})" + (f" during move {moving[0]['instance_id']}->{moving[0]['new_id']} "
                                                  f"({moving[0]['state']})" if moving else ""))
        return True

    def converge(self, old_id: str | None, killed_at: float) -> dict:
        """After an orchestrator kill: within --converge-s, a successor answers with rebalance.moving empty, every
        instance of the launch ready (every device serving) and rebalance.current the split of the ready ones.
        With old_id None, the same of whichever orchestrator answers (the end of a pass)."""
        bound = killed_at + self.args.converge_s
        last, successor = "no answer", None
        while time.monotonic() < bound:
            try:
                st = self.dep.status(2)
            except (Unreachable, RuntimeError) as exc:
                last = f"status: {exc}"
                time.sleep(0.3)
                continue
            self.note_counters(st)
            if old_id is not None and str(st["orchestrator"]["id"]) == old_id:
                time.sleep(0.2)
                continue
            successor = successor or time.monotonic()
            reb = st.get("rebalance") or {}
            split, ready, devices = ready_split(st)
            missing = sorted(self.dep.devices - devices)
            why = []
            if reb.get("moving"):
                why.append("moving " + ", ".join(f"{m['instance_id']}->{m['new_id']} {m['state']} {m['age_s']:.0f}s"
                                                 for m in reb["moving"]))
            if ready < self.dep.instances:
                why.append(f"{ready} of {self.dep.instances} instances ready")
            if missing:
                why.append("devices serving nothing: " + ",".join(missing))
            if reb and reb.get("current") != split:
                why.append(f"rebalance.current {reb.get('current')} but ready {split}")
            if not why:
                return {"converged": True, "after_s": round(time.monotonic() - killed_at, 2), "split": split,
                        "budget": reb.get("budget")}
            last = "; ".join(why) + f" (budget {reb.get('budget')}, holding: {reb.get('holding', '')!r})"
            time.sleep(0.3)
        return {"converged": False, "after_s": None, "why": last,
                "successor_after_s": round(successor - killed_at, 2) if successor else None}

    def chaos(self) -> None:
        """The kill plan, in order: one kill every --interval s; `KIND@move` waits (at most --move-wait s) for a
        rebalance move in progress, `KIND@draining` / `KIND@restarting` for one in that state (its instance still
        draining, or exited and its new role starting); after each orchestrator kill, the convergence check."""
        next_at = self.t0 + self.args.first_kill
        for step in self.plan or ():
            kind, _, when = step.partition("@")
            while not self.done.is_set() and time.monotonic() < next_at:
                time.sleep(0.1)
            if self.done.is_set():
                return
            give_up = time.monotonic() + (self.args.move_wait if when else 30)
            killed, failed = False, 0
            while not killed and time.monotonic() < give_up and not self.done.is_set():
                try:
                    st, pids = self.victims()
                except (Unreachable, RuntimeError) as exc:
                    failed += 1
                    if failed in (1, 10, 100):
                        self.say(f"status for the next kill ({step}): {type(exc).__name__}: {exc}")
                    time.sleep(0.2)
                    continue
                moving = (st.get("rebalance") or {}).get("moving") or []
                if when and not any(when == "move" or m["state"] == when for m in moving):
                    time.sleep(0.1)
                    continue
                killed = self.kill(kind, st, pids)
                if not killed:
                    failed += 1
                    if failed in (1, 10, 100):
                        self.say(f"no {kind} to kill: {sorted(pids)}")
                    time.sleep(0.2)
            if not killed and when and not self.done.is_set():  # no such move came: a kill all the same
                try:
                    st, pids = self.victims()
                    killed = self.kill(kind, st, pids)
                except (Unreachable, RuntimeError):
                    pass
            if killed and kind == "orchestrator":
                result = self.converge(str(st["orchestrator"]["id"]), time.monotonic())
                result["at_s"] = self.kills[-1]["t"]
                result["during_move"] = self.kills[-1]["during_move"]
                self.restarts.append(result)
                self.say("converged after %.1f s" % result["after_s"] if result["converged"]
                         else f"NOT converged in {self.args.converge_s:.0f} s: {result['why']}")
            next_at = time.monotonic() + self.args.interval

    def run(self) -> float:
        try:
            return self._run()
        except BaseException:
            self.abort.set()
            self.done.set()
            raise

    def _run(self) -> float:
        self.t0 = time.monotonic()
        workers = [threading.Thread(target=self.zmq, daemon=True), threading.Thread(target=self.http, daemon=True)]
        watchers = [threading.Thread(target=self.monitor, daemon=True)]
        if self.plan:
            watchers.append(threading.Thread(target=self.chaos, daemon=True))
        for t in workers + watchers:
            t.start()
        end = self.t0 + self.specs[-1]["t"] + self.args.request_timeout + 30
        for t in workers:
            t.join(max(0.0, end - time.monotonic()))
        # the kill plan may still be at work (kills after the trace's end, a convergence check): each of its steps
        # is bounded, so the plan is carried out to its end
        if self.plan and watchers[-1].is_alive():
            a = self.args
            watchers[-1].join(len(self.plan) * (a.interval + max(a.move_wait, 30) + a.converge_s + 5))
        self.done.set()
        for t in watchers:
            t.join(10)
        # at the end, whoever runs the deployment: no move left hanging, every instance (device) serving
        self.final = self.converge(None, time.monotonic())
        if not self.final["converged"]:
            self.say(f"at the end NOT converged in {self.args.converge_s:.0f} s: {self.final['why']}")
        try:
            self.note_counters(self.dep.status(3))
        except (Unreachable, RuntimeError):
            pass
        return time.monotonic() - self.t0


# --- comparing ---------------------------------------------------------------------------------------------------

def pixels(data: bytes):
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"), dtype=np.int16)


def max_diff(a: bytes, b: bytes) -> int:
    pa, pb = pixels(a), pixels(b)
    return 255 if pa.shape != pb.shape else int(abs(pa - pb).max())


def compare(part: str, specs: list[dict], ref: Pass | None, run: Pass, tolerance: int) -> dict:
    """The kill pass's answers against the reference pass's (and, on sim, against the model's own function: with
    `ref` None, sim's --short, against that alone)."""
    lost, duplicated, wrong, wrong_model, ref_missing, no_cache_info = [], [], [], [], [], []
    diffs = []
    for s in specs:
        got = run.answers.get(s["id"], [])
        if not got:
            lost.append(s["id"])
            continue
        if len(got) > 1:
            duplicated.append(s["id"])
        image = got[0]["images"][0] if got[0]["images"] else b""
        if s["params"].get("cache") and s["params"]["cache"].get("type") != "none":
            info = got[0]["resolved"]
            if info.get("steps_computed") is None and info.get("cache") is None:
                no_cache_info.append(s["id"])
        reference = ref.answers.get(s["id"]) if ref is not None else None
        if ref is None:
            pass  # sim --short: the model's function stands for the run without kills (below)
        elif not reference or not reference[0]["images"]:
            ref_missing.append(s["id"])
        else:
            d = max_diff(image, reference[0]["images"][0]) if image else 255
            diffs.append(d)
            if d > tolerance:
                wrong.append({"id": s["id"], "max_diff": d, "path": s["path"]})
        if part == "sim":
            from roles.pipelines.sim import expected_pixels, image_checksum

            if not image or image_checksum(image) != expected_pixels(s["params"]).hex():
                wrong_model.append(s["id"])
                if ref is None:
                    wrong.append({"id": s["id"], "max_diff": 255, "path": s["path"]})
                # which image it is instead: the request's own latents after fewer steps (a preview's copy)?
                steps = s["params"].get("num_inference_steps") or 4
                early = [k for k in range(steps) if image and image_checksum(image) == expected_pixels(
                    s["params"], steps_done=k).hex()]
                for w in wrong:
                    if w["id"] == s["id"]:
                        w["is"] = f"its latents after step {early[0]} of {steps}" if early else "not its own"
                        w["previews"] = s["params"].get("previews") or 0
    asked = sum(previews_asked(s["params"]) for s in specs)
    delivered = sum(len(run.partials.get(s["id"], {})) for s in specs)
    wrong_previews = []
    if part == "sim":
        from roles.pipelines.sim import expected_pixels, image_checksum

        for s in specs:
            at = {index: step for step, index in preview_steps(s["params"].get("num_inference_steps") or 4,
                                                               s["params"].get("previews") or 0).items()}
            for index, (step, data) in run.partials.get(s["id"], {}).items():
                step = step if step is not None else at.get(index)
                if step is None or image_checksum(data) != expected_pixels(s["params"], steps_done=step).hex():
                    wrong_previews.append(f"{s['id']}#{index}")
    missing: Counter = Counter()  # previews asked and not delivered, by how the request went
    for s in specs:
        gap = previews_asked(s["params"]) - len(run.partials.get(s["id"], {}))
        if gap > 0:
            missing[s["path"] + (" (sent again)" if s["id"] in run.retried else "")] += gap
    sent = sum(c["previews_sent"] for c in run.counters.values())
    skipped = sum(c["previews_skipped"] for c in run.counters.values())
    reported_lost = sum(c["previews_lost"] for c in run.counters.values())
    return {
        "requests": len(specs), "answered_once": sum(len(run.answers.get(s["id"], [])) == 1 for s in specs),
        "lost": len(lost), "duplicated": len(duplicated), "wrong_images": len(wrong),
        "wrong_vs_model": len(wrong_model) if part == "sim" else None, "reference_missing": len(ref_missing),
        "max_pixel_diff": max(diffs, default=0), "cache_info_missing": len(no_cache_info),
        "previews": {"asked": asked, "delivered": delivered, "events": run.partial_events, "sent_reported": sent,
                     "skipped_reported": skipped, "lost_reported": reported_lost,
                     "unaccounted": max(0, asked - delivered - skipped - reported_lost),
                     # received twice (the same index again: a preview decoded again after a restart)
                     "duplicates": run.partial_events - delivered,
                     # not delivered, by path: "stream (sent again)" are streams cut by a gateway kill, whose previews
                     # sent meanwhile went with the dead gateway
                     "missing_by_path": dict(missing),
                     "wrong": len(wrong_previews) if part == "sim" else None},
        "http_sent_again": len(run.retried),
        "lost_ids": lost[:20], "lost_errors": sorted({run.errors.get(i, "no answer")[:200] for i in lost})[:10],
        "duplicated_ids": duplicated[:20], "wrong": wrong[:20], "wrong_vs_model_ids": wrong_model[:20],
        "wrong_previews": wrong_previews[:20], "cache_info_missing_ids": no_cache_info[:20],
    }


# --- a run of one part -----------------------------------------------------------------------------------------

def kill_plan(short: bool) -> list[str]:
    """Every role kind and the orchestrator; `orchestrator@move`: while a rebalance move is in progress."""
    if short:
        return ["orchestrator@restarting", "encoder", "denoiser", "decoder", "gateway"]
    return ["orchestrator@move", "encoder", "denoiser", "gateway", "orchestrator@draining", "decoder", "denoiser",
            "orchestrator@restarting", "encoder", "decoder", "gateway", "orchestrator"]


def run_part(part: str, index: int, args, work: Path, loras: Path | None) -> dict:
    seed = args.seed + index
    specs = (sim_trace if part == "sim" else demo_trace)(seed, args.short)
    plan = kill_plan(args.short)
    if part == "demo":  # no rebalance moves on 1:2:1: every orchestrator kill is a plain one
        plan = [k.partition("@")[0] for k in plan]
    report: dict = {"part": part, "run": index + 1, "seed": seed, "plan": plan}
    passes = {}
    # sim --short (the test suite's): the sim model's image is a function of the request (roles/pipelines/sim.py
    # expected_pixels, checked against its pipeline by tests/test_chaos_day.py), so that function stands for the
    # run without kills and the reference pass is left out
    tags = (("chaos", plan),) if args.short and part == "sim" else (("reference", None), ("chaos", plan))
    for tag, with_plan in tags:
        dep = Deployment(part, work, f"{index + 1}-{tag}", pick_ports(args.port_lo, args.port_hi, random.Random()), loras)
        print(f"  {part} run {index + 1} {tag}: {len(specs)} requests; {' '.join(dep.cmd[3:])}", flush=True)
        try:
            boot = dep.start()
            p = Pass(dep, specs, with_plan, args, random.Random(seed * 7 + 1))
            took = p.run()
            final = settled_status(dep)
        finally:
            clean = dep.stop()
        passes[tag] = p
        lat = list(p.latency.values())
        report[tag] = {"boot_s": round(boot, 1), "took_s": round(took, 1), "stopped_clean": clean,
                       "orchestrators": len(p.counters), "moves_seen": p.moves_seen,
                       "latency_s": {"p50": round(pct(lat, 0.5), 3), "p99": round(pct(lat, 0.99), 3),
                                     "max": round(max(lat, default=0.0), 3)}}
        if final is not None:
            enc = [i for i in final["instances"] if i["role"] == "encoder"]
            den = [i for i in final["instances"] if i["role"] == "denoiser"]
            report[tag]["final"] = {
                "split": ready_split(final)[0], "rebalance": (final.get("rebalance") or {}).get("current"),
                "moves": (final.get("rebalance") or {}).get("moves"),
                "cond_hits": sum(i.get("cond_hits", 0) for i in enc), "cond_lookups": sum(i.get("cond_lookups", 0) for i in enc),
                "lora_loads": sum(i.get("lora_loads", 0) for i in den), "lora_restores": sum(i.get("lora_restores", 0) for i in den),
                "batch_sizes": dict(sum((Counter({int(k): v for k, v in (i.get("batch_steps") or {}).items()}) for i in den),
                                        Counter())),
            }
        print(f"    {tag}: {took:.1f} s, {sum(1 for s in specs if p.answers.get(s['id']))}/{len(specs)} answered",
              flush=True)
    chaos = passes["chaos"]
    ref = passes.get("reference")
    report.update(compare(part, specs, ref, chaos, 0 if part == "sim" else args.tolerance))
    if ref is not None:  # the reference pass's previews: what skips cost without a kill
        report["reference"]["previews"] = {"delivered": sum(len(v) for v in ref.partials.values()),
                                           "skipped_reported": sum(c["previews_skipped"] for c in ref.counters.values())}
    report["kills"] = chaos.kills
    report["kills_per_role"] = dict(Counter(k["kind"] for k in chaos.kills))
    report["orchestrator_kills"] = report["kills_per_role"].get("orchestrator", 0)
    report["orchestrator_kills_during_move"] = sum(k["during_move"] for k in chaos.kills if k["kind"] == "orchestrator")
    report["restarts"] = chaos.restarts
    report["final"] = {tag: p.final for tag, p in passes.items()}
    report["converged_all"] = all(r["converged"] for r in chaos.restarts) and chaos.final.get("converged", False)
    report["plan_done"] = Counter(k["kind"] for k in chaos.kills) >= Counter(k.partition("@")[0] for k in plan)
    report["events"] = chaos.events
    report["ok"] = (report["lost"] == 0 and report["duplicated"] == 0 and report["wrong_images"] == 0
                    and not report["wrong_vs_model"] and report["reference_missing"] == 0
                    and report["converged_all"] and report["plan_done"])
    return report


ROW = ("| {part} | {run} | {requests} | {answered_once} | {lost} | {duplicated} | {wrong_images} | {wrong_vs_model} | "
       "{cache_info_missing} | "
       "{pv[asked]} / {pv[delivered]} / {pv[skipped_reported]} / {pv[lost_reported]} / {pv[unaccounted]} | {ok_kills} | "
       "{per_role} | {conv} | {took} |")


def table(reports: list[dict]) -> str:
    lines = ["| part | run | requests | answered once | lost | dup | wrong | wrong vs model | cache info missing | "
             "previews asked / delivered / skipped / lost (reported) / unaccounted | orch. kills (in a move) | "
             "kills per role | converged after restarts; at the end | ref / chaos s |", "|" + "---|" * 14]
    for r in reports:
        per = r["kills_per_role"]
        conv = ", ".join(f"{x['after_s']:.0f}s" if x["converged"] else "NO" for x in r["restarts"]) or "-"
        conv += "; end " + ("yes" if r["final"]["chaos"].get("converged") else "NO")
        lines.append(ROW.format(
            **{**r, "wrong_vs_model": "-" if r["wrong_vs_model"] is None else r["wrong_vs_model"]}, pv=r["previews"], ok_kills=f"{r['orchestrator_kills']} ({r['orchestrator_kills_during_move']})",
            per_role=" ".join(f"{k[0]}{per.get(k, 0)}" for k in ("encoder", "denoiser", "decoder", "gateway")),
            conv=conv, took=f"{r['reference']['took_s']:.0f} / {r['chaos']['took_s']:.0f}" if "reference" in r
            else f"- / {r['chaos']['took_s']:.0f}"))
    return "\n".join(lines)


def interrupted(*_) -> None:
    """SIGTERM: as Ctrl-C (a shell's background job ignores SIGINT), so the deployments are stopped."""
    raise KeyboardInterrupt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--part", choices=("sim", "demo", "both"), default="both")
    ap.add_argument("--short", action="store_true", help="one kill of each kind and a 24 s trace (the test suite's)")
    ap.add_argument("--seed", type=int, default=0, help="run i uses seed + i: its request list and kill draws")
    ap.add_argument("--interval", type=float, default=None, help="seconds between kills (default 8; --short 3)")
    ap.add_argument("--first-kill", type=float, default=None, help="seconds into the trace of the first kill "
                    "(default 6; --short 3)")
    ap.add_argument("--move-wait", type=float, default=None, help="the longest an orchestrator@move kill waits for "
                    "a move (default 45: a phase of the sim trace; --short 20)")
    ap.add_argument("--converge-s", type=float, default=None, help="after an orchestrator kill, the bound on "
                    "convergence (default 60; --short 30)")
    ap.add_argument("--request-timeout", type=float, default=240.0, help="a request not answered this long is lost")
    ap.add_argument("--tolerance", type=int, default=1, help="demo: the largest pixel difference from the reference "
                    "image that is not wrong (sim: 0)")
    ap.add_argument("--ports", default="29600-29699", help="the port range deployments take theirs from")
    ap.add_argument("--work", help="folder for run folders and logs (default: a new temporary one)")
    ap.add_argument("--out", help="write every run's report here as JSON")
    ap.add_argument("-v", "--verbose", action="store_true", help="print kills, moves and restarts as they happen")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    defaults = {"interval": (8, 3), "first_kill": (6, 3), "move_wait": (45, 20), "converge_s": (60, 30)}
    for name, (full, short) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, short if args.short else full)
    args.port_lo, args.port_hi = map(int, args.ports.split("-"))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="disagg-chaos-day-"))
    work.mkdir(parents=True, exist_ok=True)
    parts = ("sim", "demo") if args.part == "both" else (args.part,)
    loras = make_demo_loras(work / "loras") if "demo" in parts else None
    print(f"logs in {work}", flush=True)
    reports = []
    t_start = time.monotonic()
    try:
        for i in range(args.runs):
            for part in parts:
                t0 = time.monotonic()
                r = run_part(part, i, args, work, loras)
                r["wall_s"] = round(time.monotonic() - t0, 1)
                reports.append(r)
                print(table([r]).splitlines()[-1], flush=True)
    except KeyboardInterrupt:
        print("stopped: the deployments of the run in progress were stopped", flush=True)
        return 130
    print()
    print(table(reports))
    bad = [r for r in reports if not r["ok"]]
    for r in bad:
        why = [f"{r[k]} {k}" for k in ("lost", "duplicated", "wrong_images") if r[k]]
        why += [f"{r['wrong_vs_model']} wrong vs the model"] if r.get("wrong_vs_model") else []
        why += [f"{sum(not x['converged'] for x in r['restarts'])} restarts not converged"] if not r["converged_all"] else []
        why += ["kill plan not carried out"] if not r["plan_done"] else []
        print(f"- {r['part']} run {r['run']}: " + ", ".join(why))
        for x in r["restarts"]:
            if not x["converged"]:
                print(f"    restart at {x['at_s']} s{' (during a move)' if x['during_move'] else ''}: {x['why']}")
        for w in r["wrong"][:5]:
            print(f"    wrong image {w['id']} ({w['path']}): max diff {w['max_diff']}"
                  + (f"; {w['is']} ({w['previews']} previews asked)" if "is" in w else ""))
    print(f"{len(reports) - len(bad)} of {len(reports)} part runs: 0 lost, 0 duplicated, 0 wrong, converged "
          f"({time.monotonic() - t_start:.0f} s)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "runs": reports},
                                             indent=1, default=str) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
