// Prefill on the bf16 dot, blocked (AVX-512 BF16 builds): many query rows per KV head meet each
// page, so its keys and values are decoded once per page into the operand layouts of vdpbf16ps
// and every row reuses them, as a GEMM reuses a packed panel.
//
// Keys, 16 per tile: word j of lane t is the bf16 pair (k[t][2j], k[t][2j + 1]), so that one
// vdpbf16ps of a broadcast query pair accumulates 16 keys' scores in 16 lanes (no lane sums to
// fold). Values, per key pair (t, t + 1) and 16 dimensions: word i is (v[t][i], v[t + 1][i]),
// broadcast to meet the two keys' softmax weights of 16 query rows (lane r: row r's pair,
// rounded to bf16, the decode path's rounding), so that the value sums, too, take one vdpbf16ps
// per broadcast with 16 rows' sums in the lanes. Per-token-head row scales multiply the scores
// and the weights, as in Bf16Dot. Slots of a page outside the attended keys are packed as zeros,
// so that their bytes (whatever a page's tail holds) never reach a sum; within them, a row
// takes no product of a key outside its own range (a write mask; 0 x Inf would be NaN).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cache_kernels.h"
#include "cpu/attention_bf16.h"
#include "cpu/attention_simd.h"
#include "cpu/attention_tile.h"

namespace vllm_kv::cpu::attention {

#if defined(VLLM_KV_HAVE_AVX512_BF16)

template <CacheKind K>
class Bf16PrefillPage {
 public:
  static constexpr SimdLevel L = SimdLevel::kAvx512;
  static constexpr int kTileKeys = 16;
  // Query rows per block: the lanes of the transposed value sums.
  static constexpr int kRowLanes = 16;
  using V = VecF<L>;
  using Dot = Bf16Dot<K>;

  Bf16PrefillPage() = default;
  explicit Bf16PrefillPage(const RowShape& shape) : s_(shape) {}

  // Packs tokens [lo, hi) of a page (rows / scales as located by PagedAttention::locate_page;
  // groups: each side's NVFP4 group offsets) into per-thread panels; tiles cover [0, hi).
  void pack(const uint8_t* const* k_rows, const uint8_t* const* k_scales, const int64_t* k_groups,
            const uint8_t* const* v_rows, const uint8_t* const* v_scales, const int64_t* v_groups,
            int lo, int hi) {
    const int tiles = (hi + kTileKeys - 1) / kTileKeys;
    const int k_words = s_.head_size / 2;
    const int v_blocks = s_.head_size_v / kLanes<L>;
    keys_ = aligned(key_store_, size_t(tiles) * k_words * kTileKeys);
    values_ = aligned(value_store_, size_t(tiles) * (kTileKeys / 2) * v_blocks * kLanes<L>);
    key_scales_ = aligned(key_scale_store_, size_t(tiles) * kTileKeys);
    value_scales_ = aligned(value_scale_store_, size_t(tiles) * kTileKeys);
    pairs_ = tiles * kTileKeys / 2;
    weight_panel_ =
        aligned(weight_store_, size_t(pairs_ + kLanes<L> - 1) / kLanes<L> * kLanes<L> * kRowLanes);
    pair_masks_ = aligned(mask_store_, size_t(3) * pairs_);
    split_pairs_ = aligned(split_store_, size_t(pairs_));
    uint16_t* k_tile = aligned(row_store_, size_t(2) * kTileKeys * kMaxHeadSize);
    uint16_t* v_tile = k_tile + kTileKeys * kMaxHeadSize;
    for (int tile = 0; tile < tiles; ++tile) {
      // The tile's rows in bf16 (stride kMaxHeadSize), zero outside [lo, hi).
      for (int lane = 0; lane < kTileKeys; ++lane) {
        const int t = tile * kTileKeys + lane;
        const bool attended = t >= lo && t < hi;
        bf16_row(attended ? k_rows[t] : nullptr, attended ? k_scales[t] : nullptr, k_groups,
                 s_.head_size, k_tile + lane * kMaxHeadSize);
        bf16_row(attended ? v_rows[t] : nullptr, attended ? v_scales[t] : nullptr, v_groups,
                 s_.head_size_v, v_tile + lane * kMaxHeadSize);
        key_scales_[t] = attended ? row_scale(k_rows[t], s_.head_size) : 0.0f;
        value_scales_[t] = attended ? row_scale(v_rows[t], s_.head_size_v) : 0.0f;
      }
      // Keys: 16 words of every row at a time, transposed so that lanes are keys.
      uint32_t* key_panel = keys_ + size_t(tile) * k_words * kTileKeys;
      for (int j0 = 0; j0 < k_words; j0 += kTileKeys) {
        __m512i column[kTileKeys];
        for (int lane = 0; lane < kTileKeys; ++lane) {
          column[lane] = _mm512_load_si512(k_tile + lane * kMaxHeadSize + 2 * j0);
        }
        transpose_16x16(column);
        for (int j = 0; j < kTileKeys; ++j) {
          _mm512_store_si512(key_panel + (j0 + j) * kTileKeys, column[j]);
        }
      }
      // Values: rows 2p and 2p + 1 interleaved element by element, 32 elements (two blocks) at a
      // time.
      for (int p = 0; p < kTileKeys / 2; ++p) {
        uint32_t* panel = values_ + (size_t(tile) * (kTileKeys / 2) + p) * v_blocks * kLanes<L>;
        for (int d = 0; d < s_.head_size_v; d += 32) {
          const __m512i x = _mm512_load_si512(v_tile + 2 * p * kMaxHeadSize + d);
          const __m512i y = _mm512_load_si512(v_tile + (2 * p + 1) * kMaxHeadSize + d);
          _mm512_store_si512(panel + d, interleave_pairs<0>(x, y));
          _mm512_store_si512(panel + d + kLanes<L>, interleave_pairs<1>(x, y));
        }
      }
    }
  }

