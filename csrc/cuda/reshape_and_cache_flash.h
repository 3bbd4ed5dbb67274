// Host entry point of the CUDA reshape_and_cache_flash kernels (docs/design.md §6). Framework-free:
// the torch glue validates the arguments (prepare_reshape_and_cache_flash), then calls this with
// the current stream. Kernels live in reshape_and_cache_flash.cuh.
#pragma once

#include <cuda_runtime_api.h>

#include "../cache_kernels.h"

namespace vllm_kv {

// Enqueues one kernel on `stream` that writes the first p.num_tokens tokens of key and value
// into the paged cache (unquantized copy, FP8 or NVFP4 quantization by p.cache_kind). Tokens with
// slot < 0 or slot >= num_blocks * block_size are skipped on the device. Does nothing when there
// is nothing to write. Does not check the launch: call cudaGetLastError (e.g.
// C10_CUDA_KERNEL_LAUNCH_CHECK) afterwards. `p` must have passed the host validation; for the
// unquantized kind the cache elements have the source's type.
void launch_reshape_and_cache_flash(const ReshapeAndCacheParams& p, cudaStream_t stream);

}  // namespace vllm_kv
