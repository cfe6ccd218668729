"""LoRA adapter affinity on `sim`: cold loads, p95 and the busiest denoiser's share, per load rule, in one run.

    python benchmarks/lora_affinity.py                    # 3 runs of every setup (~25 min on 2 cores)
    python benchmarks/lora_affinity.py --runs 1 --num-requests 120
    python benchmarks/lora_affinity.py --warm-requests 200 --only "no adapters,off,on (strict),cost,off + host,on + host,cost + host"

The issue's setup: 4 denoisers, each on its own simulated device with 4 adapter slots; 32 adapters drawn with
Zipf 1.1; 800 ms per load; Flux.1 at 1024^2, 4 steps (sim:flux-h200's 680 ms per request), at a Poisson rate
that keeps the denoisers about 70% busy. Setups, each a fresh deployment: no adapters; --lora-affinity off;
on (a holder whenever one is free, a busy holder waited for at most a load's time); cost (the earliest expected
finish, a load and an eviction counted); slack (a holder unless another has more than one free slot more);
two-choices (the freer of two holders drawn at random); and off, on and cost with a host-memory tier
(`--lora-host-slots 16`, `--host-slots`: an adapter unloaded from a device waits in host memory, and comes back in
RESTORE_MS instead of a load). `--warm-requests N` runs N requests of the same load first, unmeasured, so that the
measured ones meet the adapters a deployment serving a while holds. Run k measures `disagg bench --seed k`: every
setup of a run meets the same arrival times (the adapters are drawn apart), each run another draw; "p95 vs no
adapters" divides the medians, "same run's" is the median of each run's p95 over that run's without adapters.
Writes benchmarks/results/lora-affinity.json (`--out`), a table (stdout, .md) and a plot (.png).
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
from disagg.launcher.ports import free_port_pair  # noqa: E402
from disagg.roles.pipelines.sim_profile import PROFILE_DIR  # noqa: E402

#: a restore from host memory (loras.host_slots): a Flux adapter of ~100 MiB over PCIe at ~10 GB/s, plus moving
#: its ~1,000 LoRA tensors one by one (diffusers' set_lora_device); an estimate, not measured on a GPU here
RESTORE_MS = 50
PROFILE = ((PROFILE_DIR / "flux-h200.yaml").read_text()
           + f"\nlora: {{load_ms: 800, slots: 4, restore_ms: {RESTORE_MS}}}\n")
#: host-memory slots per denoiser in the "+ host" setups (--host-slots): 4 + 16 = 20 adapters an instance keeps,
#: 80 in all, so the 32 adapters fit about twice over; a Flux adapter of ~100 MiB makes it ~1.6 GiB of host memory
#: per instance. 8 (12 kept each, 48 in all) keeps the adapters only where the instances keep different ones, and
#: cold loads stay too many for the p95 target (BENCHMARKS.md); 32 each would let every instance keep every
#: adapter, and loads would stop after each one's first, whatever the rule
HOST_SLOTS = 16
#: every role on its own simulated device, so a denoiser's requests take turns as on a GPU
CONFIG = """model: sim:{profile}
encoders: {{count: 1, capacity: 4, gpus: [4]}}
denoisers: {{count: 4, capacity: {capacity}, gpus: [0, 1, 2, 3]}}
decoders: {{count: 1, capacity: 4, gpus: [5]}}
"""
SETUPS = {"no adapters": [], "off": ["--lora-affinity", "off"], "on (strict)": ["--lora-affinity", "on"],
          "cost": ["--lora-affinity", "cost"], "slack": ["--lora-affinity", "slack"],
          "two-choices": ["--lora-affinity", "two-choices"], "off + host": ["--lora-affinity", "off"],
          "on + host": ["--lora-affinity", "on"], "cost + host": ["--lora-affinity", "cost"]}  # and --lora-host-slots
REQUEST_S = 0.68  # 4 steps x 170 ms at 1024^2 on sim:flux-h200
#: the warm-up's seed is this plus the run's (run k measures `disagg bench --seed k`: the same arrival times in every
#: setup of that run, adapters or not, and another draw in each run)
WARM_SEED = 1000


def hosted(setup: str) -> list[str]:
    """The host-memory tier's flag, for a "+ host" setup."""
    return ["--lora-host-slots", str(HOST_SLOTS)] if setup.endswith("+ host") else []


