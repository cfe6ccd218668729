"""`disagg bench transfer`: the stage handoff per engine, measured through real role processes.

For each engine a deployment of the compute-free `payload` model starts (orchestrator, encoder,
denoiser, decoder as real processes, forced to that engine); the encoder stages N bytes and the
denoiser pulls them. `median_us` is the consumer's time from receiving `Run` to the tensors being
usable in its own pool; `hop_median_us` is the orchestrator's time from the producer's `Staged`
to the consumer's `Fetched`, i.e. including both control messages (its deployments forward no Run: every hop
goes through the orchestrator). Both are compared with an
in-process memcpy of the same size, measured in the same run.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from disagg.client import Client
from disagg.launcher.deployment import Deployment
from disagg.launcher.ports import free_port_pair
from disagg.settings import RolePool, Settings
from disagg.settings.choices import Transfer
from disagg.settings.sections import ForwardSettings

SIZES = (16 * 1024, 512 * 1024, 4 * 1024**2, 10 * 1024**2, 30 * 1024**2)
WIDTHS = (4096, 2048, 1024, 512, 256, 128, 64, 32, 16)


def shape_for(nbytes: int) -> tuple[int, int]:
    """(height, width) of the payload model's float32 tensor of exactly `nbytes`."""
    if nbytes % 1024:
        raise ValueError(f"payload sizes must be multiples of 1024 bytes, got {nbytes}")
    elems = nbytes // 4
    for width in WIDTHS:
        if elems % width == 0 and (elems // width) % 16 == 0 and elems // width <= 8192:
            return elems // width, width
    raise ValueError(f"no width/height (multiples of 16, at most 8192) holds exactly {nbytes} bytes")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


#: bytes the memcpy baseline cycles through, so its copies miss the cache as a handoff's do
COLD_SPAN_BYTES = 256 * 1024**2


def memcpy_baseline(sizes, repeats: int) -> dict[int, dict[str, float]]:
    """Median µs of in-process copies between pre-faulted buffers, per size.

    `median_us`: each copy between buffers that are not in the cache (rotating over
    COLD_SPAN_BYTES), as a handoff moves bytes another core just wrote; `hot_median_us`: the
    same copy repeated on one cache-resident pair, the best case the hardware allows.
    """
    out = {}
    for n in sizes:
        pairs = [(np.ones(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)) for _ in range(max(2, COLD_SPAN_BYTES // (2 * n)))]
        cold, hot = [], []
        for i in range(max(repeats, 9)):
            src, dst = pairs[i % len(pairs)]
            t0 = time.perf_counter()
            np.copyto(dst, src)
            cold.append(time.perf_counter() - t0)
        src, dst = pairs[0]
        for _ in range(max(repeats, 9)):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            hot.append(time.perf_counter() - t0)
        out[n] = {"median_us": round(statistics.median(cold) * 1e6, 1), "hot_median_us": round(statistics.median(hot) * 1e6, 1)}
        del pairs
    return out


def bench_engine(engine: str, sizes, repeats: int, warmup: int, gpus: list[int], log) -> dict[int, dict[str, float]]:
    pool_mib = 2 * max(sizes) // 1024**2 + 16
    config = Settings(
        # shm moves host pools: beside GPU engines it is the host-memory baseline, on the CPU
        model="payload", port=free_port_pair(), transfer=Transfer(engine), gpus=[] if engine == Transfer.SHM else gpus,
        encoders=RolePool(count=1, pool_mib=pool_mib), denoisers=RolePool(count=1, pool_mib=pool_mib),
        decoders=RolePool(count=1),
        # every hop through the orchestrator, as hop_median_us says: a stage that forwards its Run
        # (disagg/orchestrator/forwards.py) starts its consumer before the orchestrator hears of its Staged
        forward=ForwardSettings(max_wait_ms=0),
    )
    run_dir = Path(tempfile.mkdtemp(prefix=f"disagg-bench-{engine}-"))
    dep = Deployment(config, run_dir)
    results: dict[int, dict[str, float]] = {}
    ok = False
    try:
        dep.start()
        with Client(dep.endpoint) as client:
            from disagg.transport.wire.messages import GenerationParams

            for n in sizes:
                h, w = shape_for(n)
                params = [GenerationParams(prompt="payload", width=w, height=h, seed=i) for i in range(warmup + repeats)]
                outcomes = client.run_all(params, concurrency=1)
                failed = [o.error for o in outcomes if not o.ok]
                if failed:
                    raise RuntimeError(f"{engine}, {n} bytes: {failed[0]}")
                measured = outcomes[warmup:]
                fetch = [o.timings["fetch_denoiser"] * 1e6 for o in measured]
                hop = [o.timings["handoff_denoiser"] * 1e6 for o in measured]
                med = statistics.median(fetch)
                results[n] = {
                    "median_us": round(med, 1),
                    "p99_us": round(percentile(fetch, 0.99), 1),
                    "gbps": round(n / med / 1e3, 3),
                    "hop_median_us": round(statistics.median(hop), 1),
                }
                log(f"{engine:>8} {n:>10} B  {med:9.1f} µs")
        ok = True
    finally:
        dep.shutdown()
        if ok:  # its logs are kept only when they explain a failure
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            log(f"logs of the failed {engine} run: {run_dir}/logs")
    return results


def run_bench(engines: list[str], sizes, repeats: int, warmup: int, gpus: list[int], console: Console, quiet: bool) -> dict:
    log = (lambda _msg: None) if quiet else (lambda msg: console.print(msg, style="dim"))
    memcpy = memcpy_baseline(sizes, repeats)
    doc = {"memcpy": {str(n): m for n, m in memcpy.items()}, "engines": {}}
    for engine in engines:
        doc["engines"][engine] = {str(n): r for n, r in bench_engine(engine, sizes, repeats, warmup, gpus, log).items()}
    return doc


def bench_table(doc: dict) -> Table:
    table = Table(title="stage handoff: consumer receives Run -> tensors usable in its pool (median of runs)")
    table.add_column("bytes", justify="right")
    table.add_column("memcpy µs", justify="right")
    table.add_column("memcpy hot µs", justify="right")
    for engine in doc["engines"]:
        for col in ("µs", "p99 µs", "GB/s", "× memcpy", "hop µs"):
            table.add_column(f"{engine} {col}", justify="right", no_wrap=True)
    for size, base in doc["memcpy"].items():
        row = [f"{int(size):,}", f"{base['median_us']:.1f}", f"{base['hot_median_us']:.1f}"]
        for engine, per_size in doc["engines"].items():
            r = per_size[size]
            row += [f"{r['median_us']:.1f}", f"{r['p99_us']:.1f}", f"{r['gbps']:.2f}",
                    f"{r['median_us'] / max(base['median_us'], 1e-3):.2f}", f"{r['hop_median_us']:.1f}"]
        table.add_row(*row)
    return table
