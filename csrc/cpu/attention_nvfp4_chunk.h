// The NVFP4 chunk path of the CPU attention kernels (AVX-512 BF16 builds): NVFP4 pages of head
// size 128 on both sides, attended 16 keys at a time.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "attention_kernels.h"
#include "cache_kernels.h"
#include "cache_layout.h"
#include "cpu/attention_bf16.h"
#include "cpu/attention_decode.h"
#include "cpu/attention_simd.h"
#include "cpu/attention_softmax.h"
#include "cpu/attention_tile.h"
#include "kv_quant_math.h"

namespace vllm_kv::cpu::attention {

#if defined(VLLM_KV_HAVE_AVX512_BF16)

// NVFP4 in chunks of kChunkKeys keys (head size kChunkHeadSize on both sides). E2M1 codes become
// bf16 unscaled (exact) by one vpermw from a register, and the block scales are applied in fp32:
// no per-group table is loaded and no lane sums are folded. Keys: the chunk's rows transposed
// so that lanes are keys, each group's dot products multiplied by the keys' block scales.
// Values: keys in pairs, interleaved element by element, against the softmax weight times the
// key's block scale, rounded to bf16 (as the weights alone are on the other formats' path).
class Nvfp4ChunkAttention {
 public:
  // Keys per chunk, the head size it takes (one 64-byte row of codes per key) and its block-scale
  // groups.
  static constexpr int kChunkKeys = 16;
  static constexpr int kChunkHeadSize = 128;
  static constexpr int kChunkGroups = kChunkHeadSize / kNvfp4GroupSize;
  // Byte offsets of the first eight scale-plane rows of a chunk, from its first.
  using ChunkScaleRows = std::array<int64_t, 8>;
  // Byte g * kChunkKeys + t: where the scale of (key t, group g) is among a chunk's scale-plane
  // rows (kChunkGroups bytes each, concatenated).
  using ChunkScaleSelect = std::array<uint8_t, kChunkGroups * kChunkKeys>;

  static ChunkScaleSelect chunk_scale_select(ScaleLayout layout) {
    ChunkScaleSelect select{};
    for (int g = 0; g < kChunkGroups; ++g) {
      for (int t = 0; t < kChunkKeys; ++t) {
        int row = t;
        int col = g;
        if (layout == ScaleLayout::kInterleave4) interleave4_position(t, g, kChunkGroups, row, col);
        select[g * kChunkKeys + t] = uint8_t(row * kChunkGroups + col);
      }
    }
    return select;
  }

  static ChunkScaleRows chunk_scale_rows(const Nvfp4SideLayout& layout) {
    ChunkScaleRows rows{};
    for (int r = 0; r < 8; ++r) rows[r] = r * layout.token_step * layout.num_groups;
    return rows;
  }

  // Whether a call's pages fit the chunks (head sizes, whole chunks per page).
  static bool fits(int head_size, int head_size_v, int block_size) {
    return head_size == kChunkHeadSize && head_size_v == kChunkHeadSize &&
           block_size % kChunkKeys == 0;
  }

  // Keys stored before RoPE, rebuilt on the chunk's lanes (KeyRebuild's operations in its order,
  // so the reference's bits): the code times its block scale times k_scale, plus offset (head_size
  // values, or nullptr), then RoPE by `rope` (rope_lanes of the chunk; nullptr: none). q: the
  // head's first fp32 query row (softmax scale folded in; row stride dim_k).
  struct RebuiltKeys {
    const float* q;
    float k_scale;
    const float* offset;
    const float* rope;
    int rotary_dim;
    bool neox;
  };

  // Whether a call's key transform can be rebuilt on the lanes: no Hadamard rotation; RoPE over
  // whole 16-position transposes and, neox, pairs of whole bytes. (Sink positions are not: their
  // chunks take the key tile.)
  static bool rebuild_fits(const PagedAttentionParams& p) {
    return !p.key_hadamard && (p.rope_cos_sin == nullptr ||
                               (p.rotary_dim % kChunkKeys == 0 && p.rotary_dim <= kChunkHeadSize &&
                                (!p.rope_is_neox || p.rotary_dim % 4 == 0)));
  }

