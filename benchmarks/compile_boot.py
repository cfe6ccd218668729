"""Boot time of a compiled denoiser: without compile, compiled with an empty inductor cache, and compiled again
with the cache the first boot left (what a restarted instance or a spare of the same deployment finds).

    python benchmarks/compile_boot.py              # 3 runs of each (~5 min on 2 cores)

Setup: the tiny model, 1 encoder, 1 denoiser, 1 decoder on the CPU; compile_sizes [128x128]. Boot: from the
launch to every instance ready; compile_s: the denoiser's own report (its compile and warm-up). Each run uses a
fresh cache folder for its cold boot and the same folder for its warm one. Writes
benchmarks/results/compile-boot.json and a table (stdout, .md).
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

from benchmarks.sim_suite import disagg, stop_all  # noqa: E402
from disagg.launcher.ports import free_port_pair  # noqa: E402

CONFIG = """model: tiny
compile: {compile}
compile_sizes: [128x128]
compile_cache_dir: {cache}
encoders: {{count: 1, capacity: 1}}
denoisers: {{count: 1, capacity: 1}}
decoders: {{count: 1, capacity: 1}}
"""


def boot(tmp: Path, compiled: bool, cache: Path) -> dict:
    config = tmp / "deploy.yaml"
    config.write_text(CONFIG.format(compile=str(compiled).lower(), cache=cache))
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen(disagg("launch", "--config", str(config), "--port", str(port), "--no-dashboard",
                                   "--spares", "0"), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"launch exited with {proc.returncode}")
            res = subprocess.run(disagg("status", "--endpoint", endpoint, "--json"), capture_output=True, text=True)
            if res.returncode == 0:
                instances = json.loads(res.stdout)["instances"]
                if len(instances) == 3 and all(i["state"] == "ready" for i in instances):
                    ready = time.monotonic() - t0
                    [den] = [i for i in instances if i["role"] == "denoiser"]
                    return {"boot_s": round(ready, 2), "compile_s": den["compile"]["seconds"]}
            time.sleep(0.2)
    finally:
        stop_all([proc])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile-boot.json"))
    args = ap.parse_args()
    setups = ("not compiled", "compiled, empty cache", "compiled, warm cache")
    runs: dict[str, list[dict]] = {s: [] for s in setups}
    for k in range(args.runs):
        tmp = Path(tempfile.mkdtemp(prefix="disagg-compile-bench-"))
        cache = tmp / "inductor"
        for s in setups:
            runs[s].append(boot(tmp, s != "not compiled", cache))
            print(f"run {k + 1} {s}: {runs[s][-1]}", flush=True)
    medians = {s: {key: statistics.median(r[key] for r in rs) for key in ("boot_s", "compile_s")}
               for s, rs in runs.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"setup": {"model": "tiny", "compile_sizes": ["128x128"], "runs": args.runs},
                               "medians": medians, "runs": runs}, indent=1))
    lines = ["| boot | to ready, s (median) | denoiser compile + warm-up, s | runs |", "|---|---|---|---|"]
    for s, m in medians.items():
        lines.append(f"| {s} | {m['boot_s']:.1f} | {m['compile_s']:.1f} | "
                     f"{', '.join(str(r['boot_s']) for r in runs[s])} |")
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
