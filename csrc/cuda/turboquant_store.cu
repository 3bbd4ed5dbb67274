// CUDA TurboQuant store: one thread per (token, head) slot running write_turboquant_slot, so the
// bytes are the CPU op's (which runs the same function in a loop) and the reference codec's.
// Torch-free.
#include "turboquant_store.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace vllm_kv {
namespace {

constexpr int kThreads = 128;

template <SourceType KS, SourceType VS>
__global__ void __launch_bounds__(kThreads)
    turboquant_store_kernel(const __grid_constant__ TurboQuantWriteArgs a) {
  const int64_t total = a.num_tokens * a.num_heads;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    write_turboquant_slot<KS, VS>(a, i / a.num_heads, int(i % a.num_heads));
  }
}

}  // namespace

void launch_turboquant_store(const TurboQuantWriteArgs& a, SourceType value_type,
                             cudaStream_t stream) {
  const int64_t total = a.num_tokens * a.num_heads;
  if (total <= 0) return;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 1 << 20);
  dispatch_turboquant_types(a.key_bits == kTurboQuantFp8KeyBits, value_type, [&](auto ks, auto vs) {
    turboquant_store_kernel<decltype(ks)::value, decltype(vs)::value>
        <<<unsigned(blocks), kThreads, 0, stream>>>(a);
  });
}

}  // namespace vllm_kv