  // out[i * kChunkKeys + t]: element i of the RoPE table row of position first + t (its cos, then
  // its sin), t clamped into [t_lo, t_hi) (keys outside have no row to read; their lanes are
  // masked later).
  static void rope_lanes(const PagedAttentionParams& p, int first, int t_lo, int t_hi, float* out) {
    for (int i0 = 0; i0 < p.rotary_dim; i0 += kChunkKeys) {
      __m512i rows[kChunkKeys];
      for (int t = 0; t < kChunkKeys; ++t) {
        const int64_t position = first + std::clamp(t, t_lo, t_hi - 1);
        rows[t] = _mm512_loadu_si512(p.rope_cos_sin + position * p.rotary_dim + i0);
      }
      transpose_16x16(rows);
      for (int i = 0; i < kChunkKeys; ++i) {
        _mm512_storeu_si512(out + int64_t(i0 + i) * kChunkKeys, rows[i]);
      }
    }
  }

  Nvfp4ChunkAttention() = default;
  Nvfp4ChunkAttention(const RowShape& shape, const CacheSide& key, const Nvfp4SideLayout& k_layout,
                      const CacheSide& value, const Nvfp4SideLayout& v_layout)
      : s_(shape),
        key_(key),
        value_(value),
        k_layout_(k_layout),
        v_layout_(v_layout),
        k_scale_select_(chunk_scale_select(key.scale_layout)),
        v_scale_select_(chunk_scale_select(value.scale_layout)),
        k_scale_rows_(chunk_scale_rows(k_layout)),
        v_scale_rows_(chunk_scale_rows(v_layout)) {}

  // One chunk (page tokens [t0, t0 + kChunkKeys)) of one KV head for the item's rows of that head:
  // scores, online softmax, values. q / scores / m / l / acc: the head's first row.
  template <typename FinishScores>
  void attend(int64_t block, int page_start, int t0, int kv_head,
              const std::vector<std::pair<int, int>>& ranges, int first_q_pos, int lo, int hi,
              const uint16_t* q, float q_scale, float* scores, float* m, float* l, float* acc,
              const FinishScores& finish_scores, const RebuiltKeys* rebuilt = nullptr) const {
    const int rows = int(ranges.size()) * s_.group;
    __m512 scale[kChunkGroups];
    const Nvfp4Chunk keys = chunk_at(key_, k_layout_, block, t0, kv_head);
    chunk_scales(keys, k_scale_rows_, k_scale_select_, scale);
    int r = 0;
    if (rebuilt != nullptr) {
      for (; r + 4 <= rows; r += 4) {
        score_rebuilt_chunk<4>(keys, scale, *rebuilt, r, scores + int64_t(r) * s_.tokens + t0);
      }
      for (; r < rows; ++r) {
        score_rebuilt_chunk<1>(keys, scale, *rebuilt, r, scores + int64_t(r) * s_.tokens + t0);
      }
    }
    for (; r + 4 <= rows; r += 4) {
      score_nvfp4_chunk<4>(keys, scale, q + int64_t(r) * s_.dim_k, q_scale,
                           scores + int64_t(r) * s_.tokens + t0);
    }
    for (; r < rows; ++r) {
      score_nvfp4_chunk<1>(keys, scale, q + int64_t(r) * s_.dim_k, q_scale,
                           scores + int64_t(r) * s_.tokens + t0);
    }
    __mmask16 valid[kMaxFusedRows];
    const int chunk_lo = std::max(lo, page_start + t0);
    const int chunk_hi = std::min(hi, page_start + t0 + kChunkKeys);
    for (int jt = 0; jt < int(ranges.size()); ++jt) {
      const int b = std::max(ranges[jt].first, chunk_lo) - page_start;
      const int e = std::min(ranges[jt].second, chunk_hi) - page_start;
      const int r0 = jt * s_.group;
      const __mmask16 mask =
          b < e ? __mmask16(((1u << (e - t0)) - 1) & ~((1u << (b - t0)) - 1)) : __mmask16(0);
      for (int g = 0; g < s_.group; ++g) valid[r0 + g] = mask;
      if (b < e) {
        finish_scores(scores + int64_t(r0) * s_.tokens, b, e, kv_head, first_q_pos + jt,
                      page_start);
      }
    }
    const Nvfp4Chunk values = chunk_at(value_, v_layout_, block, t0, kv_head);
    chunk_scales(values, v_scale_rows_, v_scale_select_, scale);
    for (r = 0; r + 4 <= rows; r += 4) {
      __m512 weights[4];
      softmax_chunk<4>(scores + int64_t(r) * s_.tokens + t0, s_.tokens, valid + r, m + r, l + r,
                       acc + int64_t(r) * s_.dim_v, s_.dim_v, weights);
      accumulate_nvfp4_chunk<4>(values, scale, weights, valid + r, acc + int64_t(r) * s_.dim_v);
    }
    for (; r < rows; ++r) {
      __m512 weights[1];
      softmax_chunk<1>(scores + int64_t(r) * s_.tokens + t0, s_.tokens, valid + r, m + r, l + r,
                       acc + int64_t(r) * s_.dim_v, s_.dim_v, weights);
      accumulate_nvfp4_chunk<1>(values, scale, weights, valid + r, acc + int64_t(r) * s_.dim_v);
    }
  }

