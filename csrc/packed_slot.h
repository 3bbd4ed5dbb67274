// What the packed K+V slot stores (TurboQuant, ultraquant_4bit) share: the geometry of one store
// into a cache (num_blocks, block_size, H, slot) uint8 with contiguous slots, and a slot's address.
// Framework-free; host and device.
#pragma once

#include <cstdint>

#include "cache_kernels.h"
#include "kv_quant_math.h"

namespace vllm_kv {

// N tokens x H heads of D values: element strides for the key / value rows, byte strides for the
// cache. Each format's args add the row pointers and its own parameters.
struct PackedStoreArgs {
  const void* value;  // [N, H, D]
  int64_t key_token_stride;
  int64_t key_head_stride;
  int64_t value_token_stride;
  int64_t value_head_stride;
  uint8_t* cache;
  int64_t block_stride;
  int64_t entry_stride;
  int64_t head_stride;
  const int64_t* slot_mapping;  // [N]; < 0 or >= num_slots: skipped
  int64_t num_tokens;
  int64_t num_slots;
  int num_heads;
  int head_dim;
  int block_size;
  SourceType value_type;  // the value's element type (the kernels are instantiated per type)
};

// The first byte of (token, head)'s slot, or nullptr when the token's slot is skipped.
KV_HOST_DEVICE uint8_t* packed_slot(const PackedStoreArgs& a, int64_t token, int head) {
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0 || slot >= a.num_slots) return nullptr;
  return a.cache + (slot / a.block_size) * a.block_stride + (slot % a.block_size) * a.entry_stride +
         head * a.head_stride;
}

}  // namespace vllm_kv
