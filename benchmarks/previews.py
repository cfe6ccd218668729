"""Live previews on `sim:flux-h200`: the denoiser's throughput with previews on and off, and how soon after its
step a preview reaches the client, in one run.

    python benchmarks/previews.py                 # 3 runs of each setup (~5 min on 2 cores)
    python benchmarks/previews.py --runs 1 --num-requests 12

Setup: 1 encoder, 1 denoiser, 1 decoder, each on its own simulated device (sim:flux-h200: 170 ms per step at
1024^2, an 85 ms decode); 1024^2 at 8 steps; closed loop at concurrency 4, so the denoiser is the bottleneck
and never idle. Setups, each a fresh deployment: previews 0 and 2 (after steps 3 and 5). Throughput: requests
per second over the measured requests. Preview latency: the client's arrival time less the denoiser's
`staged_at` (the end of the step, same host clock), against one step time + 20 ms. Writes
benchmarks/results/previews.json, a table (stdout, .md) and a plot (.png).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.sim_suite import disagg, stop_all, wait_ready  # noqa: E402
from disagg.client import Client  # noqa: E402
from disagg.launcher.ports import free_port_pair  # noqa: E402
from disagg.transport.wire.messages import GenerationParams  # noqa: E402

CONFIG = """model: sim:flux-h200
encoders: {count: 1, capacity: 4, gpus: [0]}
denoisers: {count: 1, capacity: 4, gpus: [1]}
decoders: {count: 1, capacity: 4, gpus: [2]}
"""
STEP_S = 0.170  # sim:flux-h200's step at 1024^2
SETUPS = {"previews off": 0, "previews 2": 2}


def run_once(name: str, config: Path, n: int, concurrency: int, steps: int) -> dict:
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(disagg("launch", "--config", str(config), "--port", str(port), "--no-dashboard",
                                   "--spares", "0"), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    ages: list[float] = []
    try:
        wait_ready(endpoint, proc)
        params = [GenerationParams(prompt=f"a photo #{i}", width=1024, height=1024, num_inference_steps=steps, seed=i,
                                   previews=SETUPS[name] or None) for i in range(n + concurrency)]
        with Client(endpoint) as client:
            client.run_all(params[:concurrency], concurrency=concurrency)  # warm-up: every role once
            t0 = time.monotonic()
            outcomes = client.run_all(params[concurrency:], concurrency=concurrency,
                                      on_partial=lambda p, _image: ages.append(time.time() - p.staged_at))
            duration = time.monotonic() - t0
    finally:
        stop_all([proc])
    ok = sum(o.ok for o in outcomes)
    return {"throughput_rps": round(ok / duration, 4), "failed": len(outcomes) - ok, "previews": len(ages),
            "preview_age_p50_ms": round(1000 * statistics.median(ages), 2) if ages else None,
            "preview_age_max_ms": round(1000 * max(ages), 2) if ages else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "previews.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="disagg-previews-bench-"))
    config = tmp / "deploy.yaml"
    config.write_text(CONFIG)
    runs: dict[str, list[dict]] = {s: [] for s in SETUPS}
    for k in range(args.runs):  # setups interleaved, so a slow minute of the machine hits both
        for s in SETUPS:
            runs[s].append(run_once(s, config, args.num_requests, args.concurrency, args.steps))
            print(f"run {k + 1} {s}: {runs[s][-1]}", flush=True)
    medians = {}
    for s, rs in runs.items():
        m = {"throughput_rps": statistics.median(r["throughput_rps"] for r in rs),
             "failed": sum(r["failed"] for r in rs), "previews": sum(r["previews"] for r in rs)}
        if SETUPS[s]:
            m["preview_age_p50_ms"] = statistics.median(r["preview_age_p50_ms"] for r in rs)
            m["preview_age_max_ms"] = max(r["preview_age_max_ms"] for r in rs)
        medians[s] = m
    off = medians["previews off"]["throughput_rps"]
    for m in medians.values():
        m["throughput_vs_off"] = round(m["throughput_rps"] / off - 1, 4)
    doc = {"setup": {"model": "sim:flux-h200", "size": "1024x1024", "steps": args.steps, "concurrency": args.concurrency,
                     "num_requests": args.num_requests, "runs": args.runs, "bound_ms": 1000 * STEP_S + 20},
           "medians": medians, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    lines = ["| setup | denoiser req/s | vs off | previews received | preview age p50 ms | max ms | bound ms |",
             "|---|---|---|---|---|---|---|"]
    for s, m in medians.items():
        lines.append(f"| {s} | {m['throughput_rps']:.3f} | {m['throughput_vs_off']:+.1%} | {m['previews']} | "
                     f"{m.get('preview_age_p50_ms', '-')} | {m.get('preview_age_max_ms', '-')} | "
                     f"{1000 * STEP_S + 20:.0f} |")
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    plot(runs, out.with_suffix(".png"))


def plot(runs: dict, path: Path) -> None:
    """Throughput per setup (each run a bar) and the previews' ages against the bound (Pillow)."""
    from PIL import Image, ImageDraw

    w, h = 640, 300
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 5), "Live previews on sim:flux-h200 (1024^2, 8 steps): throughput and preview age", fill="black")
    top = max(r["throughput_rps"] for rs in runs.values() for r in rs) or 1
    x = 40
    for k, (name, rs) in enumerate(runs.items()):
        for r in rs:
            bh = (h - 100) * r["throughput_rps"] / top
            d.rectangle([x, h - 40 - bh, x + 20, h - 40], fill=["#999999", "#1f77b4"][k])
            x += 26
        d.text((x - 26 * len(rs), h - 35), name, fill="black")
        x += 40
    d.text((40, 25), "req/s per run", fill="black")
    bound = 1000 * STEP_S + 20
    left = 360
    d.text((left, 25), "preview age (ms): p50, max; line = step + 20 ms", fill="black")
    ages = [r for r in runs["previews 2"]]
    for i, r in enumerate(ages):
        for j, key in enumerate(("preview_age_p50_ms", "preview_age_max_ms")):
            v = r[key] or 0
            bh = (h - 100) * min(v, bound * 1.5) / (bound * 1.5)
            xx = left + i * 60 + j * 24
            d.rectangle([xx, h - 40 - bh, xx + 20, h - 40], fill=["#2ca02c", "#ff7f0e"][j])
    y = h - 40 - (h - 100) * bound / (bound * 1.5)
    d.line([left - 5, y, w - 10, y], fill="red")
    img.save(path)


if __name__ == "__main__":
    main()
