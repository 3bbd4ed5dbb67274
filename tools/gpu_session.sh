#!/usr/bin/env bash
# shellcheck disable=SC2329  # the step functions are exported and run through `bash -c`
# One command for a GPU machine: builds the extension for this GPU, runs the kernel tests on it, the
# Triton writer against the CUDA writer and the Triton attention's decode benchmark, the rest of
# the test suite, the byte-exact GPU check program, the benchmarks and, when
# compute-sanitizer is there, memcheck on the check program and the kernel tests; writes the
# results under $OUT.
#
#   tools/gpu_session.sh [--out DIR] [--budget SECONDS] [--only STEP,...] [--dry-run]
#
# Made for a remote runner that starts it in a copy of the repository, gives it 10 minutes, sets
# $OUT and returns at most 8 files from it (docs/benchmarks.md). Runs in the
# environment it finds: $PYTHON (default python3) must hold a CUDA build of torch, with setuptools,
# cmake and ninja; nothing is downloaded. Every step has a time limit taken from the budget
# (default 540 s, for a 600 s call) and a failing step does not stop the later ones; the exit
# status is 1 if any step failed, 2 if there is no GPU (nothing else is run then).
#
# Files under $OUT (or --out DIR):
#   summary.md          the device, every step's status and time, test counts, the benchmark table
#   session.log         every step's output, in order
#   junit-kernels.xml   pytest tests/kernels on the GPU
#   junit-suite.xml     the rest of the test suite (tests/ without tests/kernels)
#   junit-memcheck.xml  pytest tests/kernels under compute-sanitizer --tool memcheck
#   triton_attention.json  benchmarks/kernels/benchmark_triton_attention.py: TRITON_ATTN decode at
#                       8k context per format, GB/s, % of the copy bandwidth, x bf16
#   bench.json          benchmarks/kernels/benchmark_reshape_and_cache_flash.py --device cuda:
#                       GB/s, % of the device's copy bandwidth measured in the same run, x baseline
#   gpu_check.json      csrc/cuda/tests/gpu_check_reshape_and_cache_flash.cu: byte comparison with
#                       a scalar reference and its own bandwidth figures (plain nvcc, no torch)
#
# --only runs the named steps alone (comma-separated names from the step table below, e.g.
# build,kernel-tests: a short first session, or a rerun of what failed); the others are listed as
# skipped, and the environment report always runs. --dry-run prints the steps and their commands without running anything (works without a GPU).
# Environment: PYTHON, NVCC (default nvcc on PATH, else /usr/local/cuda/bin/nvcc),
# VLLM_KV_CUDA_ARCHS (default: this GPU's architecture, e.g. 90a on an H100).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

OUT_DIR="${OUT:-}"
BUDGET=540
DRY_RUN=0
ONLY=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT_DIR="${2:?--out needs a directory}"; shift ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift ;;
    --only) ONLY="${2:?--only needs step names}"; shift ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) awk 'NR > 2 && /^#/ { sub(/^# ?/, ""); print; next } NR > 2 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_session.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
STEP_NAMES=(environment build kernel-tests triton-writer triton-attention gpu-check benchmark
  suite-tests memcheck-kernels memcheck-tests)
IFS=',' read -r -a only_names <<< "$ONLY"
for name in "${only_names[@]}"; do
  if [[ " ${STEP_NAMES[*]} " != *" $name "* ]]; then
    echo "gpu_session.sh: --only: expected step names from: ${STEP_NAMES[*]}; got $name" >&2
    exit 2
  fi
done
if [[ ! "$BUDGET" =~ ^[0-9]+$ ]] || [[ "$BUDGET" -lt 60 ]]; then
  echo "gpu_session.sh: --budget: expected seconds >= 60, got $BUDGET" >&2
  exit 2
fi
if [[ -z "$OUT_DIR" ]]; then
  if [[ $DRY_RUN == 1 ]]; then
    OUT_DIR="$(mktemp -d "${TMPDIR:-/tmp}/gpu_session.XXXXXX")"
  else
    echo "gpu_session.sh: no output directory: set OUT or pass --out DIR" >&2
    exit 2
  fi
fi
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"

PYTHON="${PYTHON:-python3}"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
LOG="$OUT_DIR/session.log"
STEPS_TSV="$(mktemp "${TMPDIR:-/tmp}/gpu_session_steps.XXXXXX")"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_session_work.XXXXXX")"
trap 'rm -rf "$STEPS_TSV" "$WORK"' EXIT
: > "$LOG"
START=$SECONDS
FAILED=0

