// Prefill on the bf16 dot, blocked (AVX-512 BF16 builds): many query rows per KV head meet each
// page, so its keys and values are decoded once per page into the operand layouts of vdpbf16ps
// and every row reuses them, as a GEMM reuses a packed panel.
//
// Keys, 16 per tile: word j of lane t is the bf16 pair (k[t][2j], k[t][2j + 1]), so that one
// vdpbf16ps of a broadcast query pair accumulates 16 keys' scores in 16 lanes (no lane sums to
// fold). Values, per key pair (t, t + 1) and 16 dimensions: lane i holds (v[t][i], v[t + 1][i]),
// met by the broadcast pair of the two keys' softmax weights rounded to bf16 (the decode path's
// rounding). Per-token-head row scales multiply the scores and the weights, as in Bf16Dot.
// Slots of a page outside the attended keys are packed as zeros, so that their bytes (whatever a
// page's tail holds) never reach a sum; within them, a row's keys outside its own range get
// weight 0 and a pair straddling the range's edge drops its outside half (0 x Inf would be NaN).
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
    constexpr int kBlockRows = 8;
    const int tokens = int(ranges.size());
    const int group = s_.group;
    const int per_block = std::max(1, kBlockRows / group);
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
        accumulate(scores + int64_t(r) * s_.tokens, group, b, e, acc + int64_t(r) * s_.dim_v);
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

  // acc[r] += sum over keys t in [b, e) of weights[r][t] * v_t, for `rows` rows (weight rows of
  // stride tokens, accumulator rows of stride dim_v).
  void accumulate(const float* weights, int rows, int b, int e, float* acc) const {
    // Four 16-dimension blocks per pass (kRows x 4 chains) where the head size allows, else two.
    if (s_.head_size_v % (4 * kLanes<L>) == 0) {
      accumulate_blocks<4>(weights, rows, b, e, acc);
    } else {
      accumulate_blocks<2>(weights, rows, b, e, acc);
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

  template <int kBlocks>
  void accumulate_blocks(const float* weights, int rows, int b, int e, float* acc) const {
    int r = 0;
    for (; r + 4 <= rows; r += 4) accumulate_rows<4, kBlocks>(weights, r, b, e, acc);
    for (; r < rows; ++r) accumulate_rows<1, kBlocks>(weights, r, b, e, acc);
  }

  template <int kRows, int kBlocks>
  void accumulate_rows(const float* weights, int r0, int b, int e, float* acc) const {
    const int v_blocks = s_.head_size_v / kLanes<L>;
    for (int c0 = 0; c0 < v_blocks; c0 += kBlocks) {
      constexpr int blocks = kBlocks;
      __m512 a[kRows][kBlocks];
      for (int i = 0; i < kRows; ++i) {
        for (int c = 0; c < blocks; ++c) {
          a[i][c] = _mm512_loadu_ps(acc + int64_t(r0 + i) * s_.dim_v + (c0 + c) * kLanes<L>);
        }
      }
      for (int tile = b / kTileKeys; tile * kTileKeys < e; ++tile) {
        const int t0 = tile * kTileKeys;
        const int tb = std::max(b, t0);
        const int te = std::min(e, t0 + kTileKeys);
        // Row i's weights of the tile's keys in bf16, zero outside [tb, te): pair p is pairs[i][p].
        alignas(32) uint32_t pairs[kRows][kTileKeys / 2];
        const __mmask16 valid = __mmask16(((1u << (te - t0)) - 1) & ~((1u << (tb - t0)) - 1));
        const V scales = load<L>(value_scales_ + t0);
        for (int i = 0; i < kRows; ++i) {
          const __m512 w =
              _mm512_maskz_loadu_ps(valid, weights + int64_t(r0 + i) * s_.tokens + t0) * scales;
          _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[i]), (__m256i)_mm512_cvtneps_pbh(w));
        }
        for (int p = (tb - t0) / 2; p < (te - t0 + 1) / 2; ++p) {
          // The half of a pair outside [tb, te) is dropped from the values, not only weighted 0.
          const __mmask32 keep =
              (2 * p < tb - t0 ? 0xAAAAAAAAu : ~0u) & (2 * p + 1 >= te - t0 ? 0x55555555u : ~0u);
          const uint32_t* panel =
              values_ + ((size_t(tile) * (kTileKeys / 2) + p) * v_blocks + c0) * kLanes<L>;
          __m512bh w[kRows];
          for (int i = 0; i < kRows; ++i) w[i] = (__m512bh)_mm512_set1_epi32(int(pairs[i][p]));
          for (int c = 0; c < blocks; ++c) {
            const auto v =
                (__m512bh)_mm512_maskz_mov_epi16(keep, _mm512_load_si512(panel + c * kLanes<L>));
            for (int i = 0; i < kRows; ++i) a[i][c] = _mm512_dpbf16_ps(a[i][c], v, w[i]);
          }
        }
      }
      for (int i = 0; i < kRows; ++i) {
        for (int c = 0; c < blocks; ++c) {
          _mm512_storeu_ps(acc + int64_t(r0 + i) * s_.dim_v + (c0 + c) * kLanes<L>, a[i][c]);
        }
      }
    }
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
  // The page's panels, within the stores.
  uint32_t* keys_ = nullptr;
  uint32_t* values_ = nullptr;
  float* key_scales_ = nullptr;
  float* value_scales_ = nullptr;
};

#endif  // VLLM_KV_HAVE_AVX512_BF16

}  // namespace vllm_kv::cpu::attention
