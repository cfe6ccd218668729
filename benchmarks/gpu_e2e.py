"""The GPU run's end-to-end steps: parity of the tiny pipeline, and real-size Flux, disaggregated vs colocated.

    python benchmarks/gpu_e2e.py parity --out DIR      # tiny (fp32) and a tiny Flux checkpoint (bf16), --gpus 0
    python benchmarks/gpu_e2e.py flux --out DIR        # FLUX.1-dev shapes, random weights, 1024x1024, 4 and 28 steps
    python benchmarks/gpu_e2e.py wan --size 832 --height 480 --frames 33 --steps 4 --out DIR   # Wan 2.1 1.3B
    python benchmarks/gpu_e2e.py parity --device cpu   # the CPU dry run of the same code (no GPU flags)

Each writes DIR/<step>.json. `parity`: a 1:1:1 deployment (cuda-ipc between the roles) against the
same pipeline called in this process on the same device, worst pixel difference per image. `flux`:
per-request latency of 1:1:1 on one GPU against `--colocated 1` on that GPU, and disagg's overhead as
a share of the request's time: (disaggregated - colocated) / disaggregated, medians of --runs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client import Client, Unreachable  # noqa: E402
from launcher.ports import free_port_pair  # noqa: E402
from transport.messages import GenerationParams  # noqa: E402


class Deployment:
    """`disagg launch` in the background, until every instance is ready; stopped on exit."""

    def __init__(self, flags: list[str], log: Path, boot_s: float = 240, env: dict[str, str] | None = None):
        self.port = free_port_pair()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "launcher", "launch", "--port", str(self.port), "--no-dashboard", "--spares", "0",
               *flags]
        print("$", " ".join(cmd), flush=True)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + boot_s
        while True:
            if self.proc.poll() is not None:
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
        try:
            with Client(self.endpoint) as c:
                c.stop(timeout_s=5)
        except Exception:  # noqa: BLE001 - it may be down already
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


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

    save_tiny("flux", folder)
    cases = {"tiny (float32)": ("tiny", "float32"), "tiny Flux checkpoint (bfloat16)": (str(folder), "bfloat16")}
    prompts = ["a red cat", "a blue car at night"]
    doc = {"device": args.device, "cases": {}}
    for name, (model, dtype) in cases.items():
        params = [GenerationParams(prompt=p, seed=7 + i, width=128, height=128, num_inference_steps=4)
                  for i, p in enumerate(prompts)]
        flags = ["--model", model, "-e", "1", "-d", "1", "-k", "1", "--dtype", dtype]
        if gpu:
            flags += ["--gpus", "0", "--transfer", "cuda-ipc"]
        with Deployment(flags, Path(args.out) / f"parity-{model == 'tiny' and 'tiny' or 'ckpt'}.log") as dep:
            outcomes = dep.run(params)
        if model == "tiny":
            from roles.pipelines.tiny import build_tiny_flux_pipeline

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
    return doc


def flux(args) -> dict:
    return real_size(args, "flux")


def wan(args) -> dict:
    return real_size(args, "wan")


def real_size(args, family: str) -> dict:
    """1:1:1 against colocated on one device, random weights of the real shapes (toy shapes on the CPU)."""
    from benchmarks.gpu_models import write_flux, write_wan

    write = write_flux if family == "flux" else write_wan
    folder = write(Path(tempfile.mkdtemp(prefix=f"disagg-{family}-")), "real" if args.device.startswith("cuda") else "toy")
    width, height = args.size, args.height or args.size
    gpu = ["--gpus", "0"] if args.device.startswith("cuda") else []
    every = {"1:1:1": ["-e", "1", "-d", "1", "-k", "1"], "colocated": ["--colocated", "1"]}
    layouts = {name: every[name] for name in args.layouts.split(",")}
    video = {"num_frames": args.frames, "response_format": "mp4"} if family == "wan" else {}
    doc = {"model": {"flux": "FLUX.1-dev", "wan": "Wan 2.1 T2V 1.3B"}[family] + " shapes, random weights",
           "size": f"{width}x{height}", **({"frames": args.frames} if video else {}), "runs": args.runs, "layouts": {}}
    for name, flags in layouts.items():
        with Deployment(["--model", str(folder), *flags, *gpu], Path(args.out) / f"{family}-{name.replace(':', '')}.log",
                        boot_s=args.boot_s) as dep:
            res = {"boot_s": round(dep.boot_s, 1)}
            for steps in args.steps:
                params = [GenerationParams(prompt="a photo of a city at night", seed=i, width=width, height=height,
                                           num_inference_steps=steps, **video) for i in range(args.runs + 1)]
                outcomes = dep.run(params)[1:]  # the first warms up
                res[f"{steps} steps"] = {
                    "latency_s": round(statistics.median(o.latency_s for o in outcomes), 4),
                    "timings": {k: round(statistics.median(o.timings.get(k, 0.0) for o in outcomes), 4)
                                for k in outcomes[0].timings},
                }
        doc["layouts"][name] = res
        print(name, res, flush=True)
    for steps in args.steps if len(doc["layouts"]) == 2 else []:
        d = doc["layouts"]["1:1:1"][f"{steps} steps"]["latency_s"]
        c = doc["layouts"]["colocated"][f"{steps} steps"]["latency_s"]
        doc[f"overhead {steps} steps"] = {"disaggregated_s": d, "colocated_s": c, "overhead_s": round(d - c, 4),
                                          "share": round((d - c) / d, 5)}
    return doc


def compiled(args) -> dict:
    """Flux's denoiser step time, 1:1:1, without and with compile (warmed up at the measured size at boot):
    the compiled step-time row of the GPU table. Boot times include the compile."""
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
            res = {"boot_s": round(dep.boot_s, 1)}
            for steps in args.steps:
                params = [GenerationParams(prompt="a photo of a city at night", seed=i, width=width, height=height,
                                           num_inference_steps=steps) for i in range(args.runs + 1)]
                outcomes = dep.run(params)[1:]
                compute = statistics.median(o.timings.get("compute_denoiser", 0.0) for o in outcomes)
                res[f"{steps} steps"] = {"denoiser_s": round(compute, 4), "step_ms": round(1000 * compute / steps, 2)}
        doc["modes"][name] = res
        print(name, res, flush=True)
    for steps in args.steps if len(doc["modes"]) == 2 else []:
        e, c = (doc["modes"][m][f"{steps} steps"]["step_ms"] for m in ("eager", "compiled"))
        doc[f"speedup {steps} steps"] = round(e / c, 3) if c else None
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["parity", "flux", "wan", "compiled"])
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--size", type=int, default=1024, help="width (and height, unless --height)")
    ap.add_argument("--height", type=int, default=0)
    ap.add_argument("--frames", type=int, default=33, help="wan: frames per video")
    ap.add_argument("--steps", type=int, nargs="+", default=[4, 28])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--boot-s", type=float, default=240)
    ap.add_argument("--layouts", default="1:1:1,colocated", help="flux, wan: which of 1:1:1,colocated to run (the "
                    "overhead row needs both)")
    ap.add_argument("--modes", default="eager,compiled", help="compiled: which of eager,compiled to run")
    ap.add_argument("--model", default="", help="compiled: this model instead of FLUX.1-dev shapes (the CPU dry run: "
                    "tiny, whose compiled kernels tests/test_compile.py may have left in DISAGG_COMPILE_CACHE_DIR)")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    doc = {"parity": parity, "flux": flux, "wan": wan, "compiled": compiled}[args.step](args)
    (Path(args.out) / f"{args.step}.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