  // The page's part of the softmax of one KV head's rows (query token j: rows j * group ..
  // (j + 1) * group - 1 of q / scores / m / l / acc; ranges[j]: its key positions, lo / hi: the
  // page's attended offsets, page_start: its first position). Scores come for blocks of
  // kBlockRows rows over the union of their tokens' ranges, then per token
  // finish(scores, b, e, q_pos) (soft cap, ALiBi), the softmax step and the values.
  template <typename Finish>
  void attend(const std::vector<std::pair<int, int>>& ranges, int lo, int hi, int page_start,
              int first_q_pos, const uint16_t* q, float q_scale, float* scores, float* m, float* l,
              float* acc, const Finish& finish) const {
    const int tokens = int(ranges.size());
    const int group = s_.group;
    const int per_block = std::max(1, kRowLanes / group);
    const auto page_range = [&](int jt) {
      return std::pair{std::max(ranges[jt].first - page_start, lo),
                       std::min(ranges[jt].second - page_start, hi)};
    };
    for (int j0 = 0; j0 < tokens; j0 += per_block) {
      const int j1 = std::min(tokens, j0 + per_block);
      int ub = hi;
      int ue = lo;
      for (int jt = j0; jt < j1; ++jt) {
        const auto [b, e] = page_range(jt);
        if (b < e) ub = std::min(ub, b), ue = std::max(ue, e);
      }
      if (ub >= ue) continue;
      const int r0 = j0 * group;
      score(q + int64_t(r0) * s_.dim_k, (j1 - j0) * group, ub, ue, scores + int64_t(r0) * s_.tokens,
            q_scale);
      for (int jt = j0; jt < j1; ++jt) {
        const auto [b, e] = page_range(jt);
        if (b >= e) continue;
        const int r = jt * group;
        finish(scores + int64_t(r) * s_.tokens, b, e, first_q_pos + jt);
        for (int g = 0; g < group; ++g) {
          TileMath<L>::softmax_step(s_, scores + int64_t(r + g) * s_.tokens, b, e, m[r + g],
                                    l[r + g], acc + int64_t(r + g) * s_.dim_v);
        }
      }
      // The block's rows kRowLanes at a time, row r's keys its token's.
      for (int r = r0; r < j1 * group; r += kRowLanes) {
        const int n = std::min(kRowLanes, j1 * group - r);
        alignas(64) int32_t begin[kRowLanes] = {};
        alignas(64) int32_t end[kRowLanes] = {};
        for (int i = 0; i < n; ++i) {
          const auto [b, e] = page_range((r + i) / group);
          begin[i] = b;
          end[i] = e;
        }
        accumulate(scores + int64_t(r) * s_.tokens, n, begin, end, ub, ue,
                   acc + int64_t(r) * s_.dim_v);
      }
    }
  }

  // scores[r][t] = q_scale * key scale * (q_r . k_t) for `rows` rows (bf16 query rows of stride
  // dim_k, score rows of stride tokens) and the tiles covering keys [b, e) (scores outside [b, e)
  // within those tiles are written too; the softmax step masks them).
  void score(const uint16_t* q, int rows, int b, int e, float* scores, float q_scale) const {
    int r = 0;
    for (; r + 8 <= rows; r += 8) score_rows<8>(q, r, b, e, scores, q_scale);
    for (; r + 4 <= rows; r += 4) score_rows<4>(q, r, b, e, scores, q_scale);
    for (; r < rows; ++r) score_rows<1>(q, r, b, e, scores, q_scale);
  }

