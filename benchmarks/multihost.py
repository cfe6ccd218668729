"""Throughput of one deployment spread over three network-namespace hosts against the same instance counts
on one host (`sim:flux-h200`, 1:6:1). Needs root (network namespaces).

    python benchmarks/multihost.py --runs 3 --out benchmarks/results/multihost-cpu.json
    python benchmarks/multihost.py --transfer --out benchmarks/results/multihost-transfer-cpu.json

One host: `disagg launch --model sim:flux-h200 -e 1 -d 6 -k 1` in one namespace host. Three hosts: the
head (orchestrator, encoder, decoder) on host 0 and `--join` with 3 denoisers on each of hosts 1 and 2, so
every latent crosses a veth link over Mooncake TCP. Besides throughput it keeps the mean pull time per
stage (the bench's `transfer_s_mean`: Run received to inputs copied): the cross-host handoff at this size. Each is loaded from the root namespace with `disagg
bench --concurrency 32 --num-requests 400 --width 1024 --height 1024 --steps 4`; the runs alternate.
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

from disagg.client import Client, Unreachable  # noqa: E402
from disagg.launcher.ports import free_port_pair  # noqa: E402
from tests import netns  # noqa: E402

MODEL = ["--model", "sim:flux-h200", "--capacity", "1,1,1", "--spares", "0"]
BENCH = ["--concurrency", "32", "--num-requests", "400", "--warmup", "2", "--width", "1024", "--height", "1024",
         "--steps", "4", "--json"]


def wait_ready(endpoint: str, n: int) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with Client(endpoint) as client:
                if sum(i.state == "ready" for i in client.status(timeout_s=2).instances) >= n:
                    return
        except (Unreachable, RuntimeError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{endpoint}: not {n} instances ready in 180 s")


def one(layout: str, tmp: Path) -> dict:
    hosts = netns.Hosts(3 if layout == "3 hosts" else 1)
    try:
        port = free_port_pair()
        head = f"tcp://{hosts.addr(0)}:{port}"
        common = ["--host", "0.0.0.0", "--advertise-host", hosts.addr(0), "--port", str(port), *MODEL]
        if layout == "3 hosts":
            hosts.launch(0, [*common, "-e", "1", "-d", "0", "-k", "1", "--run-dir", str(tmp / "h0")], tmp / "h0.log")
            wait_ready(head, 2)
            for i in (1, 2):
                hosts.launch(i, ["--join", head, "-e", "0", "-d", "3", "-k", "0", *MODEL, "--run-dir", str(tmp / f"h{i}")],
                             tmp / f"h{i}.log")
        else:
            hosts.launch(0, [*common, "-e", "1", "-d", "6", "-k", "1", "--run-dir", str(tmp / "h0")], tmp / "h0.log")
        wait_ready(head, 8)
        res = subprocess.run([sys.executable, "-m", "disagg", "bench", "--endpoint", head, *BENCH], capture_output=True,
                             text=True, cwd=ROOT, timeout=600)
        if res.returncode:
            raise SystemExit(f"bench failed: {res.stdout[-2000:]} {res.stderr[-2000:]}")
        report = json.loads(res.stdout)
        with Client(head) as client:
            pairs = client.status().transfers
        report["engines"] = sorted({f"{t.source}->{t.target}:{t.engine}" for t in pairs})
        return report
    finally:
        hosts.close()


def transfer_by_size(cross: bool, tmp: Path, repeats: int) -> dict[int, float]:
    """Median µs of the denoiser's pull (Run received -> inputs in its own pool, as `disagg bench transfer`
    measures it), by size, with the compute-free `payload` model: the encoder on host 0 stages N bytes,
    the denoiser on host 0 (shm) or, `cross`, on host 1 (Mooncake TCP over the veth link)."""
    from disagg.launcher.bench.transfer import SIZES, shape_for
    from disagg.transport.wire.messages import GenerationParams

    hosts = netns.Hosts(2 if cross else 1)
    try:
        port = free_port_pair()
        head = f"tcp://{hosts.addr(0)}:{port}"
        model = ["--model", "payload", "--spares", "0"]
        hosts.launch(0, ["--host", "0.0.0.0", "--advertise-host", hosts.addr(0), "--port", str(port), *model, "-e", "1",
                         "-d", "0" if cross else "1", "-k", "1", "--run-dir", str(tmp / "h0")], tmp / "h0.log")
        if cross:
            wait_ready(head, 2)
            hosts.launch(1, ["--join", head, "-e", "0", "-d", "1", "-k", "0", *model, "--run-dir", str(tmp / "h1")],
                         tmp / "h1.log")
        wait_ready(head, 3)
        out = {}
        with Client(head) as client:
            for n in SIZES:
                height, width = shape_for(n)
                params = [GenerationParams(prompt="x", width=width, height=height, seed=k) for k in range(repeats + 2)]
                outcomes = client.run_all(params, concurrency=1)
                pulls = [o.timings["fetch_denoiser"] for o in outcomes[2:] if o.ok and "fetch_denoiser" in o.timings]
                out[n] = round(statistics.median(pulls) * 1e6, 1) if pulls else None
        return out
    finally:
        hosts.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--transfer", action="store_true",
                    help="instead: the denoiser's pull by size, same host (shm) against another host (mooncake)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    why = netns.available()
    if why:
        raise SystemExit(why)
    if args.transfer:
        table = {}
        for name, cross in (("same host (shm)", False), ("other host (mooncake tcp)", True)):
            with tempfile.TemporaryDirectory(prefix="disagg-mh-") as tmp:
                table[name] = transfer_by_size(cross, Path(tmp), args.repeats)
            print(f"{name}: " + ", ".join(f"{n // 1024} KiB {us} µs" for n, us in table[name].items()), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
        return 0
    results: dict[str, list] = {"1 host": [], "3 hosts": []}
    for _ in range(args.runs):
        for layout in results:
            with tempfile.TemporaryDirectory(prefix="disagg-mh-") as tmp:
                r = one(layout, Path(tmp))
            tput = r.get("throughput_rps") or r.get("throughput")
            fetch = {role: v["transfer_s_mean"] for role, v in r.get("stages", {}).items() if v.get("transfer_s_mean")}
            results[layout].append({"throughput_rps": tput, "engines": r["engines"], "failures": r.get("failures", 0),
                                    "fetch_s": fetch})
            print(f"{layout}: {tput} req/s ({', '.join(r['engines'])}); mean pull times {fetch}", flush=True)
    med = {k: statistics.median(x["throughput_rps"] for x in v) for k, v in results.items()}
    print(f"medians: {med}; 3 hosts / 1 host = {med['3 hosts'] / med['1 host']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": results, "medians": med}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
