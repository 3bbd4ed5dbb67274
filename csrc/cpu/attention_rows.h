// Row input / output of the CPU attention kernels: query rows in, finished rows out (softmax
// denominator, sinks, V scale) and the merge of split items' partials.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_kernels.h"
#include "cache_kernels.h"
#include "cpu/attention_plan.h"
#include "kv_quant_math.h"
#include "per_token_head.h"

namespace vllm_kv::cpu::attention {

// out[index + d] = src[d] * factor for d < n, in the output type (bf16: round to nearest even).
// One type switch per row, not per element.
inline void store_output_row(void* out, int64_t index, SourceType type, const float* src,
                             float factor, int n) {
  switch (type) {
    case SourceType::kFloat32:
      for (int d = 0; d < n; ++d) static_cast<float*>(out)[index + d] = src[d] * factor;
      return;
    case SourceType::kBFloat16:
      for (int d = 0; d < n; ++d) {
        static_cast<uint16_t*>(out)[index + d] = float_to_bf16_bits(src[d] * factor);
      }
      return;
    case SourceType::kFloat16:
      for (int d = 0; d < n; ++d) {
        const _Float16 h = static_cast<_Float16>(src[d] * factor);
        std::memcpy(static_cast<uint16_t*>(out) + index + d, &h, 2);
      }
      return;
  }
}

// dst[d] = query[index + d] * factor for d < n (one type switch per row).
inline void load_query_row(const void* query, int64_t index, SourceType type, float factor, int n,
                           float* dst) {
  switch (type) {
    case SourceType::kFloat32:
      for (int d = 0; d < n; ++d) dst[d] = static_cast<const float*>(query)[index + d] * factor;
      return;
    case SourceType::kBFloat16:
    case SourceType::kFloat16:
      for (int d = 0; d < n; ++d) {
        const uint16_t bits = static_cast<const uint16_t*>(query)[index + d];
        dst[d] =
            (type == SourceType::kBFloat16 ? bf16_bits_to_float(bits) : fp16_bits_to_float(bits)) *
            factor;
      }
      return;
  }
}

// The per-tensor / per-head scale of a side; 1 without one (unquantized caches, and per-token-head
// rows, int4 ones included, and packed slots, whose scales the decoder applies).
inline float side_scale(const CacheSide& side, int head, CacheKind kind) {
  if (kind == CacheKind::kUnquantized || is_per_token_head(kind) ||
      kind == CacheKind::kInt4PerTokenHead || kind == kPackedSlotKind) {
    return 1.0f;
  }
  return side.scale[side.scale_per_head ? head : 0];
}

// The logits soft cap, then the ALiBi bias (each if any), on scores [b, e) (page offsets: keys
// at positions page_start + t) of the `group` rows (`row_stride` floats apart) of the query token
// at position q_pos.
inline void finish_scores(const PagedAttentionParams& p, int group, int64_t row_stride,
                          float* scores, int b, int e, int kv_head, int q_pos, int page_start) {
  if (p.logits_soft_cap > 0.0f) {
    const float cap = p.logits_soft_cap;
    for (int g = 0; g < group; ++g) {
      float* s = scores + g * row_stride;
      for (int t = b; t < e; ++t) s[t] = cap * std::tanh(s[t] / cap);
    }
  }
  if (p.alibi_slopes == nullptr) return;
  for (int g = 0; g < group; ++g) {
    const float slope = p.alibi_slopes[kv_head * group + g];
    float* s = scores + g * row_stride;
    for (int t = b; t < e; ++t) s[t] += slope * float(page_start + t - q_pos);
  }
}

// Writes the finished rows of one item: out = acc / l (softmax with the sink logit of each query
// head in the denominator) times the V scale.
inline void finish_rows(const PagedAttentionParams& p, const AttentionGeometry& geo, int seq,
                        int kv_begin, int kv_end, int q_begin, int q_end, const float* m,
                        const float* l, const float* acc, int64_t acc_stride) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int r = 0;
  for (int kv_head = kv_begin; kv_head < kv_end; ++kv_head) {
    const float v_scale = side_scale(p.value_cache, kv_head, p.cache_kind);
    for (int j = q_begin; j < q_end; ++j) {
      for (int g = 0; g < geo.group; ++g, ++r) {
        const int head = kv_head * geo.group + g;
        float sum = l[r];
        float factor = 1.0f;  // weight of the accumulator
        if (p.sinks != nullptr) {
          const float sink = p.sinks[head];
          const float top = std::max(m[r], sink);
          factor = m[r] == neg_inf ? 0.0f : std::exp(m[r] - top);
          sum = sum * factor + std::exp(sink - top);
        }
        const float weight = sum > 0.0f ? factor / sum * v_scale : 0.0f;
        const int64_t out_base = int64_t(p.query_start_loc[seq] + j) * p.out_token_stride +
                                 int64_t(head) * p.out_head_stride;
        const float* a = acc + r * acc_stride;
        store_output_row(p.out, out_base, p.io_type, a, weight, geo.head_size_v);
      }
    }
  }
}

// Merges the partials of split items (log-sum-exp weights) and writes the rows.
inline void merge_partials(const PagedAttentionParams& p, const MergeItem& item,
                           const float* scratch) {
  const AttentionGeometry geo(p);
  const int rows = (item.kv_end - item.kv_begin) * (item.q_end - item.q_begin) * geo.group;
  const int row_floats = geo.partial_row_floats();
  const int64_t split_stride = int64_t(rows) * row_floats;
  std::vector<float> m(rows), l(rows), acc(int64_t(rows) * geo.head_size_v);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < rows; ++r) {
    float top = neg_inf;
    for (int s = 0; s < item.num_splits; ++s) {
      top = std::max(top, scratch[item.partial + s * split_stride + r * row_floats]);
    }
    float sum = 0.0f;
    float* a = acc.data() + int64_t(r) * geo.head_size_v;
    std::fill(a, a + geo.head_size_v, 0.0f);
    for (int s = 0; s < item.num_splits; ++s) {
      const float* part = scratch + item.partial + s * split_stride + r * row_floats;
      if (part[0] == neg_inf) continue;
      const float w = std::exp(part[0] - top);
      sum += part[1] * w;
      for (int d = 0; d < geo.head_size_v; ++d) a[d] += part[2 + d] * w;
    }
    m[r] = top;
    l[r] = sum;
  }
  finish_rows(p, geo, item.seq, item.kv_begin, item.kv_end, item.q_begin, item.q_end, m.data(),
              l.data(), acc.data(), geo.head_size_v);
}

}  // namespace vllm_kv::cpu::attention
