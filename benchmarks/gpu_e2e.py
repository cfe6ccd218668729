"""The GPU run's end-to-end steps: parity of the tiny pipeline, and real-size Flux, disaggregated vs colocated.

    python benchmarks/gpu_e2e.py parity --out DIR      # tiny (fp32) and a tiny Flux checkpoint (bf16), --gpus 0
    python benchmarks/gpu_e2e.py flux --out DIR        # FLUX.1-dev shapes, random weights, 1024x1024, 28 steps
    python benchmarks/gpu_e2e.py compiled --modes compiled --runs 1 --out DIR   # its compiled step time
    python benchmarks/gpu_e2e.py wan --size 832 --height 480 --frames 33 --steps 4 --out DIR   # Wan 2.1 1.3B
    python benchmarks/gpu_e2e.py parity --device cpu   # the CPU dry run of the same code (no GPU flags)

Each writes DIR/<step>.json, again after each result (a case, a layout's step count, a mode): a step stopped by
its time limit keeps what it measured. SIGTERM (gpu_check.sh's `timeout`) kills the deployment running then (its
launcher and every process under it), so nothing of it holds GPU memory under the next step, and exits 143.
`parity`: a 1:1:1 deployment (cuda-ipc between the roles) against the same pipeline called in this process on the
same device, worst pixel difference per image. `flux`: per-request latency of 1:1:1 on one GPU against
`--colocated 1` on that GPU, each with its stage (compute) times, hand-off times and the control plane's share of
the request (latency - compute - fetches, over latency), and disagg's overhead as a share of the request's time:
(disaggregated - colocated) / disaggregated, medians of --runs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from disagg.client import Client, Unreachable  # noqa: E402
from disagg.launcher.ports import free_port_pair  # noqa: E402
from disagg.transport.wire.messages import GenerationParams  # noqa: E402

#: the deployments running now: SIGTERM kills them (on_sigterm)
LIVE: list["Deployment"] = []


class Deployment:
    """`disagg launch` in the background (its own session), until every instance is ready; stopped on exit."""

    def __init__(self, flags: list[str], log: Path, boot_s: float = 240, env: dict[str, str] | None = None):
        self.port = free_port_pair()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "disagg", "launch", "--port", str(self.port), "--no-dashboard", "--spares", "0",
               *flags]
        print("$", " ".join(cmd), flush=True)
        # no SIGTERM between the start and LIVE: its handler would miss this launcher
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, **(env or {})})
            LIVE.append(self)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        deadline = time.monotonic() + boot_s
        while True:
            if self.proc.poll() is not None:
                self.kill()
                raise RuntimeError(f"the launch exited with {self.proc.returncode}; see {log}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"not ready in {boot_s} s; see {log}")
            try:
                with Client(self.endpoint) as c:
                    report = c.status(timeout_s=2)
                states = [i.state for i in report.instances]
                if states and all(s == "ready" for s in states):
                    break
            except Unreachable:
                pass
            time.sleep(0.1)
        self.boot_s = boot_s - (deadline - time.monotonic())

    def run(self, params: list[GenerationParams], timeout_s: float = 600):
        with Client(self.endpoint) as c:
            outcomes = c.run_all(params, concurrency=1, timeout_s=timeout_s)
        bad = [o.error for o in outcomes if not o.ok]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(outcomes)} requests failed: {bad[0]}")
        return outcomes

    def stop(self) -> None:
        """`disagg stop`, then what is left killed (kill)."""
        try:
            with Client(self.endpoint) as c:
                c.stop(timeout_s=5)
        except Exception:  # noqa: BLE001 - it may be down already
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the launcher (it stops what it started), then SIGKILL to what is left of it and of every
        process under it after `grace_s`: its roles run in sessions of their own, which no signal to the
        launcher's process group reaches, and a launcher killed outright would leave them running."""
        import psutil

        try:
            launcher = psutil.Process(self.proc.pid)
            tree = [launcher, *launcher.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        if self.proc.poll() is None:
            self.proc.terminate()
        _, alive = psutil.wait_procs(tree, timeout=grace_s)
        for p in alive:
            try:  # its process group (a role's compile workers), then itself
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, signal.SIGKILL)
                p.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        psutil.wait_procs(alive, timeout=2)
        self.proc.poll()
        if self in LIVE:  # only now: a SIGTERM during this kill kills again
            LIVE.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def on_sigterm(signum, frame) -> None:
    """gpu_check.sh's `timeout` ran out: kill the deployments, keep what was written, exit 143."""
    for dep in list(LIVE):
        dep.kill()
    print("SIGTERM: stopped; the results measured so far are written", flush=True)
    os._exit(128 + signal.SIGTERM)


