#!/usr/bin/env bash
# Compiles every CUDA kernel source (csrc/cuda/*.cu) with plain nvcc, without torch, for every GPU
# architecture the extension targets, so that no code path (Blackwell-only ones included) can rot
# on machines without a GPU. The torch glue (csrc/cuda/*.cpp) needs a CUDA build of torch and is
# not compiled here.
#
#   tools/compile_cuda_kernels.sh [--no-host-checks] [--keep DIR]
#
# Per (file, arch) it prints one line with the result, the time, the kernel count, the highest
# register count and the local-memory (spill / stack) bytes. Warnings are errors: nvcc's own, the
# host compiler's -Wall -Wextra (unknown pragmas excepted: `#pragma unroll` reaches the host pass
# of __host__ __device__ code) and ptxas's, including register spills and any local-memory use.
# Every file is compiled as C++20 (what torch 2.13 wants) for all architectures, and as C++17 for
# one, since both standards must keep working.
#
# Then it checks the PTX of every file for approximate or flush-to-zero floating point (the
# quantization must be IEEE fp32 with subnormals, to match the reference bytes), and, unless
# --no-host-checks, builds and runs the host checks in csrc/cuda/tests/ (the exhaustive
# equivalence proof of the branch-free encoders of kv_quant_fast.h; the host replay of the kernels
# against an independent scalar reference; the Octave store's steps in a warp's lane orders) and
# builds the GPU check program (run on a GPU only).
#
# Environment: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc), CXX (default g++),
# JOBS (parallel compiles, default: number of cores), CUDA_ARCHS (default "80 90a 100a 120a").
# Exits non-zero on any failure.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

HOST_CHECKS=1
KEEP_DIR=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --no-host-checks) HOST_CHECKS=0 ;;
    --keep) KEEP_DIR="$2"; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
CXX="${CXX:-g++}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
read -r -a ARCHS <<< "${CUDA_ARCHS:-80 90a 100a 120a}"
if [[ ! -x "$NVCC" ]]; then
  echo "FAIL: nvcc not found (set NVCC)" >&2
  exit 1
fi

if [[ -n "$KEEP_DIR" ]]; then
  mkdir -p "$KEEP_DIR"
  OUT="$(cd "$KEEP_DIR" && pwd)"
else
  OUT="$(mktemp -d "${TMPDIR:-/tmp}/cuda_kernels.XXXXXX")"
  trap 'rm -rf "$OUT"' EXIT
fi

