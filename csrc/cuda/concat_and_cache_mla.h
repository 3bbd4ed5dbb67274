// Host entry point of the CUDA nvfp4_ds_mla writer (docs/formats.md §6.5). Framework-free: the
// torch glue validates the arguments (prepare_ds_mla_write), then calls this with the current
// stream.
#pragma once

#include <cuda_runtime_api.h>

#include "../ds_mla_nvfp4.h"

namespace vllm_kv {

// Enqueues one kernel writing the records of a.num_tokens tokens (one thread per unit of
// write_ds_mla_unit; slots < 0 or >= num_slots skipped on the device). Nothing for no tokens.
// Does not check the launch: call cudaGetLastError afterwards.
void launch_concat_and_cache_nvfp4_ds_mla(const DsMlaWriteArgs& a, cudaStream_t stream);

}  // namespace vllm_kv