def run_once(name: str, config: Path, rate: float, n: int, adapters: int, zipf: float, extra: tuple = (),
             warm: int = 0, seed: int = 0) -> dict:
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(disagg("launch", "--config", str(config), "--port", str(port), "--no-dashboard",
                                   "--spares", "0", *SETUPS[name], *hosted(name), *extra), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_ready(endpoint, proc)
        load = ["--request-rate", f"{rate:g}", "--width", "1024", "--height", "1024", "--steps", "4", "--json",
                *(["--loras", str(adapters), "--lora-zipf", f"{zipf:g}"] if name != "no adapters" else [])]
        if warm:  # the same load, another draw, not measured: adapters loaded as a deployment serving a while has
            res = subprocess.run(disagg("bench", "--endpoint", endpoint, "--num-requests", str(warm), "--warmup", "1",
                                        "--seed", str(WARM_SEED + seed), *load), capture_output=True, text=True, timeout=1800, check=False)
            if res.returncode not in (0, 1):
                raise SystemExit(f"warm-up bench failed: {res.stderr[-2000:]}")
        cmd = disagg("bench", "--endpoint", endpoint, "--num-requests", str(n), "--warmup", "2", "--seed", str(seed), *load)
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if res.returncode not in (0, 1):
            raise SystemExit(f"bench failed: {res.stderr[-2000:]}")
        doc = json.loads(res.stdout)
    finally:
        stop_all([proc])
    util = [i["utilization"] for i in doc["instances"] if i["role"] == "denoiser"]
    lora = doc.get("lora", {})
    return {"p50_s": doc["latency_s"]["p50"], "p95_s": doc["latency_s"]["p95"], "failed": doc["failed"],
            "denoiser_utilization": round(statistics.fmean(util), 3), "cold_loads": lora.get("cold_loads", 0),
            "restores": lora.get("restores", 0),
            "hit_rate": lora.get("hit_rate", 0.0), "max_share": lora.get("max_share", 0.0),
            "stages": doc.get("stages", {}),
            "command": " ".join(cmd[2:])}


def main() -> None:
    global HOST_SLOTS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--busy", type=float, default=0.7, help="target denoiser utilization (sets the request rate)")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--capacity", type=int, default=4, help="requests each denoiser holds (computing one, the rest "
                    "waiting their turn while their adapters load)")
    ap.add_argument("--only", help="comma-separated setups")
    ap.add_argument("--warm-requests", type=int, default=0, help="before each measured run, this many requests of "
                    "the same load (another draw), not measured: the adapters a deployment serving a while holds, in "
                    "device and host memory")
    ap.add_argument("--launch-arg", action="append", default=[], help="an argument for every setup's `disagg launch` "
                    "(repeat it: --launch-arg=--schedule --launch-arg=slo)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lora-affinity.json"))
    ap.add_argument("--host-slots", type=int, default=HOST_SLOTS, help="host-memory slots per denoiser in the "
                    "+ host setups")
    args = ap.parse_args()
    HOST_SLOTS = args.host_slots
    setups = [s for s in SETUPS if not args.only or s in args.only.split(",")]
    rate = round(args.busy * 4 / REQUEST_S, 2)
    tmp = Path(tempfile.mkdtemp(prefix="disagg-lora-bench-"))
    (tmp / "profile.yaml").write_text(PROFILE)
    config = tmp / "deploy.yaml"
    config.write_text(CONFIG.format(profile=tmp / "profile.yaml", capacity=args.capacity))
    runs: dict[str, list[dict]] = {s: [] for s in setups}
    for k in range(args.runs):  # setups interleaved, so a slow minute of the machine hits all of them
        for s in setups:
            runs[s].append(run_once(s, config, rate, args.num_requests, args.adapters, args.zipf, tuple(args.launch_arg),
                                    args.warm_requests, seed=k))
            print(f"run {k + 1} {s}: {runs[s][-1]}", flush=True)
    keys = ("p50_s", "p95_s", "cold_loads", "restores", "hit_rate", "max_share", "denoiser_utilization", "failed")
    medians = {s: {key: statistics.median(r[key] for r in runs[s]) for key in keys} for s in setups}
    base_p95 = medians.get("no adapters", {}).get("p95_s")
    off_loads = medians.get("off", {}).get("cold_loads")
    for s, m in medians.items():
        m["p95_vs_no_adapters"] = round(m["p95_s"] / base_p95, 3) if base_p95 else None
        if "no adapters" in runs:  # run k's against run k's without adapters: the same arrival times
            for r, bare in zip(runs[s], runs["no adapters"]):
                r["p95_vs_no_adapters"] = round(r["p95_s"] / bare["p95_s"], 3)
            m["p95_vs_no_adapters_per_run"] = statistics.median(r["p95_vs_no_adapters"] for r in runs[s])
        m["cold_loads_vs_off"] = round(m["cold_loads"] / off_loads, 3) if off_loads else None
    doc = {"setup": {"denoisers": 4, "capacity": args.capacity, "slots": 4, "adapters": args.adapters, "zipf": args.zipf, "load_ms": 800,
                     "host_slots (+ host setups)": HOST_SLOTS, "restore_ms": RESTORE_MS, "warm_requests": args.warm_requests,
                     "request_rate": rate, "num_requests": args.num_requests, "runs": args.runs,
                     "profile": "sim:flux-h200 at 1024x1024, 4 steps"},
           "medians": medians, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    lines = ["| setup | cold loads | vs off | restores | hit rate | p50 s | p95 s | p95 vs no adapters | same run's | busiest share | denoisers busy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, m in medians.items():
        lines.append(f"| {s} | {m['cold_loads']:g} | {m['cold_loads_vs_off'] if m['cold_loads_vs_off'] is not None else '-'} "
                     f"| {m['restores']:g} "
                     f"| {m['hit_rate']:.1%} | {m['p50_s']:.3f} | {m['p95_s']:.3f} | {m['p95_vs_no_adapters']} "
                     f"| {m.get('p95_vs_no_adapters_per_run', '-')} "
                     f"| {m['max_share']:.2f} | {m['denoiser_utilization']:.0%} |")
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    plot(medians, out.with_suffix(".png"))


def plot(medians: dict, path: Path) -> None:
    """Three bar charts side by side (cold loads, p95, busiest share), drawn with Pillow."""
    from PIL import Image, ImageDraw

    names = list(medians)
    colors = ["#999999", "#d62728", "#2ca02c", "#ff7f0e", "#1f77b4", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    panels = (("cold_loads", "cold adapter loads"), ("p95_s", "p95 latency (s)"), ("max_share", "busiest / mean share"))
    w, h, pad = 380, 300, 40
    img = Image.new("RGB", (w * len(panels), h + 30), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 5), "LoRA affinity (sim: 4 denoisers x 4 slots, 32 adapters Zipf 1.1, 800 ms loads, ~70% busy; "
           f"+ host: {HOST_SLOTS} host slots, {RESTORE_MS} ms restores)",
           fill="black")
    for k, (key, title) in enumerate(panels):
        x0 = k * w
        top = max(medians[n][key] for n in names) or 1
        d.text((x0 + pad, 25), title, fill="black")
        bar = (w - 2 * pad) / len(names)
        for m, n in enumerate(names):
            v = medians[n][key]
            bh = (h - 100) * v / top
            left = x0 + pad + m * bar + 4
            d.rectangle([left, h - 40 - bh, left + bar - 8, h - 40], fill=colors[m % len(colors)])
            d.text((left, h - 55 - bh), f"{v:.3g}", fill="black")
            d.text((left, h - 35 + (m % 2) * 12), n[:12], fill="black")
        d.line([x0 + pad, h - 40, x0 + w - pad, h - 40], fill="black")
    img.save(path)


if __name__ == "__main__":
    main()
