"""The GPU machine's image as benchmarks/gpu_check.sh sees it: what it holds, what is carried to it, and checks.

    python benchmarks/gpu_image.py venv [DEST]        # an image-like venv for the CPU dry run (prints its bin/)
    python benchmarks/gpu_image.py wheels [--install SITE] [--dry-run]   # .whl/ against gpu_wheels.txt
    python benchmarks/gpu_image.py imports            # import what the steps import, encode an MP4
    python benchmarks/gpu_image.py env [--dry-run] [--json FILE]         # the versions the code needs

The image's distributions are listed in benchmarks/gpu_image.txt (from the device tool's KINDS.md), the carried
wheels in benchmarks/gpu_wheels.txt. The CPU dry run runs in a venv (`venv`) whose only site-packages entry is a
folder of links to this interpreter's site-packages, minus every distribution that is neither in the image nor
carried: an import the image could not do fails there too, so a missing wheel fails on the CPU, not on the GPU.
That venv runs the carried packages from this interpreter's copies (the dry run's Python cannot import the
image's cp312 wheels); `wheels --dry-run` installs those wheels as Python 3.12 would, into a scratch folder.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
IMAGE_LIST = HERE / "gpu_image.txt"
#: GPU_CHECK_WHEEL_LIST: another list (a test's, one lacking a wheel)
WHEEL_LIST = Path(os.environ.get("GPU_CHECK_WHEEL_LIST") or HERE / "gpu_wheels.txt")
WHEELS = ROOT / ".whl"
#: what travels to the device (the working tree with the wheels) at most, and the margin the wheels must leave
CARRY_LIMIT = 64 << 20
CARRY_MARGIN = 4 << 20
#: the image's Python (KINDS.md): the wheels are chosen for it, and requirement markers read as it would
IMAGE_PYTHON = "3.12"
#: our own top-level packages (the repository root is on PYTHONPATH)
OURS = {"disagg", "benchmarks", "tests"}
#: what the steps import (the install step imports each: a wheel missing on the GPU fails there, in seconds)
STEP_IMPORTS = (
    "torch", "numpy", "PIL", "zmq", "msgspec", "yaml", "click", "rich", "psutil", "setproctitle", "packaging",
    "safetensors", "huggingface_hub", "transformers", "diffusers", "importlib_metadata", "imageio", "imageio.v3",
    "imageio_ffmpeg", "pytest", "pytest_timeout",
    "disagg.launcher.cli.main", "disagg.orchestrator.__main__", "disagg.roles.__main__", "disagg.roles.forks",
    "disagg.roles.worker", "disagg.roles.extensions.compile", "disagg.roles.media", "disagg.roles.pipelines.tiny",
    "disagg.roles.pipelines.flux", "disagg.roles.pipelines.wan", "disagg.roles.pipelines.payload",
    "disagg.roles.pipelines.random_weights", "disagg.roles.pipelines.checkpoint", "disagg.transport.data.cuda_ipc",
    "disagg.client",
    "benchmarks.gpu_e2e", "benchmarks.gpu_models", "tests.checkpoints", "tests.ckpt_wan",
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> dict[str, str]:
    """A list of `name` or `name==version` lines (# comments): normalized name -> version ('' when not given)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[normalize(name)] = version.strip()
    return out


def _entries(dist: md.Distribution) -> set[str]:
    """The names a distribution puts at the top of its site-packages folder (packages, modules, its metadata)."""
    out = set()
    meta = getattr(dist, "_path", None)
    if meta is not None:
        out.add(Path(meta).name)
    files = dist.files
    if files is None:  # no RECORD: its top_level.txt
        return out | set((dist.read_text("top_level.txt") or "").split())
    for f in files:
        if f.parts and f.parts[0] not in ("..", "__pycache__"):
            out.add(f.parts[0])
    return out


def image_view(site: Path, dest: Path, allowed: set[str]) -> list[str]:
    """Fill `dest` with links to the entries of `site` that a distribution outside `allowed` does not own alone,
    and no .pth files (their code is the host's, not the image's). Returns the hidden distributions."""
    keep, drop, hidden = set(), set(), []
    for dist in md.distributions(path=[str(site)]):
        name = normalize(dist.metadata["Name"] or "")
        (keep if name in allowed else drop).update(_entries(dist))
        if name not in allowed:
            hidden.append(name)
    dest.mkdir(parents=True, exist_ok=True)
    for entry in site.iterdir():
        if entry.name in drop - keep or entry.suffix == ".pth" or entry.name in OURS:
            continue
        (dest / entry.name).symlink_to(entry)
    return sorted(hidden)


def _host_needs(seeds: set[str], env: dict | None = None) -> dict[str, str]:
    """What this interpreter's copies of the `seeds` distributions require, transitively: name -> who needs it."""
    from packaging.requirements import Requirement

    host = {normalize(d.metadata["Name"] or ""): d for d in md.distributions()}
    needs, todo = {}, [n for n in seeds if n in host]
    while todo:
        who = todo.pop()
        for line in host[who].requires or []:
            req = Requirement(line)
            name = normalize(req.name)
            if (req.marker is None or req.marker.evaluate({"extra": ""})) and name not in seeds | set(needs):
                needs[name] = who
                if name in host:
                    todo.append(name)
    return needs


def _host_sites() -> list[Path]:
    return [Path(p) for p in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")) if Path(p).is_dir()]


def make_venv(dest: Path, wheel_list: Path = WHEEL_LIST) -> Path:
    """A venv (no pip of its own) that sees this interpreter's site-packages as the GPU image would: only the
    image's distributions and the carried ones, and what this machine's versions of the image's distributions
    need beside them (a newer huggingface-hub here needs httpx2: the image's own versions fit together there).
    Returns its bin folder; DEST/hidden.txt lists what it hides, DEST/host-only.txt what it lets through for that.
    Its .pth names the views relatively: the folder can be moved (renamed) whole."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    image, carried = set(read_list(IMAGE_LIST)), set(read_list(wheel_list))
    host_only = {n: who for n, who in _host_needs(image).items() if n not in carried}
    allowed = image | carried | set(host_only)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    venv_site = dest / "lib" / ver / "site-packages"
    hidden, lines = [], []
    for i, site in enumerate(_host_sites()):
        hidden += image_view(site, dest / f"image-view-{i}", allowed)
        lines.append(f"../../../image-view-{i}")  # relative to the venv's site-packages
    (venv_site / "disagg-image-view.pth").write_text("\n".join(lines) + "\n")
    (dest / "hidden.txt").write_text("\n".join(sorted(set(hidden))) + "\n")
    (dest / "host-only.txt").write_text("".join(f"{n} (this machine's {who} needs it)\n" for n, who in
                                                sorted(host_only.items())))
    return dest / "bin"


def shared_venv(wheel_list: Path = WHEEL_LIST) -> Path:
    """The image-like venv for this interpreter and these lists, made once at a path of their own and kept: the
    dry run's compiled step then finds its kernels in the inductor cache again (their key holds torch's path)."""
    import hashlib

    key = hashlib.sha256()
    for part in (sys.executable, IMAGE_LIST.read_text(), wheel_list.read_text(),
                 *(sorted(os.listdir(site)) for site in _host_sites())):
        key.update(repr(part).encode())
    dest = Path(tempfile.gettempdir()) / f"disagg-image-venv-{os.getuid()}-{key.hexdigest()[:12]}"
    if not (dest / "hidden.txt").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
        make_venv(tmp / "venv", wheel_list)
        try:
            os.rename(tmp / "venv", dest)  # atomic: a dry run beside this one made the same, or uses ours
        except OSError:
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / "bin"


def _requirements_met(dist: str) -> list[tuple[str, str]]:
    """What `dist`'s requirements (for the image's Python, no extras) lack, missing or of another version: (the
    requirement's distribution, why)."""
    from packaging.requirements import Requirement

    env = {"python_version": IMAGE_PYTHON, "python_full_version": IMAGE_PYTHON + ".0", "extra": ""}
    bad = []
    for line in md.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        bad += _unmet(req, f"{dist} needs {req}: not installed (not in the image, not carried)",
                      f"{dist} needs {req}: {{have}} is installed")
    return bad


def _unmet(req, missing: str, other: str) -> list[tuple[str, str]]:
    """[(req's distribution, why)] when it is not installed (`missing`) or its version is out of req's range
    (`other`, with {have} the installed one); [] when it is met."""
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        return [(req.name, missing)]
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        return [(req.name, other.format(have=have))]
    return []


def _wheel_requirements(there: set[str]) -> list[str]:
    """The carried wheels' requirements (their METADATA, for the image's Python) that neither the image nor .whl/
    holds."""
    from packaging.requirements import Requirement

    env = {"python_version": IMAGE_PYTHON, "python_full_version": IMAGE_PYTHON + ".0", "extra": "",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "sys_platform": "linux"}
    bad = []
    for whl in sorted(WHEELS.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = [ln.split(":", 1)[1].strip() for ln in z.read(meta).decode().splitlines()
                     if ln.startswith("Requires-Dist:")]
        for req in map(Requirement, lines):
            if (req.marker is None or req.marker.evaluate(env)) and normalize(req.name) not in there:
                bad.append(f"{whl.name} needs {req}: neither in the image (gpu_image.txt) nor carried")
    return bad


def wheels(install: str | None, dry: bool) -> int:
    """.whl/ holds exactly one wheel per line of gpu_wheels.txt, at its version, and the tree fits the carry limit;
    then (--install) they install into SITE, as the GPU's Python 3.12 would."""
    pins = read_list(WHEEL_LIST)
    found = {}
    for whl in sorted(WHEELS.glob("*.whl")):
        name, version = whl.name.split("-")[:2]
        found.setdefault(normalize(name), []).append(version)
    if not found:
        print(f"no wheels in {WHEELS} (fetch them with the command in benchmarks/gpu_check.sh's header)")
        return 0 if dry else 1
    errors = [f"{n}: {len(v)} wheels ({', '.join(v)}): keep one" for n, v in found.items() if len(v) > 1]
    errors += [f"{n}=={v}: no wheel in .whl/" for n, v in pins.items() if found.get(n, [None])[0] != v]
    errors += [f"{n}: in .whl/ but not in {WHEEL_LIST.name}" for n in found if n not in pins]
    errors += _wheel_requirements(set(read_list(IMAGE_LIST)) | set(pins))
    size = sum(w.stat().st_size for w in WHEELS.glob("*.whl"))
    try:  # what travels beside the wheels (on the GPU machine, a copy without git: not counted)
        tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                 capture_output=True).stdout.split(b"\0")
    except OSError:
        tracked = []
    tree = sum((ROOT / f.decode()).stat().st_size for f in tracked if f and (ROOT / f.decode()).is_file())
    print(f"wheels: {size / 2**20:.1f} MiB, the working tree {tree / 2**20:.1f} MiB: "
          f"{(size + tree) / 2**20:.1f} of {CARRY_LIMIT >> 20} MiB")
    if tree and size + tree > CARRY_LIMIT - CARRY_MARGIN:
        errors.append(f"the wheels and the working tree come to {(size + tree) / 2**20:.1f} MiB: over "
                      f"{(CARRY_LIMIT - CARRY_MARGIN) / 2**20:.0f} MiB (the 64 MiB that travels, less a margin)")
    if errors:
        print("\n".join(errors))
        return 1
    if install:
        as_there = ["--python-version", IMAGE_PYTHON, "--implementation", "cp", "--only-binary=:all:",
                    *(f"--platform=manylinux_2_{n}_x86_64" for n in (28, 27, 26, 17, 5)),
                    "--platform=manylinux2014_x86_64", "--platform=manylinux1_x86_64"] if dry else []
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", install, *as_there, *map(str, sorted(WHEELS.glob("*.whl")))]
        if subprocess.run(cmd).returncode:
            return 1
        print("installed into", install, ":", ", ".join(sorted(p.name for p in Path(install).iterdir()
                                                               if not p.name.endswith("-info"))))
    return 0


def imports(wheel_list: Path = WHEEL_LIST) -> int:
    """Import every module the steps import, check the carried packages' requirements, encode an MP4."""
    failed = []
    for name in STEP_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - each failure is reported by name
            failed.append(f"import {name}: {type(exc).__name__}: {exc}")
    for dist in read_list(wheel_list):
        try:
            md.version(dist)
        except md.PackageNotFoundError:
            failed.append(f"{dist}: not installed (a carried wheel: benchmarks/gpu_wheels.txt)")
            continue
        failed += [why for _, why in _requirements_met(dist)]
    if not failed:
        try:
            import imageio_ffmpeg
            import numpy as np

            from disagg.roles.media import encode_mp4

            mp4 = encode_mp4([np.zeros((16, 16, 3), np.uint8)] * 2)
            print(f"an MP4 of 2 frames: {len(mp4)} bytes (ffmpeg: {imageio_ffmpeg.get_ffmpeg_exe()})")
        except Exception as exc:  # noqa: BLE001
            failed.append(f"MP4 output (the wan step): {type(exc).__name__}: {exc}")
    print("\n".join(failed) or f"imported {len(STEP_IMPORTS)} modules; every carried package's requirements met")
    return 1 if failed else 0


def _compiler() -> str | None:
    """The C compiler triton builds its launchers with (its own search: $CC, gcc, clang), or cc."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or shutil.which("cc")


#: the distributions whose version the code depends on: one missing or too old stops the run (others only warn)
STOPPERS = {"torch", "transformers", "huggingface-hub", "tokenizers", "safetensors", "diffusers"}


def env(dry: bool, out: str | None, wheel_list: Path = WHEEL_LIST) -> int:
    """Print the versions the code needs and check them: pyproject's floors, diffusers at its pin, what diffusers
    and transformers require; on the GPU also CUDA and the carried wheels' versions. A problem with torch,
    transformers, huggingface-hub, tokenizers, safetensors, diffusers or a carried wheel fails (the run stops);
    with another distribution it is a warning (the step that uses it may fail). A C compiler is reported (the
    compiled step is skipped without one)."""
    import tomllib

    from packaging.requirements import Requirement

    pins = read_list(wheel_list)
    there = set(read_list(IMAGE_LIST)) | set(pins)
    doc, bad = {"python": platform.python_version()}, []
    for dist in ("torch", "transformers", "huggingface-hub", "tokenizers", "safetensors", "diffusers", "imageio",
                 "imageio-ffmpeg", "numpy", "pillow"):
        try:
            doc[dist] = md.version(dist)
        except md.PackageNotFoundError:
            doc[dist] = None
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for line in deps:
        req = Requirement(line)
        if normalize(req.name) not in there:
            continue  # the gateway's (fastapi, uvicorn, ...): no step needs them, and the image lacks them
        bad += _unmet(req, f"{req.name} is missing (pyproject: {req})",
                      f"{req.name} {{have}} is installed; the code needs {req} (pyproject.toml)")
    if doc["diffusers"] != pins["diffusers"]:
        bad.append(("diffusers", f"diffusers {doc['diffusers']} is installed; the GPU run pins {pins['diffusers']} "
                                 f"(the version the code was measured on; benchmarks/gpu_wheels.txt)"))
    for dist in ("diffusers", "transformers"):
        if doc[dist]:
            # a carried diffusers' needs stop the run; transformers' (the image's own) only where we use them
            bad += [(dist if dist == "diffusers" else name, why) for name, why in _requirements_met(dist)]
    if not dry:  # the carried wheels, as installed (the dry run uses this machine's copies)
        for n, v in pins.items():
            try:
                if md.version(n) != v:
                    bad.append((n, f"{n} {md.version(n)} is installed; .whl/ carries {v}"))
            except md.PackageNotFoundError:
                bad.append((n, f"{n} is not installed; .whl/ carries {v}"))
        import torch

        doc["cuda"] = torch.version.cuda
        if not torch.cuda.is_available():
            bad.append(("torch", "torch sees no CUDA device"))
        else:
            doc["device"] = torch.cuda.get_device_name(0)
    cc = _compiler()
    doc["c_compiler"] = cc
    if cc:
        first = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()
        doc["c_compiler_version"] = first[0] if first else ""
    for k, v in doc.items():
        print(f"{k:>18}: {v}")
    if not cc:
        print("no C compiler ($CC, gcc, clang or cc): triton cannot build its kernels' launchers, so the compiled "
              "step is skipped")
    fatal = [why for name, why in bad if normalize(name) in STOPPERS | set(pins)]
    print("".join(f"WARNING: {why}\n" for name, why in bad if why not in fatal), end="")
    if out:
        Path(out).write_text(json.dumps({**doc, "problems": [why for _, why in bad]}, indent=1))
    print("\n".join(fatal) or "every version the code needs is there")
    return 1 if fatal else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("venv", help="make an image-like venv at DEST (default: a kept one for these lists, made "
                       "once); prints its bin folder")
    v.add_argument("dest", type=Path, nargs="?")
    v.add_argument("--wheels", type=Path, default=WHEEL_LIST, help="the carried wheels' list (default: %(default)s)")
    w = sub.add_parser("wheels", help="check .whl/ against the list and the carry limit; --install SITE installs")
    w.add_argument("--install", default=None)
    w.add_argument("--dry-run", action="store_true")
    i = sub.add_parser("imports", help="import what the steps import, check the carried packages' requirements")
    e = sub.add_parser("env", help="print and check the versions the code needs")
    for p in (i, e):
        p.add_argument("--wheels", type=Path, default=WHEEL_LIST, help="the carried wheels' list (default: %(default)s)")
    e.add_argument("--dry-run", action="store_true")
    e.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.cmd == "venv":
        print(make_venv(args.dest, args.wheels) if args.dest else shared_venv(args.wheels))
        return 0
    if args.cmd == "wheels":
        return wheels(args.install, args.dry_run)
    if args.cmd == "imports":
        return imports(args.wheels)
    return env(args.dry_run, args.json, args.wheels)


if __name__ == "__main__":
    sys.exit(main())
