// Keys stored before RoPE, rebuilt in the CPU attention kernels' decoded tiles (the slow path for
// correctness): sink keys, the fixed Hadamard rotation, per-head offsets, the forward RoPE.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_kernels.h"
#include "cpu/attention_rows.h"

namespace vllm_kv::cpu::attention {

// x <- c * H x in place (H the Sylvester Hadamard matrix, c = fp32(1 / sqrt(dim))): the
// butterflies and the one multiply of kv_quant/hadamard.py, in its order, so that the result
// is the reference rotation's to the bit.
inline void hadamard_row(float* x, int dim) {
  for (int h = 1; h < dim; h *= 2) {
    for (int i = 0; i < dim; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j];
        const float b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float c = float(1.0 / std::sqrt(double(dim)));  // fp32(1 / sqrt(D)), as torch rounds it
  for (int d = 0; d < dim; ++d) x[d] *= c;
}

// Rebuilds the keys of tile rows [t0, t1) (positions page_start + t of sequence `seq`, KV head
// `head`, decoded by decode_page) from pre-RoPE keys: the sink key or the decoded key times the
// K scale (the reference codec's value), plus the head's offset, then the forward RoPE rotation
// of row `position` of rope_cos_sin. Scalar: this path is for correctness, not speed.
inline void transform_keys(const PagedAttentionParams& p, int seq, int head, int page_start, int t0,
                           int t1, float* tile, int row_stride) {
  const int dim = p.key_cache.head_size;
  const float k_scale = side_scale(p.key_cache, head, p.cache_kind);
  const float* offset = p.key_offset != nullptr ? p.key_offset + int64_t(head) * dim : nullptr;
  const int half = p.rotary_dim / 2;
  for (int t = t0; t < t1; ++t) {
    const int position = page_start + t;
    float* x = tile + int64_t(t) * row_stride;
    if (position < p.num_sink_keys) {
      const int64_t row = (int64_t(seq) * p.num_sink_keys + position) * p.num_kv_heads + head;
      std::memcpy(x, p.sink_keys + row * dim, sizeof(float) * dim);
    } else {
      for (int d = 0; d < dim; ++d) x[d] *= k_scale;
    }
    if (p.key_hadamard) hadamard_row(x, dim);
    if (offset != nullptr) {
      for (int d = 0; d < dim; ++d) x[d] += offset[d];
    }
    if (p.rope_cos_sin == nullptr) continue;
    const float* cos = p.rope_cos_sin + int64_t(position) * p.rotary_dim;
    const float* sin = cos + half;
    for (int i = 0; i < half; ++i) {
      float& a = x[p.rope_is_neox ? i : 2 * i];
      float& b = x[p.rope_is_neox ? i + half : 2 * i + 1];
      const float a0 = a;
      const float b0 = b;
      a = a0 * cos[i] - b0 * sin[i];
      b = b0 * cos[i] + a0 * sin[i];
    }
  }
}

}  // namespace vllm_kv::cpu::attention
