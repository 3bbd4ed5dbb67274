// Host entry point of the CUDA convert_fp8 kernel (docs/design.md §6). Framework-free: the torch
// glue validates the arguments (run_convert_fp8), then calls this with the current stream.
#pragma once

#include <cuda_runtime_api.h>

#include "../convert_fp8.h"

namespace vllm_kv {

// Enqueues one kernel on `stream` that converts the p.numel elements (nothing when 0). Does not
// check the launch: call cudaGetLastError (e.g. C10_CUDA_KERNEL_LAUNCH_CHECK) afterwards.
void launch_convert_fp8(const ConvertFp8Params& p, cudaStream_t stream);

}  // namespace vllm_kv