  // acc[r] += sum over keys t in [begin[r], end[r]) of weights[r][t] * v_t for rows r < n <=
  // kRowLanes (weight rows of stride tokens, accumulator rows of stride dim_v), the keys within
  // [ub, ue). Transposed, lanes = rows: a pair of keys' weights for all rows (one load) meets each
  // dimension's broadcast value pair, as the scores meet the key panel. A lane takes a pair only
  // where its row attends both keys (a write mask: the keys it does not attend never reach its
  // sum, 0 x Inf would be NaN); a row attending one key of a pair takes that key alone.
  void accumulate(const float* weights, int n, const int32_t* begin, const int32_t* end, int ub,
                  int ue, float* acc) const {
    const int pb = ub / 2;
    const int pe = (ue + 1) / 2;
    const int v_blocks = s_.head_size_v / kLanes<L>;
    uint32_t* panel = weight_panel_;
    uint16_t* both = pair_masks_;
    // The pairs some row takes one key of (splits of them), and the rows taking each key.
    uint16_t* first = both + pairs_;
    uint16_t* second = first + pairs_;
    int32_t* split_pairs = split_pairs_;
    int splits = 0;
    const __m512i b = _mm512_load_si512(begin);
    const __m512i e = _mm512_load_si512(end);
    for (int p = pb; p < pe; ++p) {
      const __m512i k0 = _mm512_set1_epi32(2 * p);
      const __m512i k1 = _mm512_set1_epi32(2 * p + 1);
      const __mmask16 in0 = _mm512_cmple_epi32_mask(b, k0) & _mm512_cmplt_epi32_mask(k0, e);
      const __mmask16 in1 = _mm512_cmple_epi32_mask(b, k1) & _mm512_cmplt_epi32_mask(k1, e);
      both[p] = in0 & in1;
      if (in0 != in1) {
        first[splits] = in0 & ~in1;
        second[splits] = in1 & ~in0;
        split_pairs[splits++] = p;
      }
    }
    // The weight panel: pair p's words (w[r][2p], w[r][2p + 1]) in bf16, lane r, 16 pairs at a
    // time (32 keys of every row, transposed).
    for (int p0 = pb - pb % kLanes<L>; p0 < pe; p0 += kLanes<L>) {
      const int t0 = 2 * p0;
      // (No weights or scales past the packed tiles' keys.)
      const __mmask16 lo_keys = tail_mask(2 * pairs_ - t0);
      const __mmask16 hi_keys = tail_mask(2 * pairs_ - t0 - kLanes<L>);
      const V scale_lo = _mm512_maskz_loadu_ps(lo_keys, value_scales_ + t0);
      const V scale_hi = _mm512_maskz_loadu_ps(hi_keys, value_scales_ + t0 + kLanes<L>);
      __m512i rows[kRowLanes];
      for (int i = 0; i < kRowLanes; ++i) {
        if (i >= n) {
          rows[i] = _mm512_setzero_si512();
          continue;
        }
        const float* w = weights + int64_t(i) * s_.tokens + t0;
        const V lo = _mm512_maskz_loadu_ps(lo_keys, w) * scale_lo;
        const V hi = _mm512_maskz_loadu_ps(hi_keys, w + kLanes<L>) * scale_hi;
        rows[i] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      }
      transpose_16x16(rows);
      for (int j = 0; j < kLanes<L>; ++j) {
        _mm512_store_si512(panel + (p0 + j) * kRowLanes, rows[j]);
      }
    }
    for (int c = 0; c < v_blocks; ++c) {
      // The rows' accumulators of dimensions 16c .. 16c + 15, transposed: sums[j] lane r is
      // acc[r][16c + j].
      __m512i sums[kLanes<L>];
      for (int i = 0; i < kRowLanes; ++i) {
        sums[i] = i < n ? _mm512_loadu_si512(acc + int64_t(i) * s_.dim_v + c * kLanes<L>)
                        : _mm512_setzero_si512();
      }
      transpose_16x16(sums);
      __m512 a[kLanes<L>];
      for (int j = 0; j < kLanes<L>; ++j) a[j] = (__m512)sums[j];
      for (int p = pb; p < pe; ++p) {
        const auto w = (__m512bh)_mm512_load_si512(panel + p * kRowLanes);
        const uint32_t* v = values_ + (size_t(p) * v_blocks + c) * kLanes<L>;
        if (both[p] == 0xFFFF) {
          for (int j = 0; j < kLanes<L>; ++j) {
            a[j] = _mm512_dpbf16_ps(a[j], w, (__m512bh)_mm512_set1_epi32(int(v[j])));
          }
        } else {
          for (int j = 0; j < kLanes<L>; ++j) {
            a[j] = _mm512_mask_dpbf16_ps(a[j], both[p], w, (__m512bh)_mm512_set1_epi32(int(v[j])));
          }
        }
      }
      // Rows that attend one key of a pair (a range's edge) take that key's product alone.
      for (int i = 0; i < splits; ++i) {
        const int p = split_pairs[i];
        const auto w = (__m512bh)_mm512_load_si512(panel + p * kRowLanes);
        const uint32_t* v = values_ + (size_t(p) * v_blocks + c) * kLanes<L>;
        for (int j = 0; j < kLanes<L>; ++j) {
          const auto key0 = (__m512bh)_mm512_set1_epi32(int(v[j] & 0xFFFFu));
          const auto key1 = (__m512bh)_mm512_set1_epi32(int(v[j] & 0xFFFF0000u));
          a[j] = _mm512_mask_dpbf16_ps(a[j], first[i], w, key0);
          a[j] = _mm512_mask_dpbf16_ps(a[j], second[i], w, key1);
        }
      }
      for (int j = 0; j < kLanes<L>; ++j) sums[j] = (__m512i)a[j];
      transpose_16x16(sums);
      for (int i = 0; i < n; ++i) {
        _mm512_storeu_si512(acc + int64_t(i) * s_.dim_v + c * kLanes<L>, sums[i]);
      }
    }
  }

