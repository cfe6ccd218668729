"""Pools that size themselves: `--rebalance auto` against every static split of 8 devices, on a three-phase trace.

    python benchmarks/rebalance.py                      # 3 auto runs + the 21 static splits (~25 min here)
    python benchmarks/rebalance.py --runs 1 --phase-s 60 --static 1:5:2,1:6:1,1:4:3

sim:mixed-h200 (images at FLUX.1's H200 costs, videos at Wan 2.1 1.3B's) on 8 simulated devices, one per
instance. The trace: three phases of --phase-s seconds each, closed loop (--concurrency requests in flight):
  1. 1024^2 at 2 steps (a distilled model: the decode is a quarter of the denoise),
  2. 1024^2 at 28 steps (the denoise dominates),
  3. 480p x 81 frames at 4 steps (a distilled video model: a 1.8 s decode against 2.4 s of denoising).
auto starts from a bad split (--start, 3:3:2). Every static split of 8 (each role at least 1) runs the same
trace with rebalance off. The deployments run side by side, a few at a time (--parallel), each auto run beside
static ones, so they share the machine alike: their stage times are sleeps on simulated devices, and a few
deployments' control planes take a fraction of the two cores.

Per phase: a static split's throughput is its completions in the phase after the first --settle-s (the pipeline
fills) over that time; auto's is the same after it converged (its last move of the phase ended), and the time
to converge is counted from the phase's start. Over the whole trace: a trace of N_k requests in phase k, N_k
the best static split's phase-k throughput x --phase-s, takes sum(N_k / r_k) seconds on a deployment with
phase throughputs r_k (its completions over the whole phase, convergence included): the trace's throughput is
sum(N_k) over that. Writes benchmarks/results/rebalance.{json,md,png}.
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
from disagg.orchestrator.parts.planner import fmt, splits  # noqa: E402

PHASES = [
    ("1024x1024, 2 steps", {"width": 1024, "height": 1024, "num_inference_steps": 2}),
    ("1024x1024, 28 steps", {"width": 1024, "height": 1024, "num_inference_steps": 28}),
    ("832x480 x 81 frames, 4 steps", {"width": 832, "height": 480, "num_frames": 81, "num_inference_steps": 4}),
]
CONFIG = """model: sim:mixed-h200
gpus: [0, 1, 2, 3, 4, 5, 6, 7]
encoders: {{count: {e}, capacity: 4}}
denoisers: {{count: {d}, capacity: 2}}
decoders: {{count: {k}, capacity: 4}}
spares: 2
rebalance: {{mode: "{mode}", interval_s: 1.0, window_s: {window}, cooldown_s: {cooldown}, min_gain: 0.05}}
"""


async def drive(endpoint: str, phase_s: float, concurrency: int, alternate_s: float = 0.0, total_s: float = 0.0) -> dict:
    """The closed-loop trace against one deployment: every request's phase, finish time and outcome, and the
    split (E:D:K) and moves in progress every half second. With `alternate_s`: phases 1 and 2 take turns every
    that many seconds for `total_s`."""
    total_s = total_s or phase_s * len(PHASES)

    def phase_at(t: float) -> int:
        if t >= total_s:
            return len(PHASES)
        return int(t // alternate_s) % 2 if alternate_s else int(t // phase_s)

    from disagg.client.aio import AsyncClient
    from disagg.transport.wire.messages import params_from_obj

    client = AsyncClient(endpoint)
    await client.start()
    t0 = time.monotonic()
    done, splits_seen = [], []
    counter = [0]

    async def worker():
        while True:
            t = time.monotonic() - t0
            phase = phase_at(t)
            if phase >= len(PHASES):
                return
            counter[0] += 1
            k = counter[0]
            params = params_from_obj({"prompt": f"rebalance {k}", "seed": k, **PHASES[phase][1]})
            outcome = await client.submit(f"rb-{k}-{int(t0)}", params)
            done.append((phase, time.monotonic() - t0, outcome.ok, outcome.error))

    async def watch():
        while time.monotonic() - t0 < total_s:
            try:
                st = await client.status()
            except Exception:  # noqa: BLE001 - a missed sample is not a result
                await asyncio.sleep(0.5)
                continue
            rb = st.rebalance
            count = {r: sum(1 for i in st.instances if i.role == r and i.state in ("ready", "starting"))
                     for r in ("encoder", "denoiser", "decoder")}
            splits_seen.append({"t": round(time.monotonic() - t0, 2), "serving": fmt(count),
                                "split": rb.current if rb else "", "recommended": rb.recommended if rb else "",
                                "moving": len(rb.moving) if rb else 0, "moves": rb.moves if rb else 0})
            await asyncio.sleep(0.5)

    await asyncio.gather(watch(), *(worker() for _ in range(concurrency)))
    await client.close()
    return {"done": done, "splits": splits_seen}


def one(split: str, mode: str, args) -> dict:
    """One deployment of `split`, rebalance `mode`, driven through the trace; its raw records."""
    e, d, k = (int(x) for x in split.split(":"))
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "c.yaml"
        cfg.write_text(CONFIG.format(e=e, d=d, k=k, mode=mode, window=args.window_s, cooldown=args.cooldown_s))
        proc = subprocess.Popen(disagg("launch", "--config", str(cfg), "--port", str(port), "--no-dashboard"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            wait_ready(endpoint, proc)
            rec = asyncio.run(drive(endpoint, args.phase_s, args.concurrency, args.alternate_s, args.alternate_total_s
                                    if args.alternate_s else 0.0))
        finally:
            stop_all([proc])
    rec.update(split=split, mode=mode)
    return rec


def hysteresis(args) -> None:
    """Traffic alternating faster than the cooldown: count the moves (after the first plan settles the split)."""
    rec = one(args.start, "auto", args)
    moves = max((x["moves"] for x in rec["splits"]), default=0)
    changes = [x for prev, x in zip(rec["splits"], rec["splits"][1:]) if x["split"] != prev["split"]]
    recs = sorted({x["recommended"] for x in rec["splits"] if x["recommended"]})
    failed = sum(1 for _, _, ok, _ in rec["done"] if not ok)
    doc = {"alternate_s": args.alternate_s, "total_s": args.alternate_total_s, "start": args.start,
           "cooldown_s": args.cooldown_s, "window_s": args.window_s, "moves": moves,
           "split_changes": [(x["t"], x["split"]) for x in changes], "recommendations_seen": recs,
           "completed": sum(1 for _, _, ok, _ in rec["done"] if ok), "failed": failed}
    print(json.dumps(doc, indent=1))
    Path(args.out).write_text(json.dumps(doc, indent=1))


def analyse(rec: dict, phase_s: float, settle_s: float) -> dict:
    """Per phase: completions, throughput over the phase and after it settled (static) or converged (auto)."""
    out = []
    for p in range(len(PHASES)):
        start, end = p * phase_s, (p + 1) * phase_s
        ok = [t for ph, t, good, _ in rec["done"] if good and start <= t < end]
        lost = sum(1 for ph, t, good, _ in rec["done"] if not good)
        converged = start
        if rec["mode"] == "auto":  # the last time in the phase a move was in progress, or the split changed
            samples = [s for s in rec["splits"] if start <= s["t"] < end]
            for prev, s in zip(samples, samples[1:]):
                if s["moving"] or s["split"] != prev["split"] or prev["moving"]:
                    converged = s["t"]
        steady_from = max(converged, start + settle_s)
        steady = [t for t in ok if t >= steady_from]
        final = next((s["split"] for s in reversed(rec["splits"]) if s["t"] < end), "")
        advised = next((s["recommended"] for s in reversed(rec["splits"]) if s["t"] < end), "")
        out.append({"completed": len(ok), "rps": len(ok) / phase_s,
                    "steady_rps": len(steady) / max(end - steady_from, 1e-9),
                    "converge_s": round(converged - start, 1) if rec["mode"] == "auto" else 0.0,
                    "final_split": final, "advised": advised, "lost": lost})
    moves = max((s["moves"] for s in rec["splits"]), default=0)
    return {"split": rec["split"], "mode": rec["mode"], "phases": out, "moves": moves,
            "failed": sum(1 for _, _, good, _ in rec["done"] if not good)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="auto runs")
    ap.add_argument("--phase-s", type=float, default=100.0)
    ap.add_argument("--settle-s", type=float, default=15.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--start", default="3:3:2", help="auto's first split")
    ap.add_argument("--static", default="", help="static splits (comma-separated; default: all of 8)")
    ap.add_argument("--parallel", type=int, default=6, help="deployments at a time")
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--cooldown-s", type=float, default=15.0)
    ap.add_argument("--alternate-s", type=float, default=0.0,
                    help="hysteresis: one auto run whose traffic switches between phases 1 and 2 every this many s")
    ap.add_argument("--alternate-total-s", type=float, default=180.0)
    ap.add_argument("--video-frames", type=int, default=81, help="phase 3's video frames (33: a 0.77 s decode against "
                    "0.70 s of denoising, the best split 1:3:4; 81: 1.8 s against 2.4 s, 1:4:3)")
    ap.add_argument("--video-steps", type=int, default=4, help="phase 3's denoising steps")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/rebalance.json"))
    args = ap.parse_args()
    PHASES[2] = (f"832x480 x {args.video_frames} frames, {args.video_steps} steps",
                 {"width": 832, "height": 480, "num_frames": args.video_frames, "num_inference_steps": args.video_steps})
    if args.alternate_s:
        hysteresis(args)
        return
    statics = args.static.split(",") if args.static else [fmt(s) for s in splits(8)]
    jobs = [(args.start, "auto") for _ in range(args.runs)] + [(s, "off") for s in statics]
    # each auto run shares its group with static ones
    order = []
    autos, rest = jobs[:args.runs], jobs[args.runs:]
    per = max(args.parallel - 1, 1)
    while autos or rest:
        if autos:
            order.append(autos.pop(0))
        order += rest[:per]
        rest = rest[per:]
    t0 = time.monotonic()
    with ThreadPoolExecutor(args.parallel) as pool:
        recs = list(pool.map(lambda job: one(job[0], job[1], args), order))
    print(f"{len(recs)} deployments in {time.monotonic() - t0:.0f} s")
    results = [analyse(r, args.phase_s, args.settle_s) for r in recs]
    report(results, args)
    plot(recs, results, args)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results, "raw": recs}, indent=1))


def report(results: list[dict], args) -> None:
    static = [r for r in results if r["mode"] == "off"]
    auto = [r for r in results if r["mode"] == "auto"]
    lines = [f"sim:mixed-h200, 8 simulated devices, closed loop at concurrency {args.concurrency}, "
             f"{args.phase_s:g} s per phase; auto from {args.start} (window {args.window_s:g} s, cooldown "
             f"{args.cooldown_s:g} s); {len(auto)} auto runs, {len(static)} static splits", ""]
    lines += ["| phase | best static split | its req/s | auto req/s after converging (runs) | auto / best | "
              "converged in s (runs) | auto's split | advise's pick ok |", "|---|---|---|---|---|---|---|---|"]
    best_rates = []
    for p, (name, _) in enumerate(PHASES):
        best = max(static, key=lambda r: r["phases"][p]["steady_rps"]) if static else None
        b = best["phases"][p]["steady_rps"] if best else float("nan")
        best_rates.append(b)
        a = [r["phases"][p]["steady_rps"] for r in auto]
        conv = [r["phases"][p]["converge_s"] for r in auto]
        finals = sorted({r["phases"][p]["final_split"] for r in auto})
        # advise's pick at the phase's end, against the sweep's best (or one within 2% of it)
        ok = []
        for f in sorted({r["phases"][p]["advised"] for r in auto}):
            match = next((r for r in static if r["split"] == f), None)
            ok.append(f"{f}: {'yes' if match and match['phases'][p]['steady_rps'] >= 0.98 * b else 'no'}")
        lines.append(f"| {name} | {best['split'] if best else '-'} | {b:.3f} | {statistics.median(a):.3f} "
                     f"({', '.join(f'{x:.3f}' for x in a)}) | {statistics.median(a) / b:.3f} | {statistics.median(conv):.1f} "
                     f"({', '.join(f'{x:.1f}' for x in conv)}) | {', '.join(finals)} | {'; '.join(ok)} |")

    def trace_rps(r):  # sum N_k / sum(N_k / r_k), N_k = best static rate x phase length
        n = [b * args.phase_s for b in best_rates]
        return sum(n) / sum(nk / max(ph["rps"], 1e-9) for nk, ph in zip(n, r["phases"]))

    whole = sorted(((trace_rps(r), r["split"]) for r in static), reverse=True)
    a_whole = [trace_rps(r) for r in auto]
    # the oracle: each phase on that phase's best static split (its completions over the whole phase, fill included)
    bests = [max(static, key=lambda r: r["phases"][p]["steady_rps"]) for p in range(len(PHASES))] if static else []
    oracle = trace_rps({"phases": [b["phases"][p] for p, b in enumerate(bests)]}) if bests else float("nan")
    lines += ["", f"Whole trace (N = {', '.join(f'{b * args.phase_s:.0f}' for b in best_rates)} requests per phase): "
              f"auto {statistics.median(a_whole):.3f} req/s (runs {', '.join(f'{x:.3f}' for x in a_whole)}); best "
              f"static {whole[0][1]} {whole[0][0]:.3f} req/s, then {', '.join(f'{s} {x:.3f}' for x, s in whole[1:4])}: "
              f"auto / best static = {statistics.median(a_whole) / whole[0][0]:.3f}; the oracle (each phase on its "
              f"best static split) {oracle:.3f} req/s = {oracle / whole[0][0]:.3f}x",
              f"Moves per auto run: {', '.join(str(r['moves']) for r in auto)}; failed requests: auto "
              f"{sum(r['failed'] for r in auto)}, static {sum(r['failed'] for r in static)}", ""]
    lines += ["| static split | " + " | ".join(f"phase {p + 1} req/s" for p in range(len(PHASES))) + " | whole trace req/s |",
              "|---|" + "---|" * (len(PHASES) + 1)]
    for r in sorted(static, key=lambda r: -trace_rps(r)):
        lines.append(f"| {r['split']} | " + " | ".join(f"{ph['steady_rps']:.3f}" for ph in r["phases"])
                     + f" | {trace_rps(r):.3f} |")
    text = "\n".join(lines)
    print(text)
    Path(args.out).with_suffix(".md").write_text(text + "\n")


def plot(recs: list[dict], results: list[dict], args) -> None:
    """The median auto run over time, drawn with Pillow: throughput (completions per 5 s, log scale) against each
    phase's best static split, and its split (devices per role)."""
    import math

    from PIL import Image, ImageDraw

    autos = [(rec, res) for rec, res in zip(recs, results) if rec["mode"] == "auto"]
    static = [r for r in results if r["mode"] == "off"]
    if not autos:
        return
    autos.sort(key=lambda ar: sum(ph["rps"] for ph in ar[1]["phases"]))
    rec = autos[len(autos) // 2][0]
    end = args.phase_s * len(PHASES)
    w, h, pad, mid = 900, 560, 60, 330
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.text((pad, 8), f"rebalance auto from {args.start} on 8 simulated H200s (sim:mixed-h200): throughput and split "
                     "over time", fill="black")

    def x(t):
        return pad + (w - 2 * pad) * t / end

    lo, hi = math.log10(0.3), math.log10(30)

    def y_rate(v):
        return mid - 20 - (mid - 20 - 40) * (math.log10(max(v, 0.3)) - lo) / (hi - lo)

    def y_dev(n):
        return h - pad - (h - pad - mid - 10) * n / 8

    for v in (0.3, 1, 3, 10, 30):
        d.line([pad, y_rate(v), w - pad, y_rate(v)], fill="#e5e5e5")
        d.text((10, y_rate(v) - 6), f"{v:g}/s", fill="black")
    for n in (0, 2, 4, 6, 8):
        d.line([pad, y_dev(n), w - pad, y_dev(n)], fill="#e5e5e5")
        d.text((25, y_dev(n) - 6), str(n), fill="black")
    for p, (name, _) in enumerate(PHASES):
        d.line([x(p * args.phase_s), 30, x(p * args.phase_s), h - pad], fill="black")
        if static:
            best = max(static, key=lambda r: r["phases"][p]["steady_rps"])
            yb = y_rate(best["phases"][p]["steady_rps"])
            d.line([x(p * args.phase_s), yb, x((p + 1) * args.phase_s), yb], fill="#888888", width=2)
            d.text((x(p * args.phase_s) + 4, 34), f"{name}", fill="black")
            d.text((x(p * args.phase_s) + 4, yb - 16), f"best static {best['split']}", fill="#555555")
    bin_s = 5.0
    pts = []
    for b in range(int(end / bin_s)):
        n = sum(1 for _, t, ok, _ in rec["done"] if ok and b * bin_s <= t < (b + 1) * bin_s) / bin_s
        pts += [(x(b * bin_s), y_rate(n)), (x((b + 1) * bin_s), y_rate(n))]
    d.line(pts, fill="#1f77b4", width=2)
    d.text((w - pad - 190, 50), "auto: completions per s (5 s bins)", fill="#1f77b4")
    for i, (role, color) in enumerate((("encoders", "#2ca02c"), ("denoisers", "#ff7f0e"), ("decoders", "#d62728"))):
        line = []
        for s0, s1 in zip(rec["splits"], rec["splits"][1:] + [{"t": end, "split": rec["splits"][-1]["split"]}]):
            n = int(s0["serving"].split(":")[i])
            line += [(x(s0["t"]), y_dev(n) + i), (x(min(s1["t"], end)), y_dev(n) + i)]
        d.line(line, fill=color, width=2)
        d.text((w - pad - 190 + 65 * i, mid + 14), role, fill=color)
    for t in range(0, int(end) + 1, int(args.phase_s // 2) or 1):
        d.text((x(t) - 8, h - pad + 6), f"{t}", fill="black")
    d.text((w // 2 - 20, h - 25), "seconds", fill="black")
    d.text((pad, mid + 14), "instances serving per role (a moving device counts for neither)", fill="black")
    img.save(Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
