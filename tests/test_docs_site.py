"""The docs site (issue 48): its reference pages are what the code makes (disagg/docs_site.py), a change to the
code without them fails the check, and mkdocs builds the site with warnings as errors (broken links, pages
missing from the nav)."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.conftest import ROOT


def test_the_reference_pages_are_what_the_code_makes():
    from disagg.docs_site import problems

    found = problems()
    assert not found, "\n".join(found)


def test_a_settings_help_changed_in_a_scratch_copy_fails_the_check(tmp_path):
    shutil.copytree(ROOT / "disagg", tmp_path / "disagg", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    schema = tmp_path / "disagg" / "settings" / "schema.py"
    text = schema.read_text()
    old = "three stages in one process (capacity from denoisers, devices from gpus)."
    assert old in text
    schema.write_text(text.replace(old, "three stages in one process, said otherwise."))
    res = subprocess.run([sys.executable, "-m", "disagg.docs_site"], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "docs/reference/settings.md is out of date" in res.stdout and "said otherwise" in res.stdout
    # and the untouched copy passes: the check fails for the change, not for the copy
    schema.write_text(text)
    res = subprocess.run([sys.executable, "-m", "disagg.docs_site"], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "reference" / "settings" / "index.html").exists()
