// CUDA nvfp4_ds_mla writer: one thread per unit (a NoPE group or the RoPE part) of a token's
// record, the units of ds_mla_nvfp4.h, so the bytes are the CPU op's (which runs the same units in
// a loop) and the reference codec's. Torch-free.
#include "concat_and_cache_mla.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace vllm_kv {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    concat_and_cache_nvfp4_ds_mla_kernel(const __grid_constant__ DsMlaWriteArgs a) {
  const int64_t total = a.num_tokens * kDsMlaUnits;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    write_ds_mla_unit(a, i / kDsMlaUnits, int(i % kDsMlaUnits));
  }
}

}  // namespace

void launch_concat_and_cache_nvfp4_ds_mla(const DsMlaWriteArgs& a, cudaStream_t stream) {
  const int64_t total = a.num_tokens * kDsMlaUnits;
  if (total <= 0) return;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 1 << 20);
  concat_and_cache_nvfp4_ds_mla_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(a);
}

}  // namespace vllm_kv