def save(args, doc: dict) -> None:
    """Write (again) this step's JSON: every result as soon as it is measured."""
    path = Path(args.out) / f"{args.step}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def pixels(png: bytes):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def parity(args) -> dict:
    import numpy as np
    import torch

    gpu = args.device.startswith("cuda")
    folder = Path(tempfile.mkdtemp(prefix="disagg-gpu-ck-"))
    from tests.checkpoints import save_tiny

    every = {"tiny": ("tiny (float32)", "tiny", "float32"), "ckpt": ("tiny Flux checkpoint (bfloat16)", str(folder),
                                                                      "bfloat16")}
    cases = [every[c] for c in args.cases.split(",")]
    if any(model == str(folder) for _, model, _ in cases):
        save_tiny("flux", folder)
    prompts = ["a red cat", "a blue car at night"][:args.prompts]
    doc = {"device": args.device, "cases": {}}
    for name, model, dtype in cases:
        params = [GenerationParams(prompt=p, seed=7 + i, width=args.size, height=args.size,
                                   num_inference_steps=args.steps[0]) for i, p in enumerate(prompts)]
        flags = ["--model", model, "-e", "1", "-d", "1", "-k", "1", "--dtype", dtype]
        if gpu:
            flags += ["--gpus", "0", "--transfer", "cuda-ipc"]
        with Deployment(flags, Path(args.out) / f"parity-{model == 'tiny' and 'tiny' or 'ckpt'}.log") as dep:
            outcomes = dep.run(params)
        if model == "tiny":
            from disagg.roles.pipelines.tiny import build_tiny_flux_pipeline

            pipe = build_tiny_flux_pipeline(args.device)
        else:
            from diffusers import FluxPipeline

            pipe = FluxPipeline.from_pretrained(folder, torch_dtype=getattr(torch, dtype)).to(args.device)
            pipe.set_progress_bar_config(disable=True)
        worst = []
        for p, o in zip(params, outcomes):
            ref = pipe(prompt=p.prompt, width=p.width, height=p.height, num_inference_steps=p.num_inference_steps,
                       generator=torch.Generator("cpu").manual_seed(p.seed)).images[0]
            buf = io.BytesIO()
            ref.save(buf, format="PNG")
            worst.append(int(np.abs(pixels(o.images[0]) - pixels(buf.getvalue())).max()))
        doc["cases"][name] = {"worst_pixel_diff": max(worst), "per_image": worst, "boot_s": round(dep.boot_s, 1)}
        print(name, doc["cases"][name], flush=True)
        save(args, doc)
    return doc


def flux(args) -> dict:
    return real_size(args, "flux")


def wan(args) -> dict:
    return real_size(args, "wan")


def breakdown(o) -> dict:
    """One request's time by where it went: each stage's compute, the hand-offs (a producer's Staged to its
    consumer's Fetched, as the orchestrator saw them; the pulls alone as fetch), and the control plane: what is
    neither compute nor a pull (messages, scheduling, queues, the client's round trip), and its share."""
    t = o.timings
    compute = {k.removeprefix("compute_"): v for k, v in t.items() if k.startswith("compute_")}
    fetch = sum(v for k, v in t.items() if k.startswith("fetch_"))
    control = o.latency_s - sum(compute.values()) - fetch
    return {"stages_s": compute, "handoff_s": sum(v for k, v in t.items() if k.startswith("handoff_")),
            "fetch_s": fetch, "control_plane_s": control, "control_plane_share": control / o.latency_s}


def median_of(rows: list[dict]) -> dict:
    """The median of each number over rows of the same shape (nested dicts too), rounded."""
    out = {}
    for k, v in rows[0].items():
        if isinstance(v, dict):
            out[k] = median_of([r[k] for r in rows])
        else:
            out[k] = round(statistics.median(r.get(k, 0.0) for r in rows), 5)
    return out


