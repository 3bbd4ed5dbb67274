// Host-side validation of the compiled packed-slot stores (TurboQuant, ultraquant_4bit, Octave),
// shared by their CPU and CUDA ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "octave_slot.h"
#include "turboquant_slot.h"
#include "ultraquant_slot.h"

namespace vllm_kv {

// Checks turboquant_store's arguments (dtypes, shapes, strides, devices; the slot values are the
// device op's) and describes the call: key and value [N, H, D] with contiguous rows (FP8 keys:
// the key in value's dtype; Lloyd-Max keys: y in fp32 with key_norms fp32 [N, H] and midpoints
// fp32 [2^key_bits - 1], both contiguous), kv_cache (num_blocks, block_size, H, >= slot bytes)
// uint8 with contiguous slots, slot_mapping contiguous int64 [N].
TurboQuantWriteArgs prepare_turboquant_store(const at::Tensor& key, const at::Tensor& value,
                                             const at::Tensor& kv_cache,
                                             const at::Tensor& slot_mapping,
                                             const std::optional<at::Tensor>& key_norms,
                                             const std::optional<at::Tensor>& midpoints,
                                             int64_t key_bits, int64_t value_bits);

// Checks ultraquant_store's arguments as above: key [N, H, D] the rotated keys in fp32, value
// [N, H, D] fp32 / fp16 / bf16 (rows contiguous, D a multiple of 32), kv_cache and slot_mapping
// as for TurboQuant, constant_c finite and > 0.
UltraQuantWriteArgs prepare_ultraquant_store(const at::Tensor& key, const at::Tensor& value,
                                             const at::Tensor& kv_cache,
                                             const at::Tensor& slot_mapping, double constant_c);

// A CPU op's slot range check (a GPU kernel skips slots past the cache instead): every slot of
// a.slot_mapping below a.num_slots.
void check_slot_range(const PackedStoreArgs& a);

// Checks octave_cache_store's arguments (upstream's op): key and value [N, H, D] of one type
// (fp32 / fp16 / bf16, rows contiguous, D a multiple of 64 up to kOctaveMaxHeadDim), cache
// (num_blocks, H, block_size, slot bytes) uint8 with contiguous slots (block K's rotary dims are
// the ones its slot size implies), slot_mapping int64 [N], k_signs / v_signs int32 [D / 32], fmt
// the V bits (3 or 4) plus kOctaveCompactFlag for compact K.
OctaveWriteArgs prepare_octave_store(const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& cache, const at::Tensor& slot_mapping,
                                     const at::Tensor& k_signs, const at::Tensor& v_signs,
                                     int64_t fmt);

}  // namespace vllm_kv
