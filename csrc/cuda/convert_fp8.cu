// CUDA kernel of convert_fp8: a grid-stride loop over the element-wise conversion of
// csrc/convert_fp8.h (the CPU op's code, with the GPU encoders of kv_quant_fast.h). Torch-free;
// compiled by the extension build and by tools/compile_cuda_kernels.sh.
#include "convert_fp8.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace vllm_kv {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill every SM of the largest GPUs several times; the loop covers the rest.
constexpr int64_t kMaxBlocks = 8192;

template <ConvertType kSrc, ConvertType kDst>
__global__ void __launch_bounds__(kThreads) convert_fp8_kernel(const ConvertFp8Params p) {
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  convert_fp8_range<kSrc, kDst>(p, first, p.numel, int64_t(gridDim.x) * kThreads);
}

}  // namespace

void launch_convert_fp8(const ConvertFp8Params& p, cudaStream_t stream) {
  if (p.numel <= 0) return;
  const int blocks = int(std::min(kMaxBlocks, (p.numel + kThreads - 1) / kThreads));
  dispatch_convert_fp8(p.src_type, p.dst_type, [&](auto src, auto dst) {
    convert_fp8_kernel<decltype(src)::value, decltype(dst)::value>
        <<<blocks, kThreads, 0, stream>>>(p);
  });
}

}  // namespace vllm_kv
