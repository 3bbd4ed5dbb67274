#!/usr/bin/env bash
# Compiles the CPU attention kernels (csrc/cpu/paged_attention.h, every format and SIMD level) for
# x86-64 instruction sets this machine may lack, with the extension's CPU flags and -Werror:
# SSE2 (x86-64), AVX2 (x86-64-v3), AVX-512 without BF16 (x86-64-v4), AVX-512 BF16 without VBMI
# (cooperlake), and AVX-512 with BF16 and VBMI (sapphirerapids); native too. Compile only: what
# runs here is tested by tests/v1/attention.
#
#   tools/compile_cpu_attention.sh [target ...]
#
# Environment: CXX (default g++). Exits non-zero on any failure.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
CXX="${CXX:-g++}"
if [[ $# -gt 0 ]]; then
  TARGETS=("$@")
elif [[ "$(uname -m)" == x86_64 ]]; then
  TARGETS=(x86-64 x86-64-v3 x86-64-v4 cooperlake sapphirerapids native)
else
  TARGETS=(native)
fi
OUT="$(mktemp -d "${TMPDIR:-/tmp}/cpu_attention.XXXXXX")"
trap 'rm -rf "$OUT"' EXIT
FAILURES=0
# -Wno-maybe-uninitialized: GCC 12 flags the self-initialised _mm512_undefined_* of its own
# AVX-512 headers wherever their intrinsics are inlined (a false positive).
for target in "${TARGETS[@]}"; do
  if "$CXX" -std=c++20 -O3 "-march=$target" -ffp-contract=off -fno-fast-math \
      -fno-trapping-math -Wall -Wextra -Werror -Wno-psabi -Wno-maybe-uninitialized -I csrc -c \
      csrc/cpu/tests/compile_paged_attention.cpp -o "$OUT/$target.o" > "$OUT/$target.log" 2>&1; then
    echo "PASS compile for $target"
  else
    echo "FAIL compile for $target:"
    sed 's/^/    /' "$OUT/$target.log" | head -n 40
    FAILURES=$((FAILURES + 1))
  fi
done
[[ $FAILURES -eq 0 ]]