# step NAME CAP_SECONDS FUNCTION: runs the shell function FUNCTION (exported, in a child bash, so
# that `timeout` can stop it with everything it started) with a limit of CAP_SECONDS or what is
# left of the budget (minus 20 s for the summary), logs its output, records status and time.
step() {
  local name="$1" cap="$2" fn="$3"
  # The environment report always runs: every summary needs the device.
  if [[ -n "$ONLY" && $name != environment && ",$ONLY," != *",$name,"* ]]; then
    printf '%s\tskipped\t0\tnot in --only\n' "$name" >> "$STEPS_TSV"
    return 0
  fi
  local left=$((BUDGET - (SECONDS - START) - 20))
  local limit=$((cap < left ? cap : left))
  if [[ $DRY_RUN == 1 ]]; then
    printf '%-16s (at most %3d s):\n' "$name" "$cap"
    declare -f "$fn" | sed '1,2d;$d'
    return 0
  fi
  if [[ $limit -lt 10 ]]; then
    printf '%s\tskipped\t0\tno time left in the %d s budget\n' "$name" "$BUDGET" >> "$STEPS_TSV"
    echo "=== $name: skipped (budget spent)" | tee -a "$LOG"
    return 0
  fi
  echo "=== $name (limit $limit s)" | tee -a "$LOG"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" bash -o pipefail -c "$fn" >> "$LOG" 2>&1
  rc=$?
  local secs=$((SECONDS - t0)) status=passed note=""
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    status=failed note="timed out after $limit s"
  elif [[ $rc -ne 0 ]]; then
    status=failed note="exit $rc"
  fi
  [[ $status == passed ]] || FAILED=1
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "$note" >> "$STEPS_TSV"
  echo "=== $name: $status in $secs s${note:+ ($note)}" | tee -a "$LOG"
  return 0
}

# --- the GPU, or a clear stop ---------------------------------------------------------------
GPU_INFO="$WORK/gpu_info.txt"
if [[ $DRY_RUN == 0 ]]; then
  if ! "$PYTHON" - > "$GPU_INFO" 2>&1 <<'EOF'
import sys

import torch

if torch.version.cuda is None:
    sys.exit(f"torch {torch.__version__} is not a CUDA build")
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")
p = torch.cuda.get_device_properties(0)
major, minor = torch.cuda.get_device_capability(0)
arch = f"{major}{minor}" + ("a" if major >= 9 else "")
print(f"gpu={p.name}")
print(f"arch={arch}")
print(f"memory_gib={p.total_memory / 2**30:.1f}")
print(f"sms={p.multi_processor_count}")
print(f"torch={torch.__version__}")
print(f"torch_cuda={torch.version.cuda}")
EOF
  then
    echo "gpu_session.sh: FAIL: no usable GPU: $(tail -n 1 "$GPU_INFO")." \
      "This script runs on a machine with an NVIDIA GPU; see docs/benchmarks.md." >&2
    exit 2
  fi
  ARCH="${VLLM_KV_CUDA_ARCHS:-$(sed -n 's/^arch=//p' "$GPU_INFO")}"
else
  ARCH="${VLLM_KV_CUDA_ARCHS:-the GPU architecture}"
fi
echo "output: $OUT_DIR; budget $BUDGET s; CUDA architectures $ARCH" | tee -a "$LOG"

