"""Ctrl-C in the launcher's first second (issue 44, D2): a quiet exit, status 130, at most "interrupted".

The child holds itself at a chosen point on purpose: an import hook blocks the import of MODULE (with a marker file
written as it starts blocking) until a signal comes, so the SIGINT lands there every time, not by timing."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT, free_port_pair, wait_until

#: run as the child: `python -c HOLD MARKER MODULE ARGS...` is `python -m disagg ARGS...`, held at MODULE's import
HOLD = """
import importlib.abc, runpy, signal, sys
marker, module = sys.argv[1], sys.argv[2]
class Hold(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == module:
            sys.meta_path.remove(self)
            open(marker, "w").close()
            while True:
                signal.pause()  # until SIGINT raises KeyboardInterrupt here, inside the import
        return None
sys.meta_path.insert(0, Hold())
sys.argv = ["disagg", *sys.argv[3:]]
runpy.run_module("disagg", run_name="__main__", alter_sys=True)
"""


def default_sigint() -> None:
    """A child with SIGINT at its default, even when the suite runs where it is ignored (nohup, `&`)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("module", [
    "disagg.launcher.bench.cli",  # the CLI's own imports, before click runs
    "disagg.launcher.run",  # inside `launch`, before any process is started
])
def test_ctrl_c_in_the_first_second_exits_quietly_with_130(tmp_path, module):
    marker = tmp_path / "held"
    args = ["launch", "--model", "payload", "--no-dashboard", "--port", str(free_port_pair()),
            "--run-dir", str(tmp_path / "run")]
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(marker), module, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        wait_until(lambda: marker.exists() or proc.poll() is not None, timeout=60, step=0.02)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "Aborted" not in err, err
    assert err.strip() in ("", "interrupted") and out.strip() == "", (out, err)
    assert not (tmp_path / "run").exists()  # nothing was started
