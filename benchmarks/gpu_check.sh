#!/usr/bin/env bash
# The whole GPU run, in one script: install the carried wheels, check the versions, then every GPU check (issues 15,
# 27, 44), in order of value, each under a hard time limit so one hang cannot eat the run. Writes OUT/gpu-h200.json
# (the summary), OUT/<step>.json as each result is measured, and a log per step into OUT.
#
#   bash benchmarks/gpu_check.sh OUT                # on the GPU machine (wheels in .whl/, see below)
#   bash benchmarks/gpu_check.sh OUT --dry-run      # on a CPU machine: each step's code on the CPU at toy sizes,
#                                                   # in a venv that sees only what the GPU image holds
#
# Wheels: the GPU image (the device tool's nvidia-h200: Python 3.12, torch 2.11, transformers 5.17,
# huggingface-hub 1.33, pytest with pytest-timeout and pytest-xdist, imageio, peft, psutil, rich, click, ...; the
# whole list in benchmarks/gpu_image.txt) has no registry. What the steps import that it lacks is listed in
# benchmarks/gpu_wheels.txt (diffusers==0.42.1, importlib_metadata, lazy-importer, pyzmq, msgspec, imageio-ffmpeg,
# setproctitle; ~35 MiB). Fetch them for its Python 3.12 into .whl/ (ignored by git) before the run:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
#     --platform manylinux1_x86_64 -d .whl -r benchmarks/gpu_wheels.txt
# With the device tool (its $OUT brings back 8 files at most): run carry [".whl"], timeout_s 600,
#   bash benchmarks/gpu_check.sh /tmp/gpu; cp /tmp/gpu/gpu-h200.json $OUT/; tar czf $OUT/gpu-logs.tgz -C /tmp gpu
# .whl/ is ignored by git: the device tool's `run` must name it in `carry` (with the working tree, under 64 MiB; the
# install step checks that). Mooncake's CUDA wheel is ~98 MB, over that limit: the GPU run does not cover mooncake.
#
# The install step checks .whl/ against that list, installs it, imports everything the steps import and encodes
# an MP4; the env step prints and checks the versions the code needs (pyproject's floors, diffusers at its pin, a C
# compiler for the compiled step). The script stops when either fails. Every later step's limit is also cut to
# what is left of TOTAL_S; a step that fails or times out is recorded and the next one runs. A step that times out
# is sent SIGTERM: benchmarks/gpu_e2e.py then kills its deployment, and whatever it measured is already written.
set -u
OUT=${1:?usage: gpu_check.sh OUT [--dry-run]}
DRY=${2:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
ROOT=$PWD
STEPS="$OUT/steps.jsonl"
: > "$STEPS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DISAGG_LOG_LEVEL=${DISAGG_LOG_LEVEL:-INFO}

# The plan: each step's limit in seconds, in the order they run (by value). Its sum and MARGIN_S (the steps' kill
# grace of up to 20 s, the summary) must fit TOTAL_S. GPU limits from the estimates of notes/gpu-review-2026-12-04.md (M3) for one
# H200: install+env ~15 s, pytest ~35 s, transfer ~40 s at 20 repeats (10 here), parity ~50 s, flux ~2 x (boot
# 30-40 s + 3 requests of 28 steps at ~0.23 s a step), compiled: a boot with a cold inductor compile, then 2
# requests; wan (480p, 33 frames, 4 steps, 1:1:1): a boot of UMT5-XXL's and the DiT's shapes, then 2 requests.
GPU_TOTAL_S=540 GPU_MARGIN_S=60
GPU_PLAN="install:25 env:20 pytest_gpu:40 transfer:35 parity:55 flux:130 compiled:110 wan:65"
fits() {  # fits NAME PLAN TOTAL MARGIN: print the plan; false when it does not fit
  local s sum=0; for s in $2; do sum=$(( sum + ${s#*:} )); done
  echo "$1 plan (s): ${2//:/ } = $sum of $3 (margin $(( $3 - sum )), $4 needed)"
  (( sum + $4 <= $3 )) || { echo "the $1 plan does not fit $3 s with a margin of $4 s: raise TOTAL_S or cut a step"; false; }
}
fits GPU "$GPU_PLAN" "$GPU_TOTAL_S" "$GPU_MARGIN_S" || exit 2
if [ "$DRY" = --dry-run ]; then
  # the CPU's toy steps take 2-20 s each alone; the limits leave room for a loaded machine (at a load of 4-5 on
  # 2 cores: install 20 s, parity 56 s, flux 82 s, compiled 53 s)
  TOTAL_S=${TOTAL_S:-560} MARGIN_S=30
  PLAN="install:60 env:30 pytest_gpu:40 transfer:40 parity:80 flux:110 compiled:90 wan:60"
  fits "dry run's" "$PLAN" "$TOTAL_S" "$MARGIN_S" || exit 2
else
  TOTAL_S=${TOTAL_S:-$GPU_TOTAL_S} MARGIN_S=$GPU_MARGIN_S PLAN=$GPU_PLAN
  (( TOTAL_S == GPU_TOTAL_S )) || fits GPU "$PLAN" "$TOTAL_S" "$MARGIN_S" || exit 2
fi
limit_of() { local s; for s in $PLAN; do [ "${s%%:*}" = "$1" ] && echo "${s#*:}"; done; }

SITE=/tmp/disagg-site
CLEAN=()
summarize() {
  python3 - "$OUT" "$DRY" "$PLAN" "$TOTAL_S" "$GPU_PLAN" "$GPU_TOTAL_S" "$GPU_MARGIN_S" <<'PY'
import json, pathlib, platform, subprocess, sys
out = pathlib.Path(sys.argv[1])
plan = lambda arg: {s.split(":")[0]: int(s.split(":")[1]) for s in arg.split()}
doc = {"dry_run": sys.argv[2] == "--dry-run", "machine": platform.node(), "plan_s": plan(sys.argv[3]),
       "total_s": int(sys.argv[4]), "gpu_plan_s": plan(sys.argv[5]), "gpu_total_s": int(sys.argv[6]),
       "gpu_margin_s": int(sys.argv[7]),
       "steps": [json.loads(l) for l in (out / "steps.jsonl").read_text().splitlines() if l.strip()]}
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
for name in ("env", "parity", "flux", "compiled", "wan"):
    if (out / f"{name}.json").is_file():
        doc[name] = json.loads((out / f"{name}.json").read_text())
(out / "gpu-h200.json").write_text(json.dumps(doc, indent=1))
print(json.dumps({k: v for k, v in doc.items() if k != "transfer"}, indent=1)[:4000])
PY
  rm -rf "${CLEAN[@]}"
}
trap summarize EXIT

if [ "$DRY" = --dry-run ] && [ -z "${GPU_CHECK_IMAGE_VENV:-}" ]; then
  # the image's conditions: a venv that sees only the image's packages and the carried ones (made once for these
  # lists and this machine's packages, then kept)
  VENV_BIN=$(python3 benchmarks/gpu_image.py venv) || { echo "could not make the image-like venv"; exit 1; }
  export GPU_CHECK_IMAGE_VENV=${VENV_BIN%/bin} PATH="$VENV_BIN:$PATH"
  echo "image-like venv: $GPU_CHECK_IMAGE_VENV (hides $(wc -l < "$GPU_CHECK_IMAGE_VENV/hidden.txt") distributions of this machine)"
fi
[ "$DRY" = --dry-run ] && { SITE=$(mktemp -d /tmp/disagg-site-dry.XXXX); CLEAN+=("$SITE"); }
# the dry run uses this machine's copies of the carried packages (its Python cannot import the cp312 wheels)
export PYTHONPATH="$( [ -z "$DRY" ] && echo "$SITE:")$ROOT"

START=$(date +%s)
step() {  # step NAME CMD...: run CMD under its planned limit, log to OUT/NAME.log, record rc and seconds
  local name=$1 limit; limit=$(limit_of "$1"); shift
  local left=$(( TOTAL_S - MARGIN_S / 2 - ($(date +%s) - START) ))
  (( left < limit )) && limit=$left
  if (( limit < 10 )); then
    echo "{\"step\": \"$name\", \"rc\": null, \"skipped\": \"no time left\"}" >> "$STEPS"; echo "== $name: no time left"
    return 1
  fi
  echo "== $name (limit ${limit}s)"
  local t0; t0=$(date +%s)
  timeout -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 )), \"limit_s\": $limit, \"timed_out\": $([ $rc = 124 ] || [ $rc = 137 ] && echo true || echo false)}" >> "$STEPS"
  echo "   rc=$rc"; tail -n 3 "$OUT/$name.log"
  return $rc
}
stop_run() {
  echo "{\"step\": \"$1\", \"stopped\": \"$2\"}" >> "$STEPS"
  echo "STOPPED at $1: $2 (see $OUT/$1.log)"; exit 1
}
skip() { echo "{\"step\": \"$1\", \"rc\": null, \"skipped\": \"$2\"}" >> "$STEPS"; echo "== $1: skipped: $2"; }
# triton builds its kernels' launchers with a C compiler ($CC, gcc, clang); inductor's CPU kernels need C++
have_compiler() {
  if [ "$DRY" = --dry-run ]; then command -v g++ || command -v c++ || command -v clang++
  else [ -n "${CC:-}" ] || command -v gcc || command -v clang || command -v cc; fi
} > /dev/null

E2E=(python3 benchmarks/gpu_e2e.py --out "$OUT")
if [ "$DRY" = --dry-run ]; then  # the same steps' code on the CPU, at toy sizes, fewest runs and steps
  step install bash -c "python3 benchmarks/gpu_image.py wheels --dry-run --install '$SITE'; w=\$?; python3 benchmarks/gpu_image.py imports && exit \$w" \
    || stop_run install "an install check failed: the GPU run would stop here"
  step env python3 benchmarks/gpu_image.py env --dry-run --json "$OUT/env.json" \
    || stop_run env "a version the code needs is missing"
  step pytest_gpu python3 -m pytest -q -o addopts="" -m gpu --timeout 60 -p no:cacheprovider tests/test_gpu.py
  step transfer python3 -m disagg bench transfer --engines shm,inline --sizes 16384 --repeats 2 --warmup 1 --json
  # one case (the bf16 checkpoint's: the fp32 tiny one is the same code on another model)
  step parity "${E2E[@]}" parity --device cpu --cases ckpt --prompts 1 --size 64 --steps 2
  step flux "${E2E[@]}" flux --device cpu --size 64 --steps 2 --runs 1
  if have_compiler; then
    step compiled "${E2E[@]}" compiled --device cpu --size 64 --steps 2 --runs 1 --modes compiled --model tiny
  else
    skip compiled "no C++ compiler (g++, c++ or clang++): inductor cannot build its CPU kernels"
  fi
  step wan "${E2E[@]}" wan --device cpu --size 32 --frames 9 --steps 2 --runs 1 --layouts 1:1:1
else
  step install bash -c "python3 benchmarks/gpu_image.py wheels --install '$SITE'; w=\$?; python3 benchmarks/gpu_image.py imports && exit \$w" \
    || stop_run install "an install check failed (see the log): every later step would fail on its imports"
  step env bash -c "nvidia-smi; python3 benchmarks/gpu_image.py env --json '$OUT/env.json'" \
    || stop_run env "a version the code needs is missing (see the log)"
  # 30 s a test, inside the step's limit: a hung test is reported by name, and the others' results kept
  step pytest_gpu python3 -m pytest -q -o addopts="" -m gpu --timeout 30 -p no:cacheprovider tests/test_gpu.py
  step transfer python3 -m disagg bench transfer --gpus 0 --engines cuda-ipc,shm \
    --sizes 16384,65536,262144,1048576,4194304,10485760,31457280 --repeats 10 --warmup 2 --json
  step parity "${E2E[@]}" parity --device cuda:0
  # does splitting pay? FLUX.1-dev shapes, 1:1:1 against one colocated replica on the same GPU, with stage times,
  # hand-off times and the control plane's share of the request
  step flux "${E2E[@]}" flux --device cuda:0 --size 1024 --steps 28 --runs 2
  # the compiled denoiser's step time (issue 27); its eager counterpart is the flux step's 1:1:1 denoiser
  if have_compiler; then
    step compiled "${E2E[@]}" compiled --device cuda:0 --size 1024 --steps 28 --runs 1 --modes compiled
  else
    skip compiled "no C compiler (\$CC, gcc, clang or cc): triton cannot build its kernels' launchers"
  fi
  step wan "${E2E[@]}" wan --device cuda:0 --size 832 --height 480 --frames 33 --steps 4 --runs 1 --layouts 1:1:1
fi
exit 0
