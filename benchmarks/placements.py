"""Placement that never loses to replicas (issue 46): per workload, the planner's ranking of placements on its
devices (disagg/orchestrator/parts/placements.py), then these measured on the sim model: the best dedicated split,
the best placement with shared devices, colocated replicas (offloading where they must) and the planner's choice.
Every placement of a workload is measured in the same run, alternating, --runs times; medians.

    python benchmarks/placements.py                       # every workload, 3 runs (long: see --time-scale)
    python benchmarks/placements.py --only flux-1024-4 --runs 1   # one workload, merged into the results

Each placement is launched from the config `disagg plan --write-config` would write for it, on simulated devices of
its classes (`devices`), with the workload's profile copied at --time-scale (every simulated time multiplied by it:
a Qwen-Image request takes 132 s on an L40S; the ratios, and so the comparison, stay), chosen per workload so that
its best placement serves about --target-rps. Load: closed loop, --depth x (1 + max_batch) requests in flight per
device (3: enough that no stage of a split starves while another's queue holds requests; at 1 a split measured up to
26% under what it serves), --requests per device (at least 4x those in flight) after a warm-up of one each; the rate
is the steady one (Little's law over the middle 60% of the requests). The prediction
is the planner's req/s for the same scaled profile. The planner's choice is always the best placement of its kind,
so it is measured once, as that kind. Writes benchmarks/results/placements.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.sim_suite import launched  # noqa: E402
from disagg.launcher.bench.trace import TraceLine  # noqa: E402
from disagg.launcher.cli.plan import place_trace, placement_config  # noqa: E402
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


def candidates(workload: str, profile_path: str) -> tuple[dict, str, object]:
    """The planner's best placement of each kind, as {kind label: (config doc, predicted req/s, description)}; the
    label of its choice (always the best of its kind: measured once, as that kind); the work it planned on."""
    _, devices, _, max_batch = WORKLOADS[workload]
    config = resolve(None, {}, {"model": f"sim:{profile_path}", "devices": devices,
                                "denoisers.max_batch": max_batch}).settings
    lines = [TraceLine(t=0.0, **req) for req in mix(workload)]
    scored, work, classes = place_trace(config, lines)
    picks, choice = {}, ""
    for kind, label in (("split", "best split"), ("shared", "best shared"), ("replicas", "replicas")):
        best = next((s for s in scored if s.placement.kind == kind and s.rps > 0), None)
        if best is not None:
            picks[label] = best
            choice = label if best is scored[0] else choice
    return {label: (placement_config(config, s, classes), s.rps, s.placement.describe(classes))
            for label, s in picks.items()}, choice, work


def steady_rps(latencies: list[float], in_flight: int, trim: float = 0.2) -> float:
    """The rate the placement sustains, by Little's law: a closed loop keeps `in_flight` requests in the system,
    so it serves in_flight / (their mean latency) requests per second. Over the requests `trim` from either end
    of the submission order (the ramp-up, and the last ones, when fewer are in flight). Not completions counted
    over a span: replicas finish in waves, and a span from one wave's middle to another's counts a wave too many."""
    middle = latencies[int(len(latencies) * trim): len(latencies) - int(len(latencies) * trim)]
    return in_flight / statistics.fmean(middle) if middle else 0.0


def measure(doc: dict, requests: list[dict], per_device: int, max_batch: int, folder: Path, depth: int = 3) -> dict:
    """Launch the placement, drive it closed-loop, return its steady rate. In flight: depth x (1 + max_batch)
    requests per device (a batching denoiser fills its batches; every other device has one waiting as one runs;
    `depth` more keep every stage of a split fed while others queue), and at least four times that many requests
    in all (the steady part of the run is most of it)."""
    from disagg.client import Client
    from disagg.transport.wire.messages import GenerationParams

    n_devices = len(doc.get("gpus") or {g for s in ("encoders", "denoisers", "decoders") for g in doc[s]["gpus"]})
    config = folder / f"placement-{time.monotonic_ns()}.yaml"
    config.write_text(yaml.safe_dump(doc))
    with launched(config) as endpoint:
        in_flight = depth * (1 + max_batch) * n_devices
        n = max(n_devices * per_device, 4 * in_flight)
        params = [GenerationParams(prompt=f"p{k}", **requests[k % len(requests)]) for k in range(n)]
        with Client(endpoint) as client:
            client.run_all(params[:n_devices], concurrency=n_devices)  # warm-up: every instance once
            outcomes = client.run_all(params, concurrency=in_flight)
        ok = sum(o.ok for o in outcomes)
        return {"rps": round(steady_rps([o.latency_s for o in outcomes], in_flight), 4), "completed": ok,
                "failed": len(outcomes) - ok,
                "errors": sorted({o.error for o in outcomes if not o.ok})[:3]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated workloads (default: all)")
    ap.add_argument("--target-rps", type=float, default=5.0,
                    help="each workload's times are scaled so that its best placement serves about this many req/s")
    ap.add_argument("--requests", type=int, default=6, help="measured requests per device")
    ap.add_argument("--depth", type=int, default=3,
                    help="requests in flight per device, in units of 1 + denoisers.max_batch")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "placements.json"))
    args = ap.parse_args()
    names = [w for w in (args.only.split(",") if args.only else WORKLOADS)]
    out = Path(args.out)
    results = json.loads(out.read_text()) if args.only and out.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in names:
            unscaled, _, _ = candidates(name, scaled_profile(WORKLOADS[name][0], 1.0, folder))
            scale = max(rps for _, rps, _ in unscaled.values()) / args.target_rps
            picks, choice, work = candidates(name, scaled_profile(WORKLOADS[name][0], scale, folder))
            runs: dict[str, list] = {label: [] for label in picks}
            for k in range(args.runs):
                for label, (doc, _, _) in picks.items():
                    got = measure(doc, mix(name), args.requests, WORKLOADS[name][3], folder, args.depth)
                    runs[label].append(got)
                    print(f"{name} run {k + 1} {label}: {got['rps']:.3f} req/s ({got['failed']} failed)", flush=True)
            results[name] = {
                "profile": WORKLOADS[name][0], "devices": WORKLOADS[name][1], "time_scale": round(scale, 6),
                "planner": choice, "work_s": work.seconds,
                "placements": {label: {"placement": desc, "predicted_rps": round(pred, 4),
                                       "measured_rps": round(statistics.median(r["rps"] for r in runs[label]), 4),
                                       "runs": runs[label]}
                               for label, (_, pred, desc) in picks.items()},
            }
            out.write_text(json.dumps(results, indent=1))
    table = markdown(results)
    out.with_suffix(".md").write_text(table + "\n")
    plot(results, out.with_suffix(".png"))
    print(table)
    return 0


def markdown(results: dict) -> str:
    """One row per workload: every placement's measured req/s (median), the planner's choice and prediction, and
    its ratio to the best other placement measured."""
    rows = ["| workload | devices | best split | best shared | replicas | planner's choice | measured | predicted | "
            "prediction error | vs best other |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        p = r["placements"]

        def cell(label):
            return f"{p[label]['measured_rps']:.3f} ({p[label]['placement']})" if label in p else "does not fit"

        mine = p[r["planner"]]
        others = [q["measured_rps"] for label, q in p.items() if label != r["planner"]]
        ratio = mine["measured_rps"] / max(others) if others else 1.0
        error = mine["predicted_rps"] / mine["measured_rps"] - 1 if mine["measured_rps"] else float("inf")
        rows.append(f"| {name} | {r['devices']} | {cell('best split')} | {cell('best shared')} | {cell('replicas')} | "
                    f"{r['planner']} | {mine['measured_rps']:.3f} | {mine['predicted_rps']:.3f} | {error:+.1%} | "
                    f"{ratio:.3f}x |")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    """Predicted against measured req/s, every placement of every workload (as a share of the workload's best
    prediction, so that workloads of any speed share the axes); the planner's choices filled (Pillow)."""
    from PIL import Image, ImageDraw

    w = h = 420
    pad = 50
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 5), "placements: predicted vs measured (share of the workload's best prediction)", fill="black")
    colors = {"best split": "#1f77b4", "best shared": "#2ca02c", "replicas": "#d62728"}

    def xy(pred, meas):
        return pad + (w - 2 * pad) * pred / 1.2, h - pad - (h - 2 * pad) * meas / 1.2

    d.line([xy(0, 0), xy(1.2, 1.2)], fill="#bbbbbb")
    for t in (0.0, 0.5, 1.0):
        d.text((xy(t, 0)[0] - 8, h - pad + 5), f"{t:.1f}", fill="black")
        d.text((10, xy(0, t)[1] - 6), f"{t:.1f}", fill="black")
    d.text((w / 2 - 30, h - 25), "predicted", fill="black")
    d.text((5, pad - 25), "measured", fill="black")
    for r in results.values():
        top = max(q["predicted_rps"] for q in r["placements"].values())
        for label, q in r["placements"].items():
            x, y = xy(q["predicted_rps"] / top, q["measured_rps"] / top)
            fill = colors[label] if label == r["planner"] else None
            d.ellipse([x - 4, y - 4, x + 4, y + 4], outline=colors[label], fill=fill)
    for k, (label, color) in enumerate(colors.items()):
        d.ellipse([w - 140, 30 + 15 * k, w - 132, 38 + 15 * k], outline=color, fill=color)
        d.text((w - 125, 27 + 15 * k), label, fill="black")
    d.line([pad, h - pad, w - pad, h - pad], fill="black")
    d.line([pad, pad, pad, h - pad], fill="black")
    img.save(path)


if __name__ == "__main__":
    sys.exit(main())
