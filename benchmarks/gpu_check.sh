#!/usr/bin/env bash
# The whole GPU run, in one script: install the carried wheels, then every check of issue 15, each under
# a hard time limit, so one hang cannot eat the run. Writes OUT/gpu-h200.json (the summary) and a log
# per step into OUT.
#
#   bash benchmarks/gpu_check.sh OUT                # on the GPU machine (wheels in .whl/, see below)
#   bash benchmarks/gpu_check.sh OUT --dry-run      # on a CPU machine: the install into a scratch folder,
#                                                   # then each step's code on the CPU at toy sizes
#
# Wheels: the GPU image has torch, transformers, safetensors, psutil, rich and click but no registry.
# Fetch what it lacks, for its Python 3.12, into .whl/ (ignored by git) before the run:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pyzmq msgspec diffusers importlib_metadata
# (Mooncake's CUDA wheel is ~98 MB, over the 64 MiB that travels: the GPU run does not cover mooncake.)
#
# Budget (s): every step's limit is also cut to what is left of TOTAL_S, and a step that fails or times
# out is recorded and the next one runs.
set -u
OUT=${1:?usage: gpu_check.sh OUT [--dry-run]}
DRY=${2:-}
TOTAL_S=${TOTAL_S:-540}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
START=$(date +%s)
STEPS="$OUT/steps.jsonl"
: > "$STEPS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DISAGG_LOG_LEVEL=${DISAGG_LOG_LEVEL:-INFO}

step() {  # step NAME LIMIT_S CMD...: run CMD under a limit, log to OUT/NAME.log, record rc and seconds
  local name=$1 limit=$2; shift 2
  local left=$(( TOTAL_S - ($(date +%s) - START) ))
  (( left < limit )) && limit=$left
  if (( limit < 10 )); then
    echo "{\"step\": \"$name\", \"rc\": null, \"skipped\": \"no time left\"}" >> "$STEPS"; return
  fi
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 )), \"limit_s\": $limit, \"timed_out\": $([ $rc = 124 ] || [ $rc = 137 ] && echo true || echo false)}" >> "$STEPS"
  echo "   rc=$rc"; tail -n 3 "$OUT/$name.log"
}

SITE=/tmp/disagg-site
[ "$DRY" = --dry-run ] && SITE=$(mktemp -d /tmp/disagg-site-dry.XXXX)
do_install() {
  ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/ (see the header of this script)"; return 1; }
  du -ch .whl/*.whl | tail -1
  local as_there=()  # the dry run installs the GPU machine's Python 3.12 wheels as that Python would
  [ -n "$DRY" ] && as_there=(--python-version 3.12 --implementation cp --only-binary=:all:
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${as_there[@]}" .whl/*.whl || return 1
  # every wheel's requirements must be there already (the image has no registry)
  PYTHONPATH="$SITE" python3 - <<'PY'
import importlib.metadata as md, pathlib, re, sys, zipfile
missing = []
for whl in pathlib.Path(".whl").glob("*.whl"):
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                req = re.split(r"[ ;<>=!~(\[]", line.split(":", 1)[1].strip())[0]
                try:
                    md.version(req)
                except md.PackageNotFoundError:
                    missing.append(f"{whl.name} needs {req}")
print("\n".join(missing) or "every requirement of the wheels is installed")
import os
site = pathlib.Path(os.environ["SITE"])
absent = [m for m in ("zmq", "msgspec", "diffusers") if not (site / m / "__init__.py").is_file()]
if absent:
    sys.exit(f"not installed into {site}: {', '.join(absent)}")
if not os.environ.get("DRY"):  # the dry run's Python is not the wheels' one
    import zmq, msgspec, diffusers
    print("imports ok:", zmq.__version__, msgspec.__version__, diffusers.__version__)
else:
    print("installed into", site, ":", ", ".join(sorted(p.name for p in site.iterdir() if not p.name.endswith("-info"))))
sys.exit(1 if missing else 0)
PY
}
export SITE DRY
step install 90 bash -c "$(declare -f do_install); do_install"
[ -z "$DRY" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" = --dry-run ]; then  # the same steps' code on the CPU, at toy sizes
  # 60 s: the imports take ~4 s, but one dry run here saw them take over 20 s right after a full test run
  step env 60 python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  step pytest_gpu 60 python3 -m pytest -q -o addopts="" -m gpu --timeout 60 -p no:cacheprovider tests/test_gpu.py
  step transfer 120 python3 -m launcher bench transfer --engines shm,inline --sizes 16384,4194304 --repeats 3 --warmup 1 --json
  step parity 150 python3 benchmarks/gpu_e2e.py parity --device cpu --out "$OUT"
  step flux 150 python3 benchmarks/gpu_e2e.py flux --device cpu --size 128 --steps 2 --runs 1 --out "$OUT"
  # the video's colocated run is flux's code with another checkpoint: one layout here, both on the GPU
  step wan 150 python3 benchmarks/gpu_e2e.py wan --device cpu --size 32 --frames 9 --steps 2 --runs 1 --layouts 1:1:1 --out "$OUT"
  step compiled 150 python3 benchmarks/gpu_e2e.py compiled --device cpu --size 64 --steps 2 --runs 1 --modes compiled --model tiny --out "$OUT"
else
  step env 30 bash -c "nvidia-smi; python3 -c \"import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))\""
  step pytest_gpu 90 python3 -m pytest -q -o addopts="" -m gpu --timeout 60 -p no:cacheprovider tests/test_gpu.py
  step transfer 100 python3 -m launcher bench transfer --gpus 0 --engines cuda-ipc,shm \
    --sizes 16384,65536,262144,1048576,4194304,10485760,31457280 --repeats 20 --warmup 3 --json
  step parity 100 python3 benchmarks/gpu_e2e.py parity --device cuda:0 --out "$OUT"
  step flux 300 python3 benchmarks/gpu_e2e.py flux --device cuda:0 --size 1024 --steps 4 28 --runs 2 --out "$OUT"
  # the compiled denoiser's step time against eager (issue 27), then, if time allows (the step's limit is
  # what is left of TOTAL_S), the video
  step compiled 200 python3 benchmarks/gpu_e2e.py compiled --device cuda:0 --size 1024 --steps 28 --runs 2 --out "$OUT"
  step wan 240 python3 benchmarks/gpu_e2e.py wan --device cuda:0 --size 832 --height 480 --frames 33 --steps 4 --runs 1 --out "$OUT"
fi

python3 - "$OUT" "$DRY" <<'PY'
import json, pathlib, platform, subprocess, sys
out = pathlib.Path(sys.argv[1])
doc = {"dry_run": sys.argv[2] == "--dry-run", "machine": platform.node(), "steps": [json.loads(l) for l in (out / "steps.jsonl").read_text().splitlines() if l.strip()]}
try:
    import torch
    doc["torch"] = torch.__version__
    doc["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        doc["device"] = torch.cuda.get_device_name(0)
        doc["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as exc:  # the summary is written whatever failed
    doc["torch_error"] = repr(exc)
log = out / "transfer.log"
if log.is_file():
    text = log.read_text()
    try:
        doc["transfer"] = json.loads(text[text.index("{"):])
    except ValueError:
        pass
for name in ("parity", "flux", "wan", "compiled"):
    if (out / f"{name}.json").is_file():
        doc[name] = json.loads((out / f"{name}.json").read_text())
(out / "gpu-h200.json").write_text(json.dumps(doc, indent=1))
print(json.dumps({k: v for k, v in doc.items() if k != "transfer"}, indent=1)[:4000])
PY
