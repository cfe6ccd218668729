"""`disagg bench transfer` end to end, small: the JSON shape and that the numbers are measured."""

import json
import os

import pytest

from disagg.launcher.bench.transfer import shape_for
from tests.conftest import disagg

pytestmark = pytest.mark.e2e


def test_shapes_hold_exact_sizes():
    for n in (16 * 1024, 512 * 1024, 4 * 1024**2, 10 * 1024**2, 30 * 1024**2):
        h, w = shape_for(n)
        assert h * w * 4 == n and h % 16 == 0 and w % 16 == 0 and max(h, w) <= 8192
    with pytest.raises(ValueError):
        shape_for(1000)


def test_bench_transfer_json(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    res = disagg("bench", "transfer", "--engines", "shm,inline", "--sizes", "16384,1048576", "--repeats", "3",
                 "--warmup", "1", "--json", timeout=240, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not list(tmp_path.glob("disagg-bench-*"))  # its run folder is gone
    doc = json.loads(res.stdout)
    assert set(doc["memcpy"]) == {"16384", "1048576"} and doc["memcpy"]["16384"]["median_us"] > 0
    for engine in ("shm", "inline"):
        for size in ("16384", "1048576"):
            r = doc["engines"][engine][size]
            assert 0 < r["median_us"] <= r["p99_us"] and r["gbps"] > 0 and r["hop_median_us"] >= r["median_us"]


def test_bench_transfer_rejects_bad_sizes():
    res = disagg("bench", "transfer", "--sizes", "1000", timeout=30)
    assert res.returncode == 2 and "multiples of 1024" in res.stderr
