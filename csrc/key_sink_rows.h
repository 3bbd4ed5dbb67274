// Key sink rows (docs/design.md §5.6, §6): the first S keys of every page kept again as FP8 e4m3
// bytes, q = e4m3(clamp(x / scale, -448, 448)) (one IEEE fp32 division, NaN -> 0x7F, ±Inf
// saturating), in a [num_blocks, S, H, D] byte region that the cache writers fill in the same pass
// as the page (vllm.kv_quant.key_sinks.write_key_sinks is the reference). Shared by the CPU and
// CUDA writers; framework-free.
#pragma once

#include <cstdint>

#include "kv_quant_math.h"

namespace vllm_kv {

// Where the sink rows go; rows == 0 when the call has none (data is then unused).
struct KeySinkRows {
  uint8_t* data;  // row (block, token, head) at block * block_stride + token * token_stride + ...
  int64_t block_stride;  // bytes
  int64_t token_stride;
  int64_t head_stride;
  int rows;            // S in [1, block_size]: page rows below S have a sink row
  const float* scale;  // fp32 e4m3 dequantization scale, [1] or [num_heads]
  bool scale_per_head;
};

// Writes elements [first, first + count) of the sink row of (block, row, head), row < s.rows;
// load(i) is element first + i of the key, widened to fp32 exactly.
template <typename Load>
KV_HOST_DEVICE void write_key_sink_row(const KeySinkRows& s, int64_t block, int row, int head,
                                       int first, int count, const Load& load) {
  const float scale = s.scale[s.scale_per_head ? head : 0];
  uint8_t* dst = s.data + block * s.block_stride + int64_t(row) * s.token_stride +
                 int64_t(head) * s.head_stride + first;
  for (int i = 0; i < count; ++i) dst[i] = float_to_e4m3_satfinite(kv_fdiv(load(i), scale));
}

}  // namespace vllm_kv
