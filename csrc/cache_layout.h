// Where each element of a token lives in a paged cache side (docs/design.md §5). Shared by the CPU
// and CUDA kernels so both address the cache identically; framework-free.
#pragma once

#include <cstdint>

#include "cache_kernels.h"
#include "kv_quant_math.h"

namespace vllm_kv {

// Offset (in cache elements) of entry (block, token, head) of an unquantized or FP8 side.
KV_HOST_DEVICE int64_t entry_offset(const CacheSide& side, int64_t block, int64_t token,
                                    int64_t head) {
  return block * side.block_stride + token * side.token_stride + head * side.head_stride;
}

// Byte addressing of a packed NVFP4 side: each page is [data | scales]; within each region
// entries follow the side's NHD or HND order, data entries head_size / 2 bytes and scale
// entries head_size / 16 bytes wide.
struct Nvfp4SideLayout {
  int64_t block_stride;
  int64_t token_step;  // token_stride / full_dim: entries between consecutive tokens
  int64_t head_step;   // head_stride / full_dim: entries between consecutive heads
  int64_t scale_region_offset;
  int data_bytes;  // head_size / 2
  int num_groups;  // head_size / 16

  // Trivial default (members uninitialized; value-initialization zeroes them) so that the layout
  // can sit in kernel-argument structs filled on the host.
  Nvfp4SideLayout() = default;

  KV_HOST_DEVICE Nvfp4SideLayout(const CacheSide& side, int block_size, int num_heads) {
    data_bytes = side.head_size / 2;
    num_groups = side.head_size / kNvfp4GroupSize;
    const int64_t full_dim = data_bytes + num_groups;
    block_stride = side.block_stride;
    token_step = side.token_stride / full_dim;
    head_step = side.head_stride / full_dim;
    scale_region_offset = int64_t(block_size) * num_heads * data_bytes;
  }

  // First data byte of (block, token, head).
  KV_HOST_DEVICE int64_t data_offset(int64_t block, int64_t token, int64_t head) const {
    return block * block_stride + (token * token_step + head * head_step) * data_bytes;
  }

  // Scale byte of group `group` of (block, token, head), placed by the scale layout.
  KV_HOST_DEVICE int64_t scale_offset(int64_t block, int token, int64_t head, int group,
                                      ScaleLayout layout) const {
    int row = token;
    int col = group;
    if (layout == ScaleLayout::kInterleave4)
      interleave4_position(token, group, num_groups, row, col);
    return block * block_stride + scale_region_offset +
           (row * token_step + head * head_step) * num_groups + col;
  }
};

}  // namespace vllm_kv