shopt -s nullglob
SOURCES=(csrc/cuda/*.cu)
if [[ ${#SOURCES[@]} -eq 0 ]]; then
  echo "FAIL: no csrc/cuda/*.cu found" >&2
  exit 1
fi

# The commas are nvcc's own list syntax (one host-compiler / ptxas argument each).
# shellcheck disable=SC2054
NVCC_FLAGS=(
  -O3 -I csrc
  -Werror all-warnings
  -Xcompiler=-Wall,-Wextra,-Werror,-Wno-unknown-pragmas
  -Xptxas=-v,-warn-spills,-warn-lmem-usage,-warn-double-usage,-Werror
)

elapsed() { awk -v a="$(date +%s.%N)" -v b="$1" 'BEGIN { printf "%.1f", a - b }'; }

START=$(date +%s.%N)
echo "nvcc: $("$NVCC" --version | tail -n 2 | head -n 1); host compiler: $("$CXX" --version | head -n 1)"
echo "compiling ${#SOURCES[@]} file(s) for$(printf ' sm_%s' "${ARCHS[@]}") with $JOBS parallel job(s)"

# One job per (file, arch, standard): the result goes to $OUT/<job>.status, the log to .log.
compile_one() {
  local src="$1" arch="$2" std="$3" job="$4"
  local log="$OUT/$job.log" t0 rc secs
  t0=$(date +%s.%N)
  "$NVCC" -std="$std" "${NVCC_FLAGS[@]}" -gencode "arch=compute_${arch},code=sm_${arch}" \
    -c "$src" -o "$OUT/$job.o" > "$log" 2>&1
  rc=$?
  secs=$(elapsed "$t0")
  local kernels regs spill stack
  kernels=$(grep -c "Compiling entry function" "$log")
  regs=$(grep -o "Used [0-9]* registers" "$log" | awk '{print $2}' | sort -n | tail -n 1)
  spill=$(grep -o "[0-9]* bytes spill stores" "$log" | awk '{s += $1} END {print s + 0}')
  stack=$(grep -o "[0-9]* bytes stack frame" "$log" | awk '{s += $1} END {print s + 0}')
  printf '%s|%s|%s kernels, max %s registers, spill stores %s B, stack %s B\n' \
    "$rc" "$secs" "$kernels" "${regs:-?}" "$spill" "$stack" > "$OUT/$job.status"
}

JOB_SPECS=()
for src in "${SOURCES[@]}"; do
  for arch in "${ARCHS[@]}"; do JOB_SPECS+=("$src|$arch|c++20"); done
  JOB_SPECS+=("$src|${ARCHS[0]}|c++17")
done

running=0
for spec in "${JOB_SPECS[@]}"; do
  IFS='|' read -r src arch std <<< "$spec"
  job="$(basename "$src" .cu).sm_${arch}.${std}"
  compile_one "$src" "$arch" "$std" "$job" &
  running=$((running + 1))
  if [[ $running -ge $JOBS ]]; then
    wait -n
    running=$((running - 1))
  fi
done
wait

FAILURES=0
for spec in "${JOB_SPECS[@]}"; do
  IFS='|' read -r src arch std <<< "$spec"
  job="$(basename "$src" .cu).sm_${arch}.${std}"
  if [[ ! -f "$OUT/$job.status" ]]; then
    echo "FAIL $src sm_$arch ($std): no result"
    FAILURES=$((FAILURES + 1))
    continue
  fi
  IFS='|' read -r rc secs summary < "$OUT/$job.status"
  if [[ "$rc" == 0 ]]; then
    printf 'PASS %s sm_%s (%s) %ss: %s\n' "$src" "$arch" "$std" "$secs" "$summary"
  else
    printf 'FAIL %s sm_%s (%s) %ss (exit %s):\n' "$src" "$arch" "$std" "$secs" "$rc"
    grep -v "^ptxas info\|bytes stack frame\|^ptxas info    : Used" "$OUT/$job.log" | head -n 60 | sed 's/^/    /'
    FAILURES=$((FAILURES + 1))
  fi
done

# IEEE fp32 only: no flush-to-zero, no approximate division / reciprocal / transcendental.
for src in "${SOURCES[@]}"; do
  ptx="$OUT/$(basename "$src" .cu).ptx"
  if ! "$NVCC" -std=c++20 -O3 -I csrc -gencode "arch=compute_90a,code=compute_90a" -ptx "$src" \
    -o "$ptx" > "$ptx.log" 2>&1; then
    echo "FAIL $src: PTX generation failed"
    sed 's/^/    /' "$ptx.log" | head -n 40
    FAILURES=$((FAILURES + 1))
    continue
  fi
  bad=$(grep -nE '\.ftz\b|\.approx\b|div\.full\b' "$ptx" | head -n 5)
  if [[ -n "$bad" ]]; then
    echo "FAIL $src: approximate or flush-to-zero fp32 arithmetic in PTX:"
    echo "$bad" | sed 's/^/    /'
    FAILURES=$((FAILURES + 1))
  else
    echo "PASS $src: PTX fp32 arithmetic is IEEE round-to-nearest ($(grep -c 'div\.rn\.f32' "$ptx") div.rn.f32, no .ftz / .approx)"
  fi
done

# host_check LABEL NAME [RUN_ARGS...] -- BUILD_COMMAND...: builds $OUT/NAME with the command (its
# -o added), runs it with RUN_ARGS, prints PASS with its last line or FAIL with its log.
host_check() {
  local label="$1" name="$2" run_args=() t0
  shift 2
  while [[ "$1" != "--" ]]; do run_args+=("$1"); shift; done
  shift
  t0=$(date +%s.%N)
  if "$@" -o "$OUT/$name" > "$OUT/$name.log" 2>&1 \
    && "$OUT/$name" "${run_args[@]}" >> "$OUT/$name.log" 2>&1; then
    printf 'PASS host check: %s (%ss): %s\n' "$label" "$(elapsed "$t0")" \
      "$(tail -n 1 "$OUT/$name.log")"
  else
    echo "FAIL host check: $label"
    sed 's/^/    /' "$OUT/$name.log" | tail -n 40
    FAILURES=$((FAILURES + 1))
  fi
}

if [[ $HOST_CHECKS == 1 ]]; then
  OPENMP_FLAG=()
  echo 'int main(){}' > "$OUT/omp.cpp"
  "$CXX" -fopenmp "$OUT/omp.cpp" -o "$OUT/omp" > /dev/null 2>&1 && OPENMP_FLAG=(-fopenmp)
  host_check "encoders of kv_quant_fast.h == kv_quant_math.h" check_kv_quant_fast -- \
    "$CXX" -std=c++17 -O2 "${OPENMP_FLAG[@]}" -Wall -Wextra -Werror -I csrc \
    csrc/cuda/tests/check_kv_quant_fast.cpp
  host_check "Octave store, warp lane orders == one loop" check_octave -- \
    "$CXX" -std=c++17 -O2 -Wall -Wextra -Werror -I csrc csrc/cuda/tests/check_octave_team_replay.cpp
  host_check "kernel replay == scalar reference" check_replay 6000 -- \
    "$NVCC" -std=c++20 -O1 -I csrc -Xcompiler=-Wall,-Wextra,-Wno-unknown-pragmas \
    csrc/cuda/tests/check_reshape_and_cache_flash_replay.cu
  t0=$(date +%s.%N)
  if "$NVCC" -std=c++20 -O2 -I csrc -Xcompiler=-Wall,-Wextra,-Werror,-Wno-unknown-pragmas \
      -gencode arch=compute_90a,code=sm_90a csrc/cuda/reshape_and_cache_flash.cu \
      csrc/cuda/tests/gpu_check_reshape_and_cache_flash.cu -o "$OUT/gpu_check" \
      > "$OUT/gpu_check.log" 2>&1; then
    printf 'PASS build: csrc/cuda/tests/gpu_check_reshape_and_cache_flash.cu for sm_90a (%ss; runs on a GPU only)\n' \
      "$(elapsed "$t0")"
  else
    echo "FAIL build: csrc/cuda/tests/gpu_check_reshape_and_cache_flash.cu"
    sed 's/^/    /' "$OUT/gpu_check.log" | tail -n 40
    FAILURES=$((FAILURES + 1))
  fi
fi

printf 'total %ss, %d failure(s)\n' "$(elapsed "$START")" "$FAILURES"
[[ $FAILURES -eq 0 ]]