 private:
  // Where a side's key rows and scale-plane rows of one chunk of one head are.
  struct Nvfp4Chunk {
    const uint8_t* data;    // the chunk's first key row
    int64_t data_step;      // bytes between key rows
    const uint8_t* scales;  // the chunk's first scale-plane row (kChunkGroups bytes per row)
  };

  static Nvfp4Chunk chunk_at(const CacheSide& side, const Nvfp4SideLayout& layout, int64_t block,
                             int t0, int head) {
    const auto* base = static_cast<const uint8_t*>(side.data);
    // The scale plane's rows are the linear layout's entries, whatever the layout puts in them.
    return {base + layout.data_offset(block, t0, head), layout.token_step * layout.data_bytes,
            base + layout.scale_base(block, t0, head, ScaleLayout::kLinear)};
  }

  // scale[g] lane t: block scale of group g of key t, fp32 (exact). The chunk's kChunkKeys
  // scale-plane rows are gathered and permuted by `select` (chunk_scale_select).
  static void chunk_scales(const Nvfp4Chunk& chunk, const ChunkScaleRows& rows,
                           const ChunkScaleSelect& select, __m512 (&scale)[kChunkGroups]) {
    // (The masked and maskz forms of the intrinsics below: GCC 12 warns about the undefined
    // vectors of the plain ones.)
    const __m512i index = _mm512_load_si512(rows.data());
    const __m512i first =
        _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), 0xFF, index, chunk.scales, 1);
    const __m512i second = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), 0xFF, index,
                                                       chunk.scales + 8 * rows[1], 1);
    const __m512i low = _mm512_permutex2var_epi8(first, _mm512_load_si512(select.data()), second);
    const __m512i high =
        _mm512_permutex2var_epi8(first, _mm512_load_si512(select.data() + 64), second);
    const auto to_fp32 = [](__m128i bytes) {
      const __m256i half =
          EntryDecoder<CacheKind::kNvfp4, SourceType::kFloat32,
                       SimdLevel::kAvx512>::e4m3_as_fp16_bits(_mm256_cvtepu8_epi16(bytes));
      return _mm512_mul_ps(_mm512_maskz_cvtph_ps(0xFFFF, half), _mm512_set1_ps(256.0f));
    };
    scale[0] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, low, 0));
    scale[1] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, low, 1));
    scale[2] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, low, 2));
    scale[3] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, low, 3));
    scale[4] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, high, 0));
    scale[5] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, high, 1));
    scale[6] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, high, 2));
    scale[7] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, high, 3));
  }

  // bf16 bits of the E2M1 values, twice: vpermw reads an index's low five bits, so bit 4 (left
  // over from the neighbouring nibble) may be anything.
  static __m512i e2m1_bf16_table() {
    alignas(64) static constexpr auto kTable = [] {
      std::array<uint16_t, 32> bits{};
      for (int i = 0; i < 32; ++i)
        bits[i] = uint16_t(std::bit_cast<uint32_t>(kE2M1Values[i % 16]) >> 16);
      return bits;
    }();
    return _mm512_load_si512(kTable.data());
  }

  // Per 64-bit lane (two keys): the bit offsets of byte k's low and high nibble of each key (the
  // vpmultishiftqb control that puts both nibbles of byte k of a transposed key where vpermw reads
  // its index).
  static __m512i key_nibbles(int k) {
    alignas(64) static constexpr auto kNibbles = [] {
      std::array<std::array<uint8_t, 64>, 4> control{};
      for (int k = 0; k < 4; ++k) {
        for (int b = 0; b < 64; ++b) {
          const int key = (b / 4) % 2;
          const int high = (b / 2) % 2;
          control[k][b] = uint8_t(32 * key + 8 * k + 4 * high);
        }
      }
      return control;
    }();
    return _mm512_load_si512(kNibbles[k].data());
  }

  // The chunk's key rows transposed: column[j] lane t holds bytes [4j, 4j + 4) of key t.
  static void key_columns(const Nvfp4Chunk& chunk, __m512i (&column)[kChunkKeys]) {
    for (int t = 0; t < kChunkKeys; ++t) {
      column[t] = _mm512_loadu_si512(chunk.data + t * chunk.data_step);
    }
    transpose_16x16(column);
  }

  // Lane t word 2t / 2t + 1: the unscaled E2M1 values of elements 2p / 2p + 1 of key t, in bf16.
  static __m512i key_byte(const __m512i (&column)[kChunkKeys], __m512i table, int p) {
    const __m512i index = _mm512_multishift_epi64_epi8(key_nibbles(p % 4), column[p / 4]);
    return _mm512_permutexvar_epi16(index, table);
  }

  // scores[i][t] = q_i . k_t (times q_scale) for the chunk's keys t, kRows query rows (bf16, row
  // stride s_.dim_k). Byte p of every key row holds elements 2p, 2p + 1.
  template <int kRows>
  void score_nvfp4_chunk(const Nvfp4Chunk& chunk, const __m512 (&scale)[kChunkGroups],
                         const uint16_t* q, float q_scale, float* scores) const {
    __m512i column[kChunkKeys];
    key_columns(chunk, column);
    const __m512i table = e2m1_bf16_table();
    __m512 score[kRows];
    for (int i = 0; i < kRows; ++i) score[i] = _mm512_setzero_ps();
    // Unrolled whole: column[] stays in registers.
#pragma GCC unroll 8
    for (int g = 0; g < kChunkGroups; ++g) {
      __m512 sum[kRows];
      for (int i = 0; i < kRows; ++i) sum[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int p = g * kNvfp4GroupSize / 2; p < (g + 1) * kNvfp4GroupSize / 2; ++p) {
        const auto codes = (__m512bh)key_byte(column, table, p);
        for (int i = 0; i < kRows; ++i) sum[i] = dot_pair(sum[i], codes, q + i * s_.dim_k + 2 * p);
      }
      for (int i = 0; i < kRows; ++i) score[i] = _mm512_fmadd_ps(sum[i], scale[g], score[i]);
    }
    for (int i = 0; i < kRows; ++i) {
      _mm512_storeu_ps(scores + int64_t(i) * s_.tokens,
                       _mm512_mul_ps(score[i], _mm512_set1_ps(q_scale)));
    }
  }

  // The same for keys rebuilt on the lanes (RebuiltKeys), rows r0 .. r0 + kRows - 1 of k.q, in
  // fp32 (a rebuilt key is not exact in bf16). Each element: the code in fp32 (its bf16 bits
  // widened), times the block scale (exact), times the K scale, plus the offset; RoPE pairs
  // (neox: bytes p and p + rotary_dim / 4, elements 2p + e and 2p + e + rotary_dim / 2; GPT-J:
  // the two elements of byte p) rotated as KeyRebuild does; then into the rows' sums.
  template <int kRows>
  void score_rebuilt_chunk(const Nvfp4Chunk& chunk, const __m512 (&scale)[kChunkGroups],
                           const RebuiltKeys& k, int r0, float* scores) const {
    __m512i column[kChunkKeys];
    key_columns(chunk, column);
    const __m512i table = e2m1_bf16_table();
    const float* q = k.q + int64_t(r0) * s_.dim_k;
    const __m512 k_scale = _mm512_set1_ps(k.k_scale);
    __m512 score[kRows];
    for (int i = 0; i < kRows; ++i) score[i] = _mm512_setzero_ps();
    // Elements 2p (x[0]) and 2p + 1 (x[1]) of every key, rebuilt up to RoPE.
    const auto byte = [&](int p, __m512(&x)[2]) {
      const __m512i codes = key_byte(column, table, p);
      x[0] = _mm512_castsi512_ps(_mm512_slli_epi32(codes, 16));
      x[1] = _mm512_castsi512_ps(_mm512_and_si512(codes, _mm512_set1_epi32(int(0xFFFF0000u))));
      for (int e = 0; e < 2; ++e) {
        x[e] = _mm512_mul_ps(_mm512_mul_ps(x[e], scale[p / (kNvfp4GroupSize / 2)]), k_scale);
        if (k.offset != nullptr) x[e] = _mm512_add_ps(x[e], _mm512_set1_ps(k.offset[2 * p + e]));
      }
    };
    const auto dot = [&](int d, __m512 x) {
      for (int i = 0; i < kRows; ++i) {
        score[i] = _mm512_fmadd_ps(x, _mm512_set1_ps(q[int64_t(i) * s_.dim_k + d]), score[i]);
      }
    };
    // a, b of a pair by the table's column c: a c - b s, b c + a s.
    const auto rotate = [&](__m512& a, __m512& b, int c) {
      const __m512 cos = _mm512_loadu_ps(k.rope + int64_t(c) * kChunkKeys);
      const __m512 sin = _mm512_loadu_ps(k.rope + int64_t(c + k.rotary_dim / 2) * kChunkKeys);
      const __m512 a0 = a;
      a = _mm512_sub_ps(_mm512_mul_ps(a0, cos), _mm512_mul_ps(b, sin));
      b = _mm512_add_ps(_mm512_mul_ps(b, cos), _mm512_mul_ps(a0, sin));
    };
    const int rotary = k.rope == nullptr ? 0 : k.rotary_dim;
    int p = 0;
    if (k.neox) {
      const int span = rotary / 4;  // bytes between the two elements of a pair
      for (; p < span; ++p) {
        __m512 x[2];
        __m512 y[2];
        byte(p, x);
        byte(p + span, y);
        for (int e = 0; e < 2; ++e) {
          rotate(x[e], y[e], 2 * p + e);
          dot(2 * p + e, x[e]);
          dot(2 * p + e + rotary / 2, y[e]);
        }
      }
      p = rotary / 2;
    } else {
      for (; p < rotary / 2; ++p) {
        __m512 x[2];
        byte(p, x);
        rotate(x[0], x[1], p);
        dot(2 * p, x[0]);
        dot(2 * p + 1, x[1]);
      }
    }
    for (; p < kChunkHeadSize / 2; ++p) {
      __m512 x[2];
      byte(p, x);
      dot(2 * p, x[0]);
      dot(2 * p + 1, x[1]);
    }
    for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(scores + int64_t(i) * s_.tokens, score[i]);
  }

  // acc_i += sum_t w[i][t] v_t over the chunk's keys for kRows rows (weights: row stride s_.tokens;
  // valid[i]: the keys row i attends).
  template <int kRows>
  void accumulate_nvfp4_chunk(const Nvfp4Chunk& chunk, const __m512 (&scale)[kChunkGroups],
                              const __m512 (&weights)[kRows], const __mmask16* valid,
                              float* acc) const {
    // A key pair's values, element by element (dword j of a group: element j of the first key,
    // then of the second), in two steps. kGather: 64-bit lane q of a quad of groups holds byte q
    // of each of the four groups of the first key (bytes 0-3), then of the second (4-7), which
    // are elements 2q and 2q + 1 of each. kNibbles[k]: each word of lane q takes the nibble of
    // group k of the quad that it decodes (vpermw reads an index's low five bits; the fifth,
    // from the neighbouring nibble, is ignored by the doubled table).
    constexpr int kQuads = kChunkGroups / 4;
    alignas(64) static constexpr auto kGather = [] {
      std::array<std::array<uint8_t, 64>, kQuads> index{};
      for (int quad = 0; quad < kQuads; ++quad) {
        for (int b = 0; b < 64; ++b) {
          const int lane = b / 8;
          const int second = (b % 8) / 4;
          const int group = 4 * quad + b % 4;
          index[quad][b] = uint8_t(64 * second + 8 * group + lane);
        }
      }
      return index;
    }();
    alignas(64) static constexpr auto kNibbles = [] {
      std::array<std::array<uint8_t, 64>, 4> control{};
      for (int k = 0; k < 4; ++k) {
        for (int b = 0; b < 64; ++b) {
          const int word = (b / 2) % 4;  // element 2q (words 0, 1) or 2q + 1 (2, 3); key word % 2
          control[k][b] = uint8_t(8 * (4 * (word % 2) + k) + 4 * (word / 2));
        }
      }
      return control;
    }();
    // pairs[g][i][m]: row i's weights of keys 2m, 2m + 1 times their group-g scales, in bf16.
    alignas(32) uint32_t pairs[kChunkGroups][kRows][kChunkKeys / 2];
    __mmask16 keys = 0;
    for (int i = 0; i < kRows; ++i) {
      keys |= valid[i];
      // (Masked: a key outside valid[i] may have any scale byte, NaN included.)
      for (int g = 0; g < kChunkGroups; ++g) {
        _mm256_store_si256(
            reinterpret_cast<__m256i*>(pairs[g][i]),
            (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mul_ps(valid[i], weights[i], scale[g])));
      }
    }
    const __m512i table = e2m1_bf16_table();
    // kGroups groups (whole quads) per pass: each pair of key rows is loaded once for all of
    // them, and the kGroups * kRows accumulators are enough independent vdpbf16ps chains to hide
    // its latency.
    constexpr int kGroups = kRows >= 4 ? 4 : kChunkGroups;
    for (int g0 = 0; g0 < kChunkGroups; g0 += kGroups) {
      __m512 a[kGroups][kRows];
      for (int h = 0; h < kGroups; ++h) {
        for (int i = 0; i < kRows; ++i) {
          a[h][i] = _mm512_loadu_ps(acc + int64_t(i) * s_.dim_v + (g0 + h) * kNvfp4GroupSize);
        }
      }
      for (int pair = 0; pair < kChunkKeys / 2; ++pair) {
        if (((keys >> (2 * pair)) & 3) == 0) continue;
        const __m512i x = _mm512_loadu_si512(chunk.data + 2 * pair * chunk.data_step);
        const __m512i y = _mm512_loadu_si512(chunk.data + (2 * pair + 1) * chunk.data_step);
        __m512i quads[kGroups / 4];
        for (int u = 0; u < kGroups / 4; ++u) {
          quads[u] = _mm512_permutex2var_epi8(x, _mm512_load_si512(kGather[g0 / 4 + u].data()), y);
        }
        for (int h = 0; h < kGroups; ++h) {
          const __m512i index =
              _mm512_multishift_epi64_epi8(_mm512_load_si512(kNibbles[h % 4].data()), quads[h / 4]);
          const auto values = (__m512bh)_mm512_permutexvar_epi16(index, table);
          for (int i = 0; i < kRows; ++i)
            a[h][i] = dot_pair(a[h][i], values, &pairs[g0 + h][i][pair]);
        }
      }
      for (int h = 0; h < kGroups; ++h) {
        for (int i = 0; i < kRows; ++i) {
          _mm512_storeu_ps(acc + int64_t(i) * s_.dim_v + (g0 + h) * kNvfp4GroupSize, a[h][i]);
        }
      }
    }
  }

  RowShape s_{};
  CacheSide key_{};
  CacheSide value_{};
  Nvfp4SideLayout k_layout_{};
  Nvfp4SideLayout v_layout_{};
  alignas(64) ChunkScaleSelect k_scale_select_{};
  alignas(64) ChunkScaleSelect v_scale_select_{};
  alignas(64) ChunkScaleRows k_scale_rows_{};
  alignas(64) ChunkScaleRows v_scale_rows_{};
};

#endif  // VLLM_KV_HAVE_AVX512_BF16

// Whether a call's NVFP4 pages may go through Nvfp4ChunkAttention (false in builds without it).
inline bool nvfp4_chunks_fit([[maybe_unused]] int head_size, [[maybe_unused]] int head_size_v,
                             [[maybe_unused]] int block_size) {
#if defined(VLLM_KV_HAVE_AVX512_BF16)
  return Nvfp4ChunkAttention::fits(head_size, head_size_v, block_size);
#else
  return false;
#endif
}

// Whether a call's keys stored before RoPE may be rebuilt on the chunk lanes (false in builds
// without them).
inline bool nvfp4_rebuild_fits([[maybe_unused]] const PagedAttentionParams& p) {
#if defined(VLLM_KV_HAVE_AVX512_BF16)
  return Nvfp4ChunkAttention::rebuild_fits(p);
#else
  return false;
#endif
}

}  // namespace vllm_kv::cpu::attention
