"""Deadlines on a mixed trace: `--schedule slo` against `fifo`, SLO attainment and goodput over request rates.

    python benchmarks/slo_schedule.py                 # 3 runs at 1.25 req/s + a 5-rate curve (~25 min here)
    python benchmarks/slo_schedule.py --runs 1 --rates 1.2,1.6 --num 60

The issue's setup: sim:mixed-h200 (images at FLUX.1's H200 costs, videos at Wan 2.1 1.3B's), 1:4:1, every
instance on its own simulated device, denoiser capacity 4; the mixed trace (benchmarks/traces/mixed.py: 512^2 x
4 steps, 1024^2 x 28 steps, 480p x 33 frames x 30 steps, 50/40/10, Poisson); every request's SLO is 2x its
class's standalone latency (measured first on the idle deployment). Each policy is one deployment; every rate
replays the same seeded trace on both. Writes benchmarks/results/slo-schedule.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.sim_suite import disagg, stop_all, wait_ready  # noqa: E402
from benchmarks.traces.mixed import generate  # noqa: E402
from disagg.launcher.bench.trace import TraceLine, run_trace, standalone  # noqa: E402
from disagg.launcher.ports import free_port_pair  # noqa: E402

CONFIG = """model: sim:mixed-h200
encoders: {count: 1, capacity: 4, gpus: [4]}
denoisers: {count: 4, capacity: 4, gpus: [0, 1, 2, 3]}
decoders: {count: 1, capacity: 4, gpus: [5]}
"""
POLICIES = ("fifo", "slo")


def lines_for(rate: float, num: int, seed: int) -> list[TraceLine]:
    return [TraceLine(**line) for line in generate(rate, num, seed)]


def measure(policy: str, config: Path, plan: list[tuple[str, float, int]], num: int, slo_factor: float) -> dict:
    """One deployment of `policy`; every (tag, rate, seed) of the plan replayed on it in order."""
    from disagg.client import Client

    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(disagg("launch", "--config", str(config), "--port", str(port), "--no-dashboard",
                                   "--spares", "0", "--schedule", policy),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    out = {}
    try:
        wait_ready(endpoint, proc)
        with Client(endpoint) as client:
            alone = standalone(client, lines_for(1.0, 60, 0))
            for tag, rate, seed in plan:
                doc = run_trace(client, lines_for(rate, num, seed), 1.0, slo_factor, alone=alone)
                out.setdefault(tag, []).append(doc)
                print(f"{policy} {tag} rate {rate} seed {seed}: goodput {doc['goodput_rps']} attainment "
                      f"{doc['attainment']} " + " ".join(f"{c['class']}={c['attainment']}" for c in doc["classes"][1:])
                      + f" longest {doc['longest_s']}", flush=True)
    finally:
        stop_all([proc])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs at the main rate (seeds first-seed, first-seed + 1, ...)")
    ap.add_argument("--first-seed", type=int, default=11, help="the main runs' first trace seed (11: seeds the "
                    "scheduler was not tuned on)")
    ap.add_argument("--rate", type=float, default=1.25, help="the main rate (req/s), where fifo attains 50-80%%")
    ap.add_argument("--rates", default="0.8,1.1,1.4,1.7,2.0", help="the curve's rates (one run each, seed 100; "
                    "empty: no curve)")
    ap.add_argument("--num", type=int, default=80, help="requests per trace")
    ap.add_argument("--slo-factor", type=float, default=2.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "slo-schedule.json"))
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r]
    plan = [("main", args.rate, seed) for seed in range(args.first_seed, args.first_seed + args.runs)] + [(f"curve {r:g}", r, 100) for r in rates]
    tmp = Path(tempfile.mkdtemp(prefix="disagg-slo-bench-"))
    config = tmp / "deploy.yaml"
    config.write_text(CONFIG)
    results = {policy: measure(policy, config, plan, args.num, args.slo_factor) for policy in POLICIES}

    def med(policy, tag, key):
        return statistics.median(d[key] for d in results[policy][tag])

    def cls(doc, name):
        return next(c for c in doc["classes"] if c["class"] == name)

    main_rows = {}
    for policy in POLICIES:
        docs = results[policy]["main"]
        classes = [c["class"] for c in docs[0]["classes"]]
        main_rows[policy] = {
            "goodput_rps": med(policy, "main", "goodput_rps"), "attainment": med(policy, "main", "attainment"),
            "longest_s": max(d["longest_s"] for d in docs),
            "classes": {name: {k: statistics.median(cls(d, name)[k] for d in docs)
                               for k in ("attainment", "p50_s", "p99_s", "max_s")} for name in classes},
        }
    gain = main_rows["slo"]["goodput_rps"] / max(main_rows["fifo"]["goodput_rps"], 1e-9)
    curve = {policy: [{"rate": r, **{k: results[policy][f"curve {r:g}"][0][k] for k in ("goodput_rps", "attainment",
                                                                                         "longest_s")}}
                      for r in rates] for policy in POLICIES}
    doc = {"setup": {"profile": "sim:mixed-h200", "split": "1:4:1", "denoiser_capacity": 4, "num": args.num,
                     "slo_factor": args.slo_factor, "main_rate": args.rate, "runs": args.runs,
                     "seeds": list(range(args.first_seed, args.first_seed + args.runs))},
           "main": main_rows, "goodput_gain": round(gain, 3), "curve": curve, "raw": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    lines = [f"Main rate {args.rate:g} req/s, {args.runs} runs (medians); SLO = {args.slo_factor:g} x standalone.", "",
             "| policy | goodput req/s | attainment | " + " | ".join(
                 f"{c} attainment / p50 / p99 s" for c in main_rows["fifo"]["classes"] if c != "all") + " | longest s |",
             "|---|---|---|" + "---|" * (len(main_rows["fifo"]["classes"]) - 1) + "---|"]
    for policy, row in main_rows.items():
        per = " | ".join(f"{v['attainment']:.0%} / {v['p50_s']:.2f} / {v['p99_s']:.2f}"
                         for c, v in row["classes"].items() if c != "all")
        lines.append(f"| {policy} | {row['goodput_rps']:.3f} | {row['attainment']:.1%} | {per} | {row['longest_s']:.1f} |")
    lines += ["", f"slo goodput / fifo goodput: {gain:.2f}x", "",
              "| rate req/s | fifo attainment | slo attainment | fifo goodput | slo goodput | fifo longest s | slo longest s |",
              "|---|---|---|---|---|---|---|"]
    for a, b in zip(curve["fifo"], curve["slo"]):
        lines.append(f"| {a['rate']:g} | {a['attainment']:.1%} | {b['attainment']:.1%} | {a['goodput_rps']:.3f} "
                     f"| {b['goodput_rps']:.3f} | {a['longest_s']:.1f} | {b['longest_s']:.1f} |")
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    if rates:
        plot(curve, out.with_suffix(".png"))


def plot(curve: dict, path: Path) -> None:
    """SLO attainment against request rate, one line per policy, drawn with Pillow."""
    from PIL import Image, ImageDraw

    w, h, pad = 640, 420, 60
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.text((pad, 10), "SLO attainment vs rate (sim:mixed-h200 1:4:1, mixed trace, SLO 2x standalone)", fill="black")
    rates = [p["rate"] for p in curve["fifo"]]
    lo, hi = min(rates), max(rates)

    def xy(rate, att):
        x = pad + (w - 2 * pad) * ((rate - lo) / max(hi - lo, 1e-9))
        return x, h - pad - (h - 2 * pad) * att

    d.line([pad, h - pad, w - pad, h - pad], fill="black")
    d.line([pad, pad, pad, h - pad], fill="black")
    for frac in (0, 0.25, 0.5, 0.75, 1.0):
        _, y = xy(lo, frac)
        d.text((10, y - 6), f"{frac:.0%}", fill="black")
        d.line([pad, y, w - pad, y], fill="#dddddd")
    for r in rates:
        x, _ = xy(r, 0)
        d.text((x - 10, h - pad + 8), f"{r:g}", fill="black")
    d.text((w // 2 - 40, h - 25), "requests / s", fill="black")
    for policy, color in (("fifo", "#d62728"), ("slo", "#2ca02c")):
        pts = [xy(p["rate"], p["attainment"]) for p in curve[policy]]
        d.line(pts, fill=color, width=3)
        for x, y in pts:
            d.ellipse([x - 4, y - 4, x + 4, y + 4], fill=color)
        d.text((pts[-1][0] - 40, pts[-1][1] - 18), policy, fill=color)
    img.save(path)


if __name__ == "__main__":
    main()
