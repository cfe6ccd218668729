"""`--rebalance auto` on devices of two classes: the denoisers start mostly on the slow ones.

    python benchmarks/rebalance_classes.py                  # 3 runs of 3 deployments side by side (~12 min here)
    python benchmarks/rebalance_classes.py --runs 1 --duration-s 120
    python benchmarks/rebalance_classes.py --report         # the table and plot again from the saved records

sim:flux-h200 on 4 simulated H200s and 4 L40Ss (`devices: 4xH200,4xL40S`), 1024^2 images at 8 steps, closed loop.
Each run starts three deployments side by side, so they share the machine alike:
- `bad, auto`: 1:6:1 with the encoder, the decoder and two denoisers on the H200s, four denoisers on the L40Ss
  (H200 1:2:1, L40S 0:4:0), `rebalance: auto`. By counts 1:6:1 is already the best split; by class, the H200s'
  light roles swap with two L40S denoisers.
- `bad, advise`: the same placement, left as it is (advise never moves; `auto` by counts made no move either).
- `planned, advise`: the placement the by-class plan recommends (H200 0:4:0, L40S 1:2:1), from the start.

Per deployment: completions per second over the last --measure-s before the loop stops sending (auto has converged by then: the
script checks that no move was in progress in that time), and the plan's predicted req/s of its placement. Medians
of --runs. Writes benchmarks/results/rebalance-classes.{json,md,png} (the plot: the median auto run's completions
per 5 s beside the two placements left as they are, run alike).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.sim_suite import disagg, stop_all, wait_ready  # noqa: E402
from disagg.launcher.ports import free_port_pair  # noqa: E402

STEPS = 8
#: devices 0-3 are H200s, 4-7 L40Ss
PLACEMENTS = {
    "bad": {"encoders": [0], "denoisers": [1, 2, 4, 5, 6, 7], "decoders": [3]},
    "planned": {"encoders": [4], "denoisers": [0, 1, 2, 3, 5, 6], "decoders": [7]},
}
CONFIG = """model: sim:flux-h200
devices: 4xH200,4xL40S
encoders: {{count: 1, capacity: 4, gpus: {encoders}}}
denoisers: {{count: 6, capacity: 2, gpus: {denoisers}}}
decoders: {{count: 1, capacity: 4, gpus: {decoders}}}
spares: 2
rebalance: {{mode: "{mode}", interval_s: 1.0, window_s: 10.0, cooldown_s: 15.0, min_gain: 0.05}}
"""


async def drive(endpoint: str, duration_s: float, concurrency: int) -> dict:
    """Closed loop for `duration_s`: each request's finish time and outcome, and the rebalance state every second."""
    from disagg.client.aio import AsyncClient
    from disagg.transport.wire.messages import params_from_obj

    client = AsyncClient(endpoint)
    await client.start()
    t0 = time.monotonic()
    done, samples, counter = [], [], [0]

    async def worker():
        while time.monotonic() - t0 < duration_s:
            counter[0] += 1
            k = counter[0]
            params = params_from_obj({"prompt": f"classes {k}", "seed": k, "width": 1024, "height": 1024,
                                      "num_inference_steps": STEPS})
            outcome = await client.submit(f"rc-{k}-{int(t0)}", params)
            done.append((time.monotonic() - t0, outcome.ok, outcome.error))

    async def watch():
        while time.monotonic() - t0 < duration_s:
            try:
                rb = (await client.status()).rebalance
            except Exception:  # noqa: BLE001 - a missed sample is not a result
                rb = None
            if rb is not None:
                samples.append({"t": round(time.monotonic() - t0, 2), "current": rb.current_classes or rb.current,
                                "recommended": rb.recommended_classes or rb.recommended,
                                "current_rps": rb.current_rps, "recommended_rps": rb.recommended_rps,
                                "moving": len(rb.moving), "moves": rb.moves, "holding": rb.holding})
            await asyncio.sleep(1.0)

    await asyncio.gather(watch(), *(worker() for _ in range(concurrency)))
    await client.close()
    return {"done": done, "samples": samples}


