// The tile math of the CPU attention kernels, whatever the format: the scores of a group of query
// rows against a page's keys, the online-softmax step, and the weighted sum of a page's values.
// Keys and values come from a source (t, d) -> vector d of key / value t: a decoded fp32 tile, or
// a cache row decoded in registers (the fused path).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/attention_simd.h"

namespace vllm_kv::cpu::attention {

// Row strides (floats) of one work item's buffers and the head geometry they hold.
struct RowShape {
  int group;        // query heads per KV head
  int head_size;    // K elements
  int head_size_v;  // V elements
  int dim_k;        // head_size rounded up to whole vectors (tile and query row stride)
  int dim_v;        // head_size_v rounded up (tile and accumulator row stride)
  int tokens;       // block_size rounded up (score row stride)
};

// Rows per KV head up to which an item decodes in registers (fused).
inline constexpr int kMaxFusedRows = 8;

template <SimdLevel L>
struct TileMath {
  static constexpr int kLanes = attention::kLanes<L>;
  using V = VecF<L>;

  // Tokens are taken kLanes at a time: per token, a vector of partial dot products per row,
  // then one transposing reduction per row gives the kLanes scores (instead of a horizontal sum
  // per token and row). Two tokens per pass when the rows are few, so that enough independent
  // FMA chains are in flight.
  template <int kRows, typename Keys>
  static void score_chunk(const RowShape& s, const Keys& key_vector, const float* q, int b, int e,
                          float* scores, int g0) {
    constexpr int kTokens = kRows <= 4 ? 2 : 1;
    V part[kRows][kLanes];
    for (int t0 = b - b % kLanes; t0 < e; t0 += kLanes) {
      const int tb = std::max(b, t0);
      const int te = std::min(e, t0 + kLanes);
      const bool whole = tb == t0 && te == t0 + kLanes;
      if (!whole) {
        for (int i = 0; i < kRows; ++i) std::fill(part[i], part[i] + kLanes, V{});
      }
      int t = tb;
      for (; t + kTokens <= te; t += kTokens) {
        V sum[kTokens][kRows] = {};
        for (int d = 0; d < s.dim_k; d += kLanes) {
          V kv[kTokens];
          for (int x = 0; x < kTokens; ++x) kv[x] = key_vector(t + x, d);
          for (int i = 0; i < kRows; ++i) {
            const V qv = load<L>(q + int64_t(g0 + i) * s.dim_k + d);
            for (int x = 0; x < kTokens; ++x) sum[x][i] = fmadd<L>(qv, kv[x], sum[x][i]);
          }
        }
        for (int x = 0; x < kTokens; ++x) {
          for (int i = 0; i < kRows; ++i) part[i][t + x - t0] = sum[x][i];
        }
      }
      for (; t < te; ++t) {
        V sum[kRows] = {};
        for (int d = 0; d < s.dim_k; d += kLanes) {
          const V kv = key_vector(t, d);
          for (int i = 0; i < kRows; ++i) {
            sum[i] = fmadd<L>(load<L>(q + int64_t(g0 + i) * s.dim_k + d), kv, sum[i]);
          }
        }
        for (int i = 0; i < kRows; ++i) part[i][t - t0] = sum[i];
      }
      for (int i = 0; i < kRows; ++i) {
        // t0 + kLanes <= s.tokens (t0 < block_size, a multiple of kLanes): within the row.
        float* row = scores + int64_t(g0 + i) * s.tokens;
        const V sums = reduce_add_many<kLanes>(part[i]);
        if (whole) {
          store<L>(row + t0, sums);
        } else {
          for (int tt = tb; tt < te; ++tt) row[tt] = sums[tt - t0];
        }
      }
    }
  }

  // Online-softmax update of one row with the scores of keys [b, e) of a page: new max, rescale
  // of the running sum and accumulator, scores replaced by their weights exp(s - max). The
  // lanes outside [b, e) of the vectors touched are set to -inf first (weight 0).
  static void softmax_step(const RowShape& shape, float* s, int b, int e, float& m, float& l,
                           float* acc) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int vb = b - b % kLanes;
    const int ve = (e + kLanes - 1) / kLanes * kLanes;
    std::fill(s + vb, s + b, neg_inf);
    std::fill(s + e, s + ve, neg_inf);
    V top = splat<L>(neg_inf);
    for (int t = vb; t < ve; t += kLanes) top = vmax<L>(top, load<L>(s + t));
    const float page_max = reduce_max<kLanes>(top);
    if (page_max == neg_inf) return;
    const float new_max = std::max(m, page_max);
    V sum = V{};
    for (int t = vb; t < ve; t += kLanes) {
      const V w = vexp<L>(load<L>(s + t) - new_max);
      store<L>(s + t, w);
      sum += w;
    }
    if (new_max != m) {
      const float correction = std::exp(m - new_max);  // 0 for the first keys
      l *= correction;
      const V c = splat<L>(correction);
      for (int d = 0; d < shape.dim_v; d += kLanes) store<L>(acc + d, load<L>(acc + d) * c);
      m = new_max;
    }
    l += reduce_add<kLanes>(sum);
  }

  // Two vectors of the head dimension per pass when the rows are few: enough independent FMA
  // chains in flight.
  template <int kRows, typename Values>
  static void accumulate_chunk(const RowShape& s, const Values& value_vector, const float* weights,
                               int b, int e, float* acc, int g0) {
    constexpr int kVecs = kRows <= 4 ? 2 : 1;
    int d = 0;
    for (; d + kVecs * kLanes <= s.dim_v; d += kVecs * kLanes) {
      V a[kVecs][kRows];
      for (int x = 0; x < kVecs; ++x) {
        for (int i = 0; i < kRows; ++i) {
          a[x][i] = load<L>(acc + int64_t(g0 + i) * s.dim_v + d + x * kLanes);
        }
      }
      for (int t = b; t < e; ++t) {
        V v[kVecs];
        for (int x = 0; x < kVecs; ++x) {
          v[x] = value_vector(t, d + x * kLanes);
        }
        for (int i = 0; i < kRows; ++i) {
          const V w = splat<L>(weights[int64_t(g0 + i) * s.tokens + t]);
          for (int x = 0; x < kVecs; ++x) a[x][i] = fmadd<L>(w, v[x], a[x][i]);
        }
      }
      for (int x = 0; x < kVecs; ++x) {
        for (int i = 0; i < kRows; ++i) {
          store<L>(acc + int64_t(g0 + i) * s.dim_v + d + x * kLanes, a[x][i]);
        }
      }
    }
    for (; d < s.dim_v; d += kLanes) {
      V a[kRows];
      for (int i = 0; i < kRows; ++i) a[i] = load<L>(acc + int64_t(g0 + i) * s.dim_v + d);
      for (int t = b; t < e; ++t) {
        const V v = value_vector(t, d);
        for (int i = 0; i < kRows; ++i) {
          a[i] = fmadd<L>(splat<L>(weights[int64_t(g0 + i) * s.tokens + t]), v, a[i]);
        }
      }
      for (int i = 0; i < kRows; ++i) store<L>(acc + int64_t(g0 + i) * s.dim_v + d, a[i]);
    }
  }
};

}  // namespace vllm_kv::cpu::attention
