"""The conditioning cache on `sim`: encoder busy time with the cache off and on, at a 30% repeat rate, in one run.

    python benchmarks/conditioning.py                 # 3 runs of each setup (~4 min on 2 cores)
    python benchmarks/conditioning.py --runs 1 --num-requests 100

Setup: sim:flux-h200 (a 24 ms T5 encoding, 4 MiB of embeddings) with 2 encoders, 2 denoisers and 1 decoder,
each on its own simulated device; 256^2 images at 4 steps, closed loop at concurrency 8. The prompts: 70% new,
30% (exactly) a repeat of one of the 50 most recent distinct prompts (a user regenerating a recent prompt with another
seed). Setups, each a fresh deployment: `conditioning_cache_mib: 0` (off) and the default (256 MiB per
encoder). The encoders' busy seconds come from `status` (busy_s) before and after the load. Writes
benchmarks/results/conditioning.json, a table (stdout, .md) and a plot (.png).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.sim_suite import disagg, launched  # noqa: E402

CONFIG = """model: sim:flux-h200
conditioning_cache_mib: {mib}
encoders: {{count: 2, capacity: 4, gpus: [0, 1]}}
denoisers: {{count: 2, capacity: 4, max_batch: 4, gpus: [2, 3]}}
decoders: {{count: 1, capacity: 4, gpus: [4]}}
"""
SETUPS = {"cache off": 0, "cache on (256 MiB)": 256}
WORDS = "red blue green cat dog house tree river city night forest beach bird car sky sun flower man woman".split()


def prompts(n: int, repeat: float, recent: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    repeats = set(rng.sample(range(1, n), round(repeat * n)))  # exactly this share repeats a recent prompt
    seen: list[str] = []
    out = []
    for i in range(n):
        if i in repeats:
            prompt = rng.choice(seen[-recent:])
        else:
            prompt = f"{' '.join(rng.choices(WORDS, k=6))} #{i}"
            seen.append(prompt)
        out.append({"prompt": prompt, "seed": i, "width": 256, "height": 256, "num_inference_steps": 4})
    return out


def encoder_busy(endpoint: str) -> tuple[float, int, int]:
    res = subprocess.run(disagg("status", "--endpoint", endpoint, "--json"), capture_output=True, text=True, check=True)
    encoders = [i for i in json.loads(res.stdout)["instances"] if i["role"] == "encoder"]
    return (sum(i["busy_s"] for i in encoders), sum(i["conditioning"]["hits"] for i in encoders),
            sum(i["conditioning"]["lookups"] for i in encoders))


def run_once(name: str, tmp: Path, prompts_file: Path, n: int, concurrency: int) -> dict:
    config = tmp / f"deploy-{SETUPS[name]}.yaml"
    config.write_text(CONFIG.format(mib=SETUPS[name]))
    with launched(config) as endpoint:
        busy0, hits0, lookups0 = encoder_busy(endpoint)
        cmd = disagg("bench", "--endpoint", endpoint, "--prompts", str(prompts_file), "--num-requests", str(n),
                     "--concurrency", str(concurrency), "--warmup", "0", "--json")
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if res.returncode not in (0, 1):
            raise SystemExit(f"bench failed: {res.stderr[-2000:]}")
        doc = json.loads(res.stdout)
        # the last heartbeats (1 s apart) carry the last hits: busy_s is the orchestrator's own count
        import time

        time.sleep(1.5)
        busy1, hits1, lookups1 = encoder_busy(endpoint)
    lookups = lookups1 - lookups0
    return {"encoder_busy_s": round(busy1 - busy0, 4), "hits": hits1 - hits0, "lookups": lookups,
            "hit_rate": round((hits1 - hits0) / lookups, 4) if lookups else 0.0,
            "throughput_rps": doc["throughput_rps"], "p50_s": doc["latency_s"]["p50"], "failed": doc["failed"],
            "command": " ".join(cmd[2:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--repeat", type=float, default=0.3, help="share of requests that repeat a recent prompt")
    ap.add_argument("--recent", type=int, default=50, help="a repeat is one of this many most recent prompts")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "conditioning.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="disagg-cond-bench-"))
    workload = prompts(args.num_requests, args.repeat, args.recent)
    repeats = args.num_requests - len({p["prompt"] for p in workload})
    prompts_file = tmp / "prompts.json"
    prompts_file.write_text(json.dumps(workload))
    runs: dict[str, list[dict]] = {s: [] for s in SETUPS}
    for k in range(args.runs):  # setups interleaved, so a slow minute of the machine hits both
        for s in SETUPS:
            runs[s].append(run_once(s, tmp, prompts_file, args.num_requests, args.concurrency))
            print(f"run {k + 1} {s}: {runs[s][-1]}", flush=True)
    keys = ("encoder_busy_s", "hit_rate", "hits", "throughput_rps", "p50_s", "failed")
    medians = {s: {key: statistics.median(r[key] for r in runs[s]) for key in keys} for s in SETUPS}
    off = medians["cache off"]["encoder_busy_s"]
    for m in medians.values():
        m["busy_vs_off"] = round(m["encoder_busy_s"] / off - 1, 4) if off else None
    doc = {"setup": {"model": "sim:flux-h200", "encoders": 2, "size": "256x256", "steps": 4,
                     "num_requests": args.num_requests, "repeat": args.repeat, "repeats_in_trace": repeats,
                     "recent": args.recent, "concurrency": args.concurrency, "runs": args.runs},
           "medians": medians, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    lines = ["| setup | encoder busy s | vs off | hit rate | req/s | p50 s | failed |", "|---|---|---|---|---|---|---|"]
    for s, m in medians.items():
        lines.append(f"| {s} | {m['encoder_busy_s']:.3f} | {m['busy_vs_off']:+.1%} | {m['hit_rate']:.1%} | "
                     f"{m['throughput_rps']:.2f} | {m['p50_s']:.3f} | {m['failed']:g} |")
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(table + "\n")
    print(f"{repeats} of {args.num_requests} requests repeat a recent prompt\n{table}")
    plot(medians, runs, out.with_suffix(".png"))


def plot(medians: dict, runs: dict, path: Path) -> None:
    """Encoder busy seconds per setup, each run a dot and the median a bar (Pillow)."""
    from PIL import Image, ImageDraw

    w, h, pad = 420, 300, 50
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 5), "Encoder busy seconds, 30% repeated prompts (sim:flux-h200, 2 encoders)", fill="black")
    top = max(r["encoder_busy_s"] for rs in runs.values() for r in rs) or 1
    bar = (w - 2 * pad) / len(medians)
    for k, (name, m) in enumerate(medians.items()):
        left = pad + k * bar + 20
        bh = (h - 100) * m["encoder_busy_s"] / top
        d.rectangle([left, h - 40 - bh, left + bar - 40, h - 40], fill=["#999999", "#2ca02c"][k % 2])
        d.text((left, h - 55 - bh), f"{m['encoder_busy_s']:.2f} s", fill="black")
        d.text((left, h - 35), name, fill="black")
        for r in runs[name]:
            y = h - 40 - (h - 100) * r["encoder_busy_s"] / top
            d.ellipse([left + bar / 2 - 23, y - 3, left + bar / 2 - 17, y + 3], outline="black")
    d.line([pad, h - 40, w - pad, h - 40], fill="black")
    img.save(path)


if __name__ == "__main__":
    main()
