// Host-side validation of the compiled nvfp4_ds_mla writer, shared by its CPU and CUDA ops.
#pragma once

#include <ATen/core/Tensor.h>

#include "ds_mla_nvfp4.h"

namespace vllm_kv {

// Checks concat_and_cache_nvfp4_ds_mla's arguments (dtypes, shapes, strides, devices; the slot
// values are the device op's) and describes the call: kv_c [T_pad, 512] and k_pe [T_pad, 64]
// bf16 with contiguous rows, kv_cache (B, N, 352) uint8 with contiguous records, slot_mapping
// int64 [T <= T_pad].
DsMlaWriteArgs prepare_ds_mla_write(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                    const at::Tensor& kv_cache, const at::Tensor& slot_mapping);

}  // namespace vllm_kv