def real_size(args, family: str) -> dict:
    """1:1:1 against colocated on one device, random weights of the real shapes (toy shapes on the CPU), or
    --model's."""
    from benchmarks.gpu_models import write_flux, write_wan

    write = write_flux if family == "flux" else write_wan
    scale = "real" if args.device.startswith("cuda") else "toy"
    model = args.model or str(write(Path(tempfile.mkdtemp(prefix=f"disagg-{family}-")), scale))
    width, height = args.size, args.height or args.size
    gpu = ["--gpus", "0"] if args.device.startswith("cuda") else []
    every = {"1:1:1": ["-e", "1", "-d", "1", "-k", "1"], "colocated": ["--colocated", "1"]}
    layouts = {name: every[name] for name in args.layouts.split(",")}
    video = {"num_frames": args.frames, "response_format": "mp4"} if family == "wan" else {}
    name_of = {"flux": "FLUX.1-dev", "wan": "Wan 2.1 T2V 1.3B"}[family] + " shapes, random weights"
    doc = {"model": args.model or name_of, "size": f"{width}x{height}", **({"frames": args.frames} if video else {}),
           "runs": args.runs, "layouts": {}}
    for name, flags in layouts.items():
        with Deployment(["--model", model, *flags, *gpu], Path(args.out) / f"{family}-{name.replace(':', '')}.log",
                        boot_s=args.boot_s) as dep:
            res = doc["layouts"][name] = {"boot_s": round(dep.boot_s, 1)}
            for steps in args.steps:
                params = [GenerationParams(prompt="a photo of a city at night", seed=i, width=width, height=height,
                                           num_inference_steps=steps, **video) for i in range(args.runs + 1)]
                outcomes = dep.run(params)[1:]  # the first warms up
                res[f"{steps} steps"] = {
                    "latency_s": round(statistics.median(o.latency_s for o in outcomes), 4),
                    "timings": {k: round(statistics.median(o.timings.get(k, 0.0) for o in outcomes), 4)
                                for k in outcomes[0].timings},
                    "breakdown": median_of([breakdown(o) for o in outcomes]),
                }
                print(name, steps, "steps", res[f"{steps} steps"], flush=True)
                save(args, doc)
        if family == "flux":
            doc["planner"] = planner_beside(width, height, args.steps)
        for steps in args.steps if len(doc["layouts"]) == 2 else []:
            d = doc["layouts"]["1:1:1"][f"{steps} steps"]["latency_s"]
            c = doc["layouts"]["colocated"][f"{steps} steps"]["latency_s"]
            doc[f"overhead {steps} steps"] = {"disaggregated_s": d, "colocated_s": c, "overhead_s": round(d - c, 4),
                                              "share": round((d - c) / d, 5)}
        save(args, doc)
    return doc


def planner_beside(width: int, height: int, steps_list) -> dict:
    """The placement planner's prediction for these layouts on one H200 (disagg plan, sim:flux-h200's stage times):
    1:1:1 sharing the device, and one replica; as req/s and as one request's seconds (one at a time, as measured)."""
    from disagg.launcher.bench.trace import TraceLine
    from disagg.launcher.cli.plan import place_trace
    from disagg.settings import resolve

    config = resolve(None, {}, {"model": "sim:flux-h200", "devices": "1xH200"}).settings
    out = {}
    for steps in steps_list:
        scored, _, _ = place_trace(config, [TraceLine(t=0.0, width=width, height=height, num_inference_steps=steps)])
        layout = {"shared": "1:1:1", "replicas": "colocated"}  # one device: its shared placement is 1:1:1 on it
        kinds = {layout[s.placement.kind]: s.rps for s in scored if s.rps > 0 and s.placement.kind in layout}
        out[f"{steps} steps"] = {k: {"rps": round(v, 4), "request_s": round(1 / v, 4)} for k, v in kinds.items()}
    return out


