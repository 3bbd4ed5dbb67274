// Instantiates every kernel of csrc/cpu/paged_attention.h (all formats, all SIMD levels the target
// has), torch-free, so that tools/compile_cpu_attention.sh can compile it for instruction sets this
// machine may not have (AVX-512 without BF16 or VBMI, AVX2 only, SSE2 only).
#include "cpu/paged_attention.h"

namespace attention = vllm_kv::cpu::attention;

void run_every_kernel(const vllm_kv::PagedAttentionParams& params,
                      const attention::AttentionPlan& plan, float* scratch) {
  attention::paged_attention(params, plan, scratch, vllm_kv::SimdLevel::kAuto,
                             [](int64_t begin, int64_t end, int64_t, const auto& fn) {
                               fn(begin, end);
                             });
}
