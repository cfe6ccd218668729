"""The GPU run's script, dry-run on the CPU: every step runs the code it runs on the GPU, at toy sizes."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import COMPILE_CACHE, ROOT

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(400)
def test_gpu_check_dry_run_writes_every_steps_result(tmp_path):
    out = tmp_path / "out"
    # its compiled step finds tests/test_compile.py's kernels when that ran first (tests/conftest.py COMPILE_CACHE)
    env = {**os.environ, "DISAGG_COMPILE_CACHE_DIR": str(COMPILE_CACHE)}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(out), "--dry-run"], cwd=ROOT, capture_output=True, env=env,
                          text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "gpu-h200.json").read_text())
    steps = {s["step"]: s for s in doc["steps"]}
    assert list(steps) == ["install", "env", "pytest_gpu", "transfer", "parity", "flux", "wan", "compiled"]
    if list((ROOT / ".whl").glob("*.whl")):  # wheels fetched: they install as the GPU machine would
        assert steps["install"]["rc"] == 0, (out / "install.log").read_text()
    else:
        assert "no wheels in .whl/" in (out / "install.log").read_text()
    for name in ("env", "pytest_gpu", "transfer", "parity", "flux", "wan", "compiled"):
        assert steps[name]["rc"] == 0, (out / f"{name}.log").read_text()[-3000:]
    assert set(doc["transfer"]["engines"]) == {"shm", "inline"}
    # within 1/255: a role computes with one thread, this process with several (sums in another order)
    assert len(doc["parity"]["cases"]) == 2
    assert all(c["worst_pixel_diff"] <= 1 for c in doc["parity"]["cases"].values()), doc["parity"]
    flux = doc["flux"]
    assert set(flux["layouts"]) == {"1:1:1", "colocated"}
    assert "compute_denoiser" in flux["layouts"]["1:1:1"]["2 steps"]["timings"]
    assert flux["overhead 2 steps"]["disaggregated_s"] > 0
    assert doc["wan"]["frames"] == 9 and set(doc["wan"]["layouts"]) == {"1:1:1"}  # the GPU run: both
    # the compiled step-time row (issue 27; on the GPU against eager, here the compiled deployment alone)
    assert doc["compiled"]["modes"]["compiled"]["2 steps"]["step_ms"] > 0, doc["compiled"]