def one(name: str, mode: str, args) -> dict:
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "c.yaml"
        cfg.write_text(CONFIG.format(mode=mode, **PLACEMENTS[name]))
        proc = subprocess.Popen(disagg("launch", "--config", str(cfg), "--port", str(port), "--no-dashboard"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            wait_ready(endpoint, proc)
            rec = asyncio.run(drive(endpoint, args.duration_s, args.concurrency))
        finally:
            stop_all([proc])
    start = args.duration_s - args.measure_s
    last = [s for s in rec["samples"] if s["t"] >= start]
    moved_late = any(s["moving"] for s in last)
    final = rec["samples"][-1] if rec["samples"] else {}
    # the converged placement's predicted rate: the plan's current_rps once nothing moves
    finished = [round(t, 3) for t, good, _ in rec["done"] if good]
    return {"placement": name, "mode": mode, "rps": rate(finished, args), "failed": sum(1 for _, g, _ in rec["done"] if not g),
            "final": final.get("current", ""), "recommended": final.get("recommended", ""),
            "predicted_rps": final.get("current_rps", 0.0), "moves": final.get("moves", 0), "moved_late": moved_late,
            "converged_s": next((s["t"] for s in rec["samples"] if s["moves"] >= 1 and not s["moving"]
                                 and s["current"] == final.get("current")), None) if mode == "auto" else None,
            "samples": rec["samples"], "finished": finished}


def rate(finished: list[float], args) -> float:
    """Completions per second in the measured time: the last --measure-s before the loop stops sending (the requests
    still in flight then finish after it, and are not counted)."""
    start = args.duration_s - args.measure_s
    return sum(1 for t in finished if start <= t < args.duration_s) / args.measure_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--duration-s", type=float, default=150.0)
    ap.add_argument("--measure-s", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/rebalance-classes.json"))
    ap.add_argument("--report", action="store_true", help="no runs: the table and plot again from --out's records")
    args = ap.parse_args()
    jobs = [("bad", "auto"), ("bad", "advise"), ("planned", "advise")]
    recs = []
    if args.report:
        doc = json.loads(Path(args.out).read_text())
        args = argparse.Namespace(**{**doc["args"], "out": args.out, "report": True})
        recs = doc["raw"]
        for r in recs:
            r["rps"] = rate(r["finished"], args)
    for run in range(0 if args.report else args.runs):
        with ThreadPoolExecutor(len(jobs)) as pool:
            recs += list(pool.map(lambda job: one(job[0], job[1], args), jobs))
        print(f"run {run + 1}: " + ", ".join(f"{r['placement']}/{r['mode']} {r['rps']:.3f} req/s ({r['final']})"
                                              for r in recs[-len(jobs):]), flush=True)
    rows = []
    for name, mode in jobs:
        mine = [r for r in recs if (r["placement"], r["mode"]) == (name, mode)]
        rows.append({"deployment": f"{name}, {mode}", "rps": statistics.median(r["rps"] for r in mine),
                     "runs": [round(r["rps"], 3) for r in mine], "final": sorted({r["final"] for r in mine}),
                     "predicted_rps": statistics.median(r["predicted_rps"] for r in mine),
                     "moves": [r["moves"] for r in mine], "converged_s": [r["converged_s"] for r in mine],
                     "moved_late": any(r["moved_late"] for r in mine), "failed": sum(r["failed"] for r in mine)})
    base = rows[1]["rps"]
    lines = [f"sim:flux-h200 on 4 H200s + 4 L40Ss, 1024^2 at {STEPS} steps, closed loop at concurrency "
             f"{args.concurrency}; req/s over the {args.measure_s:g} s before the loop stops sending (of "
             f"{args.duration_s:g}); medians of "
             f"{args.runs} runs, the three deployments side by side in each", "",
             "| deployment | placement at the end (per class, E:D:K) | req/s (runs) | vs bad, advise | predicted req/s | "
             "moves | converged at s | failed |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['deployment']} | {'; '.join(r['final'])} | {r['rps']:.3f} ({', '.join(map(str, r['runs']))}) "
                     f"| {r['rps'] / base:.3f} | {r['predicted_rps']:.3f} | {', '.join(map(str, r['moves']))} | "
                     f"{', '.join('-' if c is None else f'{c:g}' for c in r['converged_s'])} | {r['failed']} |")
    if any(r["moved_late"] for r in rows):
        lines.append("\nA move was in progress in the measured time of some run: that run's rate includes it.")
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "raw": recs}, indent=1))
    Path(args.out).with_suffix(".md").write_text(text + "\n")
    plot(recs, len(jobs), args, Path(args.out).with_suffix(".png"))


def plot(recs: list[dict], per_run: int, args, path: Path) -> None:
    """Completions per 5 s over the run of the median auto run and of the two others of its run, drawn with Pillow,
    the auto run's moves marked."""
    from PIL import Image, ImageDraw

    runs = [recs[k:k + per_run] for k in range(0, len(recs), per_run)]
    runs.sort(key=lambda run: run[0]["rps"])
    run = runs[len(runs) // 2]
    bucket, end = 5.0, args.duration_s
    series = []
    for rec in run:
        counts = [0] * int(end // bucket + 1)
        for t in rec.get("finished", []):
            counts[min(int(t // bucket), len(counts) - 1)] += 1
        series.append((f"{rec['placement']}, {rec['mode']}", [c / bucket for c in counts[:-1]]))
    top = max(max(v) for _, v in series) * 1.15 or 1.0
    w, h, pad = 900, 440, 60
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.text((pad, 8), f"rebalance auto on 4 H200 + 4 L40S (sim:flux-h200, 1024^2 x {STEPS} steps): completions per "
                     f"{bucket:g} s", fill="black")

    def x(t):
        return pad + (w - 2 * pad) * t / end

    def y(v):
        return h - pad - (h - 2 * pad) * v / top

    d.line([(pad, h - pad), (w - pad, h - pad)], fill="black")
    d.line([(pad, pad), (pad, h - pad)], fill="black")
    for k in range(0, int(end) + 1, 30):
        d.text((x(k) - 8, h - pad + 6), f"{k} s", fill="black")
    for k in range(0, int(top) + 1):
        d.text((8, y(k) - 6), f"{k} req/s", fill="black")
    auto = run[0]
    for s_prev, s in zip(auto["samples"], auto["samples"][1:]):
        if s["moves"] > s_prev["moves"]:
            d.line([(x(s["t"]), pad), (x(s["t"]), h - pad)], fill=(220, 220, 220))
    start = end - args.measure_s
    d.line([(x(start), pad), (x(start), h - pad)], fill=(150, 150, 150))
    d.text((x(start) + 4, pad), "measured from here", fill=(100, 100, 100))
    colors = [(200, 40, 40), (40, 40, 200), (40, 150, 40)]
    for k, ((label, values), color) in enumerate(zip(series, colors)):
        pts = [(x((i + 0.5) * bucket), y(v)) for i, v in enumerate(values)]
        d.line(pts, fill=color, width=2)
        d.text((w - pad - 230, pad + 14 * k + 14), label, fill=color)
    d.text((pad, h - 22), "grey lines: auto's moves ending", fill=(120, 120, 120))
    img.save(path)


if __name__ == "__main__":
    main()