# --- the steps ------------------------------------------------------------------------------
env_report() {
  cat "$GPU_INFO"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
  "$NVCC" --version | tail -n 2 || true
  command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
  "$PYTHON" -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' 2> /dev/null \
    || echo "flashinfer: not installed"
}
build() {
  # The README's install, offline (the machine reaches no index) and for this GPU only.
  VLLM_KV_CUDA_ARCHS="$ARCH" "$PYTHON" -m pip install --no-index --no-build-isolation --no-deps \
    -e . && "$PYTHON" tools/check_op_registrations.py --require CPU,CUDA,Meta
}
# pytest on 8 workers where pytest-xdist is installed (see the header), else in one process.
pytest_run() {
  local workers=()
  "$PYTHON" -c 'import xdist' 2> /dev/null && workers=(-n 8)
  "$PYTHON" -m pytest -q -p no:cacheprovider "${workers[@]}" "$@"
}
kernel_tests() {
  pytest_run tests/kernels --junitxml="$OUT_DIR/junit-kernels.xml"
}
triton_writer() {
  # Native Triton kernels (no interpreter): the Triton writer's bytes against the CUDA op's for
  # every format (PASS / FAIL, exit 1 on a difference), and the store bandwidth of both.
  env -u TRITON_INTERPRET "$PYTHON" benchmarks/kernels/benchmark_triton_reshape_and_cache_flash.py \
    --device cuda --tokens 4096 --heads 8
}
triton_attention() {
  env -u TRITON_INTERPRET "$PYTHON" benchmarks/kernels/benchmark_triton_attention.py \
    --json "$OUT_DIR/triton_attention.json" --markdown "$WORK/triton_attention.md"
}
suite_tests() {
  pytest_run tests --ignore=tests/kernels --junitxml="$OUT_DIR/junit-suite.xml"
}
gpu_check() {
  local arch="${ARCH%%;*}"
  "$NVCC" -std=c++20 -O2 -I csrc -gencode "arch=compute_${arch},code=sm_${arch}" \
    csrc/cuda/reshape_and_cache_flash.cu csrc/cuda/tests/gpu_check_reshape_and_cache_flash.cu \
    -o "$WORK/gpu_check" && "$WORK/gpu_check" 2000 --bench --json "$OUT_DIR/gpu_check.json"
}
benchmark() {
  "$PYTHON" benchmarks/kernels/benchmark_reshape_and_cache_flash.py --device cuda \
    --json "$OUT_DIR/bench.json" --markdown "$WORK/bench.md"
}
memcheck_kernels() {
  if ! command -v compute-sanitizer > /dev/null; then
    echo "compute-sanitizer not on PATH: memcheck not run"
    return 0
  fi
  # The torch-free check program: every kernel variant on random problems, each buffer its own
  # cudaMalloc, so any out-of-bounds access is reported.
  [[ -x "$WORK/gpu_check" ]] || { echo "no gpu_check binary: the gpu-check step failed"; return 1; }
  compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$WORK/gpu_check" 300
}
memcheck_tests() {
  if ! command -v compute-sanitizer > /dev/null; then
    echo "compute-sanitizer not on PATH: memcheck not run"
    return 0
  fi
  # Without torch's caching allocator every tensor is its own cudaMalloc, so an access past a
  # tensor's end is out of bounds for memcheck too (not just past a pooled block's end).
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 99 \
    --print-limit 20 "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels -k cuda \
    --junitxml="$OUT_DIR/junit-memcheck.xml"
}

export PYTHON NVCC ARCH OUT_DIR WORK GPU_INFO
export -f env_report build pytest_run kernel_tests triton_writer triton_attention suite_tests \
  gpu_check benchmark memcheck_kernels memcheck_tests
step environment 30 env_report
step build 240 build
step kernel-tests 150 kernel_tests
step triton-writer 90 triton_writer
step triton-attention 150 triton_attention
step gpu-check 90 gpu_check
step benchmark 120 benchmark
step suite-tests 150 suite_tests
step memcheck-kernels 60 memcheck_kernels
step memcheck-tests 600 memcheck_tests  # last: it takes whatever the budget has left
[[ $DRY_RUN == 1 ]] && exit 0

# --- summary.md -----------------------------------------------------------------------------
junit_counts() {
  [[ -f "$1" ]] || { echo "no report"; return; }
  "$PYTHON" - "$1" <<'EOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
print(f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped")
EOF
}
{
  echo "# GPU session: $(sed -n 's/^gpu=//p' "$GPU_INFO")"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ);" \
    "commit: $(git rev-parse --short HEAD 2> /dev/null || echo unknown)"
  echo "- $(tr '\n' ' ' < "$GPU_INFO")"
  echo "- built for: $ARCH; total wall time: $((SECONDS - START)) s of a $BUDGET s budget"
  echo
  echo "| step | status | seconds | note |"
  echo "|---|---|---:|---|"
  while IFS=$'\t' read -r name status secs note; do
    echo "| $name | $status | $secs | $note |"
  done < "$STEPS_TSV"
  echo
  echo "| tests | result |"
  echo "|---|---|"
  echo "| tests/kernels on the GPU | $(junit_counts "$OUT_DIR/junit-kernels.xml") |"
  echo "| rest of tests/ | $(junit_counts "$OUT_DIR/junit-suite.xml") |"
  echo "| tests/kernels -k cuda under memcheck | $(junit_counts "$OUT_DIR/junit-memcheck.xml") |"
  echo
  if [[ -f "$WORK/triton_attention.md" ]]; then
    echo "## TRITON_ATTN decode (triton_attention.json)"
    echo
    cat "$WORK/triton_attention.md"
    echo
  fi
  if [[ -f "$WORK/bench.md" ]]; then
    echo "## reshape_and_cache_flash (bench.json)"
    echo
    cat "$WORK/bench.md"
  fi
  if ! "$PYTHON" -c 'import flashinfer' 2> /dev/null; then
    echo
    echo "FlashInfer is not installed here: no x FlashInfer append baseline in this session."
  fi
} > "$OUT_DIR/summary.md"
cat "$OUT_DIR/summary.md"
exit "$FAILED"
