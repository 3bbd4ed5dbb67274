// The rotation signs of int4_per_token_head caches, on the device the kernels run on.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace vllm_kv {

// fp32 ±1 signs of the Hadamard block `block` (a power of two) on `device`, drawn as the reference
// codec draws them; the pointer stays valid for the life of the process.
const float* int4_rht_signs(int64_t block, const c10::Device& device);

}  // namespace vllm_kv
