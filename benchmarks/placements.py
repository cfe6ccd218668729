"""Placement that never loses to replicas (issue 46): per workload, the planner's ranking of placements on its
devices (disagg/orchestrator/parts/placements.py), then these measured on the sim model: the best dedicated split,
the best placement with shared devices, colocated replicas (offloading where they must) and the planner's choice.
Every placement of a workload is measured in the same run, alternating, --runs times; medians.

    python benchmarks/placements.py                       # every workload, 3 runs (long: see --time-scale)
    python benchmarks/placements.py --only flux-1024-4 --runs 1

Each placement is launched from the config `disagg plan --write-config` would write for it, on simulated devices of
its classes (`devices`), with the workload's profile copied at --time-scale (every simulated time multiplied by it:
a Qwen-Image request takes 132 s on an L40S; the ratios, and so the comparison, stay). Load: closed loop, two
requests in flight per device, --requests per device after a warm-up. The prediction is the planner's req/s for the
same scaled profile. Writes benchmarks/results/placements.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.sim_suite import disagg, stop_all, wait_ready  # noqa: E402
from disagg.launcher.bench.trace import TraceLine  # noqa: E402
from disagg.launcher.cli.plan import place_trace, placement_config  # noqa: E402
from disagg.launcher.ports import free_port_pair  # noqa: E402
from disagg.roles.pipelines.sim_profile import PROFILE_DIR  # noqa: E402
from disagg.settings import resolve  # noqa: E402

#: name -> (profile, devices, requests (TraceLine fields), denoisers.max_batch)
WORKLOADS = {
    "flux-1024-28": ("flux-h200", "8xH200", [dict(width=1024, height=1024, num_inference_steps=28)], 1),
    "flux-1024-4": ("flux-h200", "8xH200", [dict(width=1024, height=1024, num_inference_steps=4)], 1),
    "wan-480p-81f": ("wan-h200", "8xH200", [dict(width=832, height=480, num_frames=81, num_inference_steps=50)], 1),
    "qwen-1328-50": ("qwen-image-h200", "8xL40S", [dict(width=1328, height=1328, num_inference_steps=50)], 1),
    "flux-512-4-batch": ("flux-h200", "8xL40S", [dict(width=512, height=512, num_inference_steps=4)], 4),
    "mixed": ("mixed-h200", "8xH200,4xL40S", None, 1),
}


def scaled_profile(name: str, scale: float, folder: Path) -> str:
    """A copy of profile `name` (and of the video profile it names) with every time multiplied by `scale`."""
    doc = yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())
    doc["time_scale"] = scale
    if doc.get("video"):
        doc["video"] = scaled_profile(doc["video"], scale, folder)
    path = folder / f"{name}-x{scale:g}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def mix(workload: str) -> list[dict]:
    if WORKLOADS[workload][2] is not None:
        return WORKLOADS[workload][2]
    from benchmarks.traces.mixed import generate

    return [{k: line[k] for k in ("width", "height", "num_inference_steps", "num_frames") if line.get(k)}
            for line in generate(1.0, 100, 0)]


def candidates(workload: str, profile_path: str) -> tuple[dict, list]:
    """The planner's best of each kind and its choice, as {label: (config doc, predicted req/s)}."""
    _, devices, _, max_batch = WORKLOADS[workload]
    config = resolve(None, {}, {"model": f"sim:{profile_path}", "devices": devices,
                                "denoisers.max_batch": max_batch}).settings
    lines = [TraceLine(t=0.0, **req) for req in mix(workload)]
    scored, work, classes = place_trace(config, lines)
    picks = {"planner": scored[0]}
    for kind, label in (("split", "best split"), ("shared", "best shared"), ("replicas", "replicas")):
        best = next((s for s in scored if s.placement.kind == kind and s.rps > 0), None)
        if best is not None:
            picks[label] = best
    return {label: (placement_config(config, s, classes), s.rps, s.placement.describe(classes))
            for label, s in picks.items()}, work


def measure(doc: dict, requests: list[dict], per_device: int, folder: Path) -> dict:
    """Launch the placement, drive it closed-loop, return its throughput."""
    from disagg.client import Client
    from disagg.transport.wire.messages import GenerationParams

    n_devices = len(doc.get("gpus") or {g for s in ("encoders", "denoisers", "decoders") for g in doc[s]["gpus"]})
    config = folder / f"placement-{time.monotonic_ns()}.yaml"
    config.write_text(yaml.safe_dump(doc))
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(disagg("launch", "--config", str(config), "--port", str(port), "--no-dashboard",
                                   "--spares", "0"), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_ready(endpoint, proc)
        params = [GenerationParams(prompt=f"p{k}", **requests[k % len(requests)]) for k in range(n_devices * per_device)]
        with Client(endpoint) as client:
            client.run_all(params[:n_devices], concurrency=2 * n_devices)  # warm-up: every instance once
            t0 = time.monotonic()
            outcomes = client.run_all(params, concurrency=2 * n_devices)
            duration = time.monotonic() - t0
        ok = sum(o.ok for o in outcomes)
        return {"rps": ok / duration, "completed": ok, "failed": len(outcomes) - ok,
                "errors": sorted({o.error for o in outcomes if not o.ok})[:3]}
    finally:
        stop_all([proc])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated workloads (default: all)")
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--requests", type=int, default=4, help="measured requests per device")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "placements.json"))
    args = ap.parse_args()
    names = [w for w in (args.only.split(",") if args.only else WORKLOADS)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in names:
            profile_path = scaled_profile(WORKLOADS[name][0], args.time_scale, folder)
            picks, work = candidates(name, profile_path)
            runs: dict[str, list] = {label: [] for label in picks}
            for k in range(args.runs):
                for label, (doc, _, _) in picks.items():
                    got = measure(doc, mix(name), args.requests, folder)
                    runs[label].append(got)
                    print(f"{name} run {k + 1} {label}: {got['rps']:.3f} req/s ({got['failed']} failed)", flush=True)
            results[name] = {
                "profile": WORKLOADS[name][0], "devices": WORKLOADS[name][1], "time_scale": args.time_scale,
                "work_s": work.seconds,
                "placements": {label: {"placement": desc, "predicted_rps": round(pred, 4),
                                       "measured_rps": round(statistics.median(r["rps"] for r in runs[label]), 4),
                                       "runs": runs[label]}
                               for label, (_, pred, desc) in picks.items()},
            }
    Path(args.out).write_text(json.dumps(results, indent=1))
    for name, r in results.items():
        best_other = max(p["measured_rps"] for label, p in r["placements"].items() if label != "planner")
        planner = r["placements"]["planner"]
        print(f"{name}: planner {planner['placement']} {planner['measured_rps']:.3f} req/s = "
              f"{planner['measured_rps'] / best_other:.3f}x the best other; predicted {planner['predicted_rps']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