def compiled(args) -> dict:
    """Flux's denoiser step time, 1:1:1, with compile (warmed up at the measured size at boot) and, unless --modes
    says compiled alone, without: the compiled step-time row of the GPU table. Boot times include the compile.
    With the compiled mode alone, its eager counterpart is the flux step's 1:1:1 denoiser (DIR/flux.json)."""
    from benchmarks.gpu_models import write_flux

    folder = args.model or write_flux(Path(tempfile.mkdtemp(prefix="disagg-flux-compiled-")),
                                      "real" if args.device.startswith("cuda") else "toy")
    width, height = args.size, args.height or args.size
    gpu = ["--gpus", "0"] if args.device.startswith("cuda") else []
    doc = {"model": "FLUX.1-dev shapes, random weights", "size": f"{width}x{height}", "runs": args.runs, "modes": {}}
    env_sizes = {"DISAGG_COMPILE_SIZES": json.dumps([f"{width}x{height}"])}
    modes = {"eager": [], "compiled": ["--compile"]}
    for name, flags in {m: modes[m] for m in args.modes.split(",")}.items():
        with Deployment(["--model", str(folder), "-e", "1", "-d", "1", "-k", "1", *flags, *gpu],
                        Path(args.out) / f"flux-{name}.log", boot_s=args.boot_s, env=env_sizes) as dep:
            res = doc["modes"][name] = {"boot_s": round(dep.boot_s, 1)}
            for steps in args.steps:
                params = [GenerationParams(prompt="a photo of a city at night", seed=i, width=width, height=height,
                                           num_inference_steps=steps) for i in range(args.runs + 1)]
                outcomes = dep.run(params)[1:]
                compute = statistics.median(o.timings.get("compute_denoiser", 0.0) for o in outcomes)
                res[f"{steps} steps"] = {"denoiser_s": round(compute, 4), "step_ms": round(1000 * compute / steps, 2)}
                print(name, steps, "steps", res[f"{steps} steps"], flush=True)
                save(args, doc)
    eager = {f"{s} steps": doc["modes"]["eager"][f"{s} steps"]["step_ms"] for s in args.steps} \
        if "eager" in doc["modes"] else _flux_eager(Path(args.out), args)
    for steps in args.steps:
        e, c = eager.get(f"{steps} steps"), doc["modes"].get("compiled", {}).get(f"{steps} steps", {}).get("step_ms")
        if e and c:
            doc[f"speedup {steps} steps"] = round(e / c, 3)
            doc[f"eager step_ms {steps} steps"] = e
    save(args, doc)
    return doc


def _flux_eager(out: Path, args) -> dict:
    """The flux step's eager 1:1:1 denoiser step time (ms) per step count, at this size, if it ran."""
    try:
        doc = json.loads((out / "flux.json").read_text())
    except (OSError, ValueError):
        return {}
    if doc.get("size") != f"{args.size}x{args.height or args.size}":
        return {}
    res = doc.get("layouts", {}).get("1:1:1", {})
    return {k: round(1000 * v["timings"].get("compute_denoiser", 0.0) / int(k.split()[0]), 2)
            for k, v in res.items() if k.endswith(" steps")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["parity", "flux", "wan", "compiled"])
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--size", type=int, default=None, help="width (and height, unless --height); parity: 128, "
                    "else 1024")
    ap.add_argument("--height", type=int, default=0)
    ap.add_argument("--frames", type=int, default=33, help="wan: frames per video")
    ap.add_argument("--steps", type=int, nargs="+", default=None, help="parity: 4 (the first given), else 28")
    ap.add_argument("--runs", type=int, default=3, help="measured requests per layout or mode, after one warm-up")
    ap.add_argument("--boot-s", type=float, default=240)
    ap.add_argument("--layouts", default="1:1:1,colocated", help="flux, wan: which of 1:1:1,colocated to run (the "
                    "overhead row needs both)")
    ap.add_argument("--modes", default="eager,compiled", help="compiled: which of eager,compiled to run")
    ap.add_argument("--cases", default="tiny,ckpt", help="parity: which of tiny (fp32), ckpt (a tiny Flux "
                    "checkpoint, bf16) to run")
    ap.add_argument("--prompts", type=int, default=2, choices=[1, 2], help="parity: images per case")
    ap.add_argument("--model", default="", help="flux, wan, compiled: this model instead of the real shapes (the CPU "
                    "dry run's compiled step: tiny, whose compiled kernels tests/test_compile.py may have left in "
                    "DISAGG_COMPILE_CACHE_DIR)")
    args = ap.parse_args()
    args.size = args.size or (128 if args.step == "parity" else 1024)
    args.steps = args.steps or ([4] if args.step == "parity" else [28])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, on_sigterm)
    doc = {"parity": parity, "flux": flux, "wan": wan, "compiled": compiled}[args.step](args)
    save(args, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
