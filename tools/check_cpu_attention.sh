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
# shellcheck source=tools/cpu_check_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/cpu_check_lib.sh"
if [[ "$(uname -m)" == x86_64 ]]; then
  cpu_check_init cpu_attention x86-64 x86-64-v3 x86-64-v4 cooperlake sapphirerapids native -- "$@"
else
  cpu_check_init cpu_attention native -- "$@"
fi
# -Wno-maybe-uninitialized: GCC 12 flags the self-initialised _mm512_undefined_* of its own
# AVX-512 headers wherever their intrinsics are inlined (a false positive).
for target in "${TARGETS[@]}"; do
  cpu_check_build "$target" csrc/cpu/tests/check_paged_attention_cpu.cpp \
    -Wno-maybe-uninitialized || continue
  if [[ "$target" != native ]]; then
    echo "PASS build for $target"
  elif "$OUT/check_$target" > "$OUT/$target.log" 2>&1; then
    printf 'PASS %s: %s\n' "$target" "$(paste -sd ';' "$OUT/$target.log")"
  else
    cpu_check_failed "$target"
  fi
done
[[ $FAILURES -eq 0 ]]
