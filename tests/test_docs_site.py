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


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs' toc make it (lower case, punctuation dropped, spaces to hyphens)."""
    import re

    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_no_internal_link_of_the_readme_benchmarks_or_docs_is_broken():
    """Every relative link and image of README.md, BENCHMARKS.md and docs/ names a file that is there, and every
    #anchor a heading of the page it points into."""
    import re

    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
    anchors = {}

    def anchors_of(path):
        if path not in anchors:
            text = path.read_text()
            anchors[path] = {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}
        return anchors[path]

    broken, checked = [], 0
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            link = m.group(1)
            if re.match(r"^[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            checked += 1
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors_of(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert checked >= 8 and not broken, "\n".join(broken)


def test_every_code_block_of_the_readme_is_one_a_test_runs_as_written():
    """The README's shell and Python blocks: the two commands (tests/test_launch.py runs the first on a free port;
    the second is this suite), the GPU host's (GPU lines: tests/test_docs.py checks its launch line parses and names
    a config that exists), and the HTTP examples (tests/test_demo.py runs both, taken from the README). A block
    added without a test fails here."""
    import re

    from tests.test_demo import readme_http_examples

    text = (ROOT / "README.md").read_text()
    runnable = [body for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S) if lang in ("bash", "sh", "python")]
    assert len(runnable) == 4, runnable
    first, gpu, curl, python = runnable
    assert "disagg launch --submit examples/prompts.json --out outputs" in first and "python -m pytest -q" in first
    assert "disagg launch --config configs/models/" in gpu and "hf auth login" in gpu
    assert (curl, python) == readme_http_examples()
