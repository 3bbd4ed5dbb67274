#!/usr/bin/env bash
# Builds csrc/cpu/tests/check_paged_attention_cpu.cpp (torch-free: every CPU attention kernel of
# csrc/cpu/paged_attention.h instantiated, and the exact bf16 conversions of the bf16 dot path
# checked on every input) with the extension's CPU flags and -Werror, for x86-64 instruction sets
# this machine may lack: SSE2 (x86-64), AVX2 (x86-64-v3), AVX-512 without BF16 (x86-64-v4),
# AVX-512 BF16 without VBMI (cooperlake), AVX-512 with BF16 and VBMI (sapphirerapids), and
# native, which is also run. What runs here is tested against the reference by tests/v1/attention.
#
#   tools/check_cpu_attention.sh [target ...]   (targets built; "native" is run)
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
  if ! "$CXX" -std=c++20 -O3 "-march=$target" -ffp-contract=off -fno-fast-math \
      -fno-trapping-math -Wall -Wextra -Werror -Wno-psabi -Wno-maybe-uninitialized -I csrc \
      csrc/cpu/tests/check_paged_attention_cpu.cpp -o "$OUT/check_$target" \
      > "$OUT/$target.log" 2>&1; then
    echo "FAIL build for $target:"
    sed 's/^/    /' "$OUT/$target.log" | head -n 40
    FAILURES=$((FAILURES + 1))
    continue
  fi
  if [[ "$target" != native ]]; then
    echo "PASS build for $target"
  elif "$OUT/check_$target" > "$OUT/$target.log" 2>&1; then
    printf 'PASS %s: %s\n' "$target" "$(paste -sd ';' "$OUT/$target.log")"
  else
    echo "FAIL $target:"
    sed 's/^/    /' "$OUT/$target.log" | tail -n 40
    FAILURES=$((FAILURES + 1))
  fi
done
[[ $FAILURES -eq 0 ]]
