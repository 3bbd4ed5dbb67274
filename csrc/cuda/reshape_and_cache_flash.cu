// Launcher of the CUDA reshape_and_cache_flash kernels (see reshape_and_cache_flash.cuh for the
// design). Torch-free; compiled by the extension build and by tools/compile_cuda_kernels.sh.
#include "reshape_and_cache_flash.h"

#include <cuda_runtime.h>

#include "reshape_and_cache_flash.cuh"

namespace vllm_kv {
namespace {

struct CudaLauncher {
  const gpu::FlashLaunchPlan& plan;
  cudaStream_t stream;

  template <typename Src, CacheKind kKind, int kVec, bool kWide>
  void operator()(gpu::KernelTag<Src, kKind, kVec, kWide>) const {
    gpu::reshape_and_cache_flash_kernel<Src, kKind, kVec, kWide>
        <<<plan.grid, plan.block, plan.shared_bytes, stream>>>(plan.args);
  }
};

}  // namespace

void launch_reshape_and_cache_flash(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  const gpu::FlashLaunchPlan plan = gpu::plan_reshape_and_cache_flash(p);
  if (plan.empty) return;
  gpu::dispatch_flash_kernel(p, plan, CudaLauncher{plan, stream});
}

}  // namespace vllm_kv