  // Takes `shape` (a new call's), keeping the panels' storage.
  void reshape(const RowShape& shape) { s_ = shape; }

  // Largest head size the packing takes (its row buffer).
  static constexpr int kMaxHeadSize = 1024;

 private:
  // A row of a side as head_size bf16 values (exact: Bf16Dot::row_bf16); zeros for no row.
  static void bf16_row(const uint8_t* row, const uint8_t* scales, const int64_t* groups,
                       int head_size, uint16_t* out) {
    for (int d = 0; d < head_size; d += 32) {
      _mm512_store_si512(
          out + d, row == nullptr ? _mm512_setzero_si512() : Dot::row_bf16(row, scales, groups, d));
    }
  }

  static float row_scale(const uint8_t* row, int head_size) {
    if constexpr (is_per_token_head(K)) {
      return per_token_head_row_scale(row, head_size);
    } else {
      return 1.0f;
    }
  }

  template <int kRows>
  void score_rows(const uint16_t* q, int r0, int b, int e, float* scores, float q_scale) const {
    const int k_words = s_.head_size / 2;
    for (int tile = b / kTileKeys; tile * kTileKeys < e; ++tile) {
      const uint32_t* panel = keys_ + size_t(tile) * k_words * kTileKeys;
      __m512 sum[kRows];
      for (int i = 0; i < kRows; ++i) sum[i] = _mm512_setzero_ps();
      for (int j = 0; j < k_words; ++j) {
        const auto keys = (__m512bh)_mm512_load_si512(panel + j * kTileKeys);
        for (int i = 0; i < kRows; ++i) {
          sum[i] = dot_pair(sum[i], keys, q + int64_t(r0 + i) * s_.dim_k + 2 * j);
        }
      }
      const V scale = splat<L>(q_scale) * load<L>(key_scales_ + tile * kTileKeys);
      for (int i = 0; i < kRows; ++i) {
        store<L>(scores + int64_t(r0 + i) * s_.tokens + tile * kTileKeys, V(sum[i]) * scale);
      }
    }
  }

  // Lanes 0 .. count - 1 (all for count >= 16, none for count <= 0).
  static __mmask16 tail_mask(int count) {
    return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max(count, 0)) - 1);
  }

  // n elements of `store` from a 64-byte boundary on (store grown as needed).
  template <typename T>
  static T* aligned(std::vector<T>& store, size_t n) {
    constexpr size_t kPad = 64 / sizeof(T);
    if (store.size() < n + kPad) store.resize(n + kPad);
    T* first = store.data();
    return first + (kPad - reinterpret_cast<uintptr_t>(first) / sizeof(T) % kPad) % kPad;
  }

  RowShape s_{};
  std::vector<uint32_t> key_store_;
  std::vector<uint32_t> value_store_;
  std::vector<float> key_scale_store_;
  std::vector<float> value_scale_store_;
  std::vector<uint16_t> row_store_;  // a tile's rows of both sides in bf16
  std::vector<uint32_t> weight_store_;
  std::vector<uint16_t> mask_store_;
  std::vector<int32_t> split_store_;
  // The page's panels, within the stores.
  uint32_t* keys_ = nullptr;
  uint32_t* values_ = nullptr;
  float* key_scales_ = nullptr;
  float* value_scales_ = nullptr;
  // accumulate's scratch: the weight panel (pairs_ rounded up to 16, by kRowLanes), the pair
  // masks (3 x pairs_) and the split pairs (pairs_).
  uint32_t* weight_panel_ = nullptr;
  uint16_t* pair_masks_ = nullptr;
  int32_t* split_pairs_ = nullptr;
  int pairs_ = 0;
};

#endif  // VLLM_KV_HAVE_AVX512_BF16

}  // namespace vllm_kv::cpu::attention
