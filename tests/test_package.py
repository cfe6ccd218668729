"""One import package (issue 45): a wheel built from the project installs `disagg` and nothing else at the top
level, with the files the processes read at run time (the demo's weights, the web page, the sim profiles)."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from tests.conftest import ROOT


def test_the_wheel_installs_only_the_disagg_package(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    [wheel] = tmp_path.glob("disagg-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}
    assert top == {"disagg"}, top
    assert "disagg/roles/pipelines/demo/transformer.safetensors" in names
    assert "disagg/gateway/static/index.html" in names
    assert "disagg/roles/pipelines/sim_profiles/flux-h200.yaml" in names  # sim:NAME works from a wheel
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "disagg = disagg.launcher.cli.entry:main" in zipfile.ZipFile(wheel).read(entry).decode()
