// Host entry point of the CUDA TurboQuant store (docs/formats.md §6.3). Framework-free: the torch
// glue validates the arguments (prepare_turboquant_store), then calls this with the current stream.
#pragma once

#include <cuda_runtime_api.h>

#include "../turboquant_slot.h"

namespace vllm_kv {

// Enqueues one kernel writing a.num_tokens * a.num_heads slots (one thread per slot, the function
// write_turboquant_slot; slots < 0 or >= num_slots skipped on the device); value_type is the
// value's element type. Nothing for no slots. Does not check the launch: call cudaGetLastError
// afterwards.
void launch_turboquant_store(const TurboQuantWriteArgs& a, SourceType value_type,
                             cudaStream_t stream);

}  // namespace vllm_kv
