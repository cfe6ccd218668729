"""One pass of the production day's request list over a deployment: the deployment, its ZeroMQ and HTTP clients,
its kills and the convergence checks after each orchestrator restart (benchmarks/chaos_day.py)."""

from __future__ import annotations

import base64
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import msgspec  # noqa: E402
from chaos_day_trace import ROLES, SIM_DEVICES, SIM_LORA  # noqa: E402

from disagg.client import Client, Unreachable  # noqa: E402
from disagg.transport.wire.messages import GenerationParams  # noqa: E402

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
                profile.write_text((ROOT / "disagg" / "roles" / "pipelines" / "sim_profiles" / "mixed-h200.yaml").read_text() + SIM_LORA)
            self.instances = SIM_DEVICES
            self.devices = {f"sim:{k}" for k in range(SIM_DEVICES)}
            args = ["--model", f"sim:{profile}", "--gpus", ",".join(map(str, range(SIM_DEVICES))), "-e", "2", "-d", "3",
                    "-k", "2", "--rebalance", "auto"]
        else:
            self.instances = 4
            self.devices = set()
            # 2 slots for 3 adapters: unloads, so the host tier restores
            args = ["-e", "1", "-d", "2", "-k", "1", "--lora-dir", str(loras), "--lora-slots", "2", "--lora-host-slots", "2"]
        self.cmd = [sys.executable, "-m", "disagg", "launch", *args, *common]
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
