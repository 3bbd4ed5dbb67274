#!/usr/bin/env bash
# Builds csrc/cpu/tests/check_reshape_and_cache_flash_cpu.cpp (torch-free) for every CPU target the
# extension can be built for and runs it: the vector encoders against the scalar ones of
# kv_quant_math.h on all 2^32 fp32 inputs, and whole cache images of random and adversarial
# problems against the independent scalar reference, byte for byte. Targets (VLLM_KV_CPU_ARCH of
# CMakeLists.txt): native (AVX-512 on an AVX-512 machine), x86-64-v3 (AVX2), x86-64 (SSE2, the
# portable build); on other machines only native and the compiler's default.
#
#   tools/check_cpu_kernels.sh [target ...]
#
# Environment: CXX (default g++). Exits non-zero on any failure.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
CXX="${CXX:-g++}"
if [[ $# -gt 0 ]]; then
  TARGETS=("$@")
elif [[ "$(uname -m)" == x86_64 ]]; then
  TARGETS=(native x86-64-v3 x86-64)
else
  TARGETS=(native default)
fi
OUT="$(mktemp -d "${TMPDIR:-/tmp}/cpu_kernels.XXXXXX")"
trap 'rm -rf "$OUT"' EXIT
FAILURES=0
for target in "${TARGETS[@]}"; do
  arch=()
  [[ "$target" != default ]] && arch=("-march=$target")
  # The flags of the extension's CPU sources (CMakeLists.txt).
  if ! "$CXX" -std=c++20 -O3 "${arch[@]}" -ffp-contract=off -fno-fast-math -fno-trapping-math \
      -fopenmp -Wall -Wextra -Werror -Wno-psabi -I csrc \
      csrc/cpu/tests/check_reshape_and_cache_flash_cpu.cpp -o "$OUT/check_$target" \
      > "$OUT/$target.log" 2>&1; then
    echo "FAIL build for $target:"
    sed 's/^/    /' "$OUT/$target.log" | head -n 40
    FAILURES=$((FAILURES + 1))
    continue
  fi
  t0=$(date +%s)
  if "$OUT/check_$target" > "$OUT/$target.log" 2>&1; then
    printf 'PASS %s (%ss): %s; %s\n' "$target" "$(($(date +%s) - t0))" \
      "$(head -n 1 "$OUT/$target.log")" "$(tail -n 1 "$OUT/$target.log")"
  else
    echo "FAIL $target:"
    sed 's/^/    /' "$OUT/$target.log" | tail -n 40
    FAILURES=$((FAILURES + 1))
  fi
done
[[ $FAILURES -eq 0 ]]
