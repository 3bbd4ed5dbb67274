#!/usr/bin/env bash
# Builds the torch-free CPU kernel checks for every CPU target the extension can be built for and
# runs them: check_reshape_and_cache_flash_cpu.cpp (the vector encoders against the scalar ones of
# kv_quant_math.h on all 2^32 fp32 inputs, and whole cache images of random and adversarial
# problems against the independent scalar reference, byte for byte) and
# check_packed_slot_rows_cpu.cpp (the TurboQuant / ultraquant_4bit row writers against the
# per-value writers the CUDA kernels run, byte for byte). Targets (VLLM_KV_CPU_ARCH of
# CMakeLists.txt): native (AVX-512 on an AVX-512 machine), x86-64-v3 (AVX2), x86-64 (SSE2, the
# portable build); on other machines only native and the compiler's default.
#
#   tools/check_cpu_kernels.sh [target ...]
#
# Environment: CXX (default g++). Exits non-zero on any failure.
set -uo pipefail
# shellcheck source=tools/cpu_check_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/cpu_check_lib.sh"
if [[ "$(uname -m)" == x86_64 ]]; then
  cpu_check_init cpu_kernels native x86-64-v3 x86-64 -- "$@"
else
  cpu_check_init cpu_kernels native default -- "$@"
fi
for target in "${TARGETS[@]}"; do
  for check in reshape_and_cache_flash packed_slot_rows; do
    cpu_check_build "$target" "csrc/cpu/tests/check_${check}_cpu.cpp" -fopenmp || continue
    t0=$(date +%s)
    if "$OUT/check_$target" > "$OUT/$target.log" 2>&1; then
      printf 'PASS %s %s (%ss): %s; %s\n' "$check" "$target" "$(($(date +%s) - t0))" \
        "$(head -n 1 "$OUT/$target.log")" "$(tail -n 1 "$OUT/$target.log")"
    else
      cpu_check_failed "$target"
    fi
  done
done
[[ $FAILURES -eq 0 ]]
