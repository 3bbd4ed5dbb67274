// The bf16 dot path of the CPU attention kernels (AVX-512 BF16 builds): cache rows whose values
// are exact in bf16 (bf16, FP8, NVFP4, per-token-head int8 / e4m3) meet the query and the softmax
// weights in vdpbf16ps. Keys are dotted with the bf16 query (rounding differs from the fp32 path
// only in the order of the fp32 sums); values are weighted by the softmax weights rounded to
// bf16, as flash attention rounds its probabilities for the PV product. A per-token-head row's
// inline scale multiplies its score (keys) and its softmax weight before that rounding (values),
// not each element.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "cache_kernels.h"
#include "cpu/attention_decode.h"
#include "cpu/attention_simd.h"
#include "cpu/attention_tile.h"
#include "per_token_head.h"

namespace vllm_kv::cpu::attention {

#if defined(VLLM_KV_HAVE_AVX512_BF16)

// In place: r[j] lane t becomes r[t] lane j (a 16 x 16 transpose of 32-bit elements). (The
// shuffles in their zero-masking forms under a full mask: the plain ones pass GCC 12's
// self-initialised undefined vector, which -Wuninitialized flags where they are inlined.)
inline void transpose_16x16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_maskz_unpacklo_epi32(0xFFFF, r[i], r[i + 1]);
    t[i + 1] = _mm512_maskz_unpackhi_epi32(0xFFFF, r[i], r[i + 1]);
  }
  // r[4i + c], 128-bit lane b: column 4b + c of rows 4i .. 4i + 3.
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_maskz_unpacklo_epi64(0xFF, t[i], t[i + 2]);
    r[i + 1] = _mm512_maskz_unpackhi_epi64(0xFF, t[i], t[i + 2]);
    r[i + 2] = _mm512_maskz_unpacklo_epi64(0xFF, t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_maskz_unpackhi_epi64(0xFF, t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i u = _mm512_maskz_shuffle_i32x4(0xFFFF, r[c], r[4 + c], 0x44);
    const __m512i v = _mm512_maskz_shuffle_i32x4(0xFFFF, r[8 + c], r[12 + c], 0x44);
    const __m512i w = _mm512_maskz_shuffle_i32x4(0xFFFF, r[c], r[4 + c], 0xEE);
    const __m512i x = _mm512_maskz_shuffle_i32x4(0xFFFF, r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_maskz_shuffle_i32x4(0xFFFF, u, v, 0x88);
    t[4 + c] = _mm512_maskz_shuffle_i32x4(0xFFFF, u, v, 0xDD);
    t[8 + c] = _mm512_maskz_shuffle_i32x4(0xFFFF, w, x, 0x88);
    t[12 + c] = _mm512_maskz_shuffle_i32x4(0xFFFF, w, x, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Half `kHalf` (elements 16 kHalf .. 16 kHalf + 15) of two rows of 32 bf16 interleaved element by
// element: lane 2j holds element j of the half of x, lane 2j + 1 that of y (the operand of a
// vdpbf16ps against a pair of weights of two keys).
template <int kHalf>
inline __m512i interleave_pairs(__m512i x, __m512i y) {
  alignas(64) static constexpr auto kIndex = [] {
    std::array<uint16_t, 32> index{};
    for (int j = 0; j < 16; ++j) {
      index[2 * j] = uint16_t(16 * kHalf + j);
      index[2 * j + 1] = uint16_t(32 + 16 * kHalf + j);
    }
    return index;
  }();
  return _mm512_permutex2var_epi16(x, _mm512_load_si512(kIndex.data()), y);
}

// acc + the vdpbf16ps of `values` with the bf16 pair at `pair` in every lane.
inline __m512 dot_pair(__m512 acc, __m512bh values, const void* pair) {
  int32_t bits;
  std::memcpy(&bits, pair, sizeof(bits));
  return _mm512_dpbf16_ps(acc, values, (__m512bh)_mm512_set1_epi32(bits));
}

// Rows of format K (groups: a side's NVFP4 group offsets) on the bf16 dot.
template <CacheKind K>
struct Bf16Dot {
  static constexpr SimdLevel L = SimdLevel::kAvx512;
  static constexpr int kLanes = attention::kLanes<L>;
  using V = VecF<L>;
  // Rows of FP8 codes (per tensor, or per token and head with e4m3 codes) and their format.
  static constexpr bool kFp8Codes =
      K == CacheKind::kFp8E4M3 || K == CacheKind::kFp8E5M2 || K == CacheKind::kFp8PerTokenHead;
  static constexpr CacheKind kFp8Format =
      K == CacheKind::kFp8PerTokenHead ? CacheKind::kFp8E4M3 : K;

  // Elements [d, d + 32) of a cache row as bf16, exactly: bf16 rows as they are; FP8 by
  // fp8_to_bf16_x32; NVFP4 codes looked up in the kScaledE2M1 rows of the two groups' block
  // scales. groups: the side's group offsets.
  static __m512i row_bf16(const uint8_t* row, const uint8_t* scales, const int64_t* groups, int d) {
    if constexpr (K == CacheKind::kNvfp4) {
      // Word j: source byte j / 2 in both halves, shifted right by 4 for odd j, so that its low
      // nibble is code j; bit 4 picks the table half of the element's group.
      alignas(64) static constexpr auto kDuplicate = [] {
        std::array<uint8_t, 64> index{};
        for (int k = 0; k < 64; ++k) index[k] = uint8_t(k / 4);
        return index;
      }();
      alignas(64) static constexpr auto kShift = [] {
        std::array<uint16_t, 32> shift{};
        for (int j = 0; j < 32; ++j) shift[j] = uint16_t(j % 2 == 0 ? 0 : 4);
        return shift;
      }();
      const __m512i bytes =
          _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d / 2)));
      const __m512i words =  // (zero-masking forms: see transpose_16x16)
          _mm512_maskz_permutexvar_epi8(~__mmask64(0), _mm512_load_si512(kDuplicate.data()), bytes);
      const __m512i shifted = _mm512_srlv_epi16(words, _mm512_load_si512(kShift.data()));
      const __m512i index = _mm512_ternarylogic_epi32(  // (shifted & 0xF) | half
          shifted, _mm512_set1_epi16(0x0F), _mm512_maskz_set1_epi16(0xFFFF0000u, 16), 0xEA);
      const uint8_t* first = kScaledE2M1.bits[scales[groups[d / kNvfp4GroupSize]]];
      const uint8_t* second = kScaledE2M1.bits[scales[groups[d / kNvfp4GroupSize + 1]]];
      const __m512i table = _mm512_maskz_inserti64x4(
          0xFF, _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(first))),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(second)), 1);
      return _mm512_permutexvar_epi16(index, table);
    } else if constexpr (kFp8Codes) {
      return fp8_to_bf16_x32<kFp8Format>(row + d);
    } else if constexpr (K == CacheKind::kInt8PerTokenHead) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
      const __m512 hi =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
      return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    } else {
      return _mm512_loadu_si512(row + 2 * d);
    }
  }

  // Elements [d, d + 32 n) of a cache row as n vectors of bf16 (row_bf16; FP8 codes 64 at a time).
  template <int n>
  static void row_slices(const uint8_t* row, const uint8_t* scales, const int64_t* groups, int d,
                         __m512i (&out)[n]) {
    if constexpr (kFp8Codes && n == 2) {
      fp8_to_bf16_x64<kFp8Format>(row + d, out);
    } else {
      for (int c = 0; c < n; ++c) out[c] = row_bf16(row, scales, groups, d + 32 * c);
    }
  }

  // Elements [d, d + 32) of rows x and y (y nullptr: zeros) as bf16 interleaved element by
  // element (interleave_pairs): out[h] lane 2j / 2j + 1 holds element d + 16 h + j of x / y. FP8
  // codes are placed so that their lookup gives that order directly.
  static void pair_bf16(const uint8_t* x, const uint8_t* x_scales, const uint8_t* y,
                        const uint8_t* y_scales, const int64_t* groups, int d, __m512i (&out)[2]) {
    if constexpr (kFp8Codes) {
      fp8_pairs_to_bf16<kFp8Format>(x + d, y == nullptr ? nullptr : y + d, out);
    } else {
      const __m512i xv = row_bf16(x, x_scales, groups, d);
      const __m512i yv = y == nullptr ? _mm512_setzero_si512() : row_bf16(y, y_scales, groups, d);
      out[0] = interleave_pairs<0>(xv, yv);
      out[1] = interleave_pairs<1>(xv, yv);
    }
  }

  // Lane t - t0 of keys t in [tb, te): the row scales of per-token-head rows (the fp32 after the
  // row's head_size values, per_token_head_row_scale), 0 in the other lanes; ones for the other
  // formats. Gathered from the rows' addresses (assembled one by one and reloaded as a vector,
  // they stalled on the stores).
  static V row_scales(const uint8_t* const* rows, int head_size, int t0, int tb, int te) {
    if constexpr (!is_per_token_head(K)) {
      return splat<L>(1.0f);
    } else {
      static_assert(kPerTokenHeadScaleBytes == sizeof(float) && kLanes == 16);
      const auto lanes = __mmask16(((1u << (te - t0)) - 1) & ~((1u << (tb - t0)) - 1));
      const auto half = [&](int h) {
        const auto mask = __mmask8(lanes >> (8 * h));
        const __m512i scale_at = _mm512_add_epi64(_mm512_maskz_loadu_epi64(mask, rows + t0 + 8 * h),
                                                  _mm512_set1_epi64(head_size));
        return _mm512_mask_i64gather_ps(_mm256_setzero_ps(), mask, scale_at, nullptr, 1);
      };
      return V(_mm512_castpd_ps(_mm512_insertf64x4(
          _mm512_castpd256_pd512(_mm256_castps_pd(half(0))), _mm256_castps_pd(half(1)), 1)));
    }
  }

  // TileMath::score_chunk for bf16 keys and a bf16 query: pairs of bf16 products summed in fp32
  // (vdpbf16ps) straight from the cache, then times q_scale. Keys come kKeys per pass; each
  // pass's partial sums are folded right away (the first two levels of the transposing
  // reduction, see reduce_add_many), the last two levels once per kLanes keys.
  template <int kRows>
  static void score_chunk(const RowShape& s, const uint16_t* q, const uint8_t* const* k_rows,
                          const uint8_t* const* k_scales, const int64_t* groups, int b, int e,
                          float* scores, int g0, float q_scale) {
    constexpr int kKeys = 4;
    constexpr int kPasses = kLanes / kKeys;
    static_assert(kLanes == 16, "folds below assume 16 lanes");
    const V scale = splat<L>(q_scale);
    for (int t0 = b - b % kLanes; t0 < e; t0 += kLanes) {
      V folded[kRows][kPasses];  // per pass: kKeys keys x 4 partial sums
      for (int pass = 0; pass < kPasses; ++pass) {
        const int first = t0 + kKeys * pass;
        const int lo = std::max(b, first);
        const int hi = std::min(e, first + kKeys);
        if (lo >= hi) {
          for (int i = 0; i < kRows; ++i) folded[i][pass] = V{};
          continue;
        }
        __m512 sum[kKeys][kRows];
        for (int x = 0; x < kKeys; ++x) {
          for (int i = 0; i < kRows; ++i) sum[x][i] = _mm512_setzero_ps();
        }
        // Elements [d, d + 32 n) of the keys into the sums.
        const auto slices = [&]<int n>(std::integral_constant<int, n>, int d) {
          __m512i kv[kKeys][n];
          for (int x = 0; x < kKeys; ++x) {
            // Keys outside [lo, hi) read a valid row; their sums are dropped below.
            const int t = std::clamp(first + x, lo, hi - 1);
            row_slices<n>(k_rows[t], k_scales[t], groups, d, kv[x]);
          }
          for (int i = 0; i < kRows; ++i) {
            for (int c = 0; c < n; ++c) {
              const auto qv =
                  (__m512bh)_mm512_loadu_si512(q + int64_t(g0 + i) * s.dim_k + d + 32 * c);
              for (int x = 0; x < kKeys; ++x) {
                sum[x][i] = _mm512_dpbf16_ps(sum[x][i], qv, (__m512bh)kv[x][c]);
              }
            }
          }
        };
        int d = 0;
        if constexpr (kFp8Codes) {  // 64 codes per lookup
          for (; d + 64 <= s.head_size; d += 64) slices(std::integral_constant<int, 2>{}, d);
        }
        for (; d < s.head_size; d += 32) slices(std::integral_constant<int, 1>{}, d);
        for (int x = 0; x < kKeys; ++x) {
          if (first + x >= lo && first + x < hi) continue;
          for (int i = 0; i < kRows; ++i) sum[x][i] = _mm512_setzero_ps();
        }
        for (int i = 0; i < kRows; ++i) {
          folded[i][pass] =
              fold<8>(fold<16>(V(sum[0][i]), V(sum[1][i])), fold<16>(V(sum[2][i]), V(sum[3][i])));
        }
      }
      const int tb = std::max(b, t0);
      const int te = std::min(e, t0 + kLanes);
      const V key_scales = scale * row_scales(k_rows, s.head_size, t0, tb, te);
      for (int i = 0; i < kRows; ++i) {
        float* row = scores + int64_t(g0 + i) * s.tokens;
        const V s =
            fold<2>(fold<4>(folded[i][0], folded[i][1]), fold<4>(folded[i][2], folded[i][3])) *
            key_scales;
        if (tb == t0 && te == t0 + kLanes) {
          store<L>(row + t0, s);
        } else {
          for (int t = tb; t < te; ++t) row[t] = s[t - t0];
        }
      }
    }
  }

  // One level of the transposing reduction (fold_pair) over kLanes lanes: a and b hold
  // kLanes / kPartials keys of kPartials partial sums each.
  template <int kPartials>
  static V fold(V a, V b) {
    return fold_pair<kLanes, kPartials>(a, b, std::make_index_sequence<kLanes>{});
  }

  // TileMath::accumulate_chunk by vdpbf16ps, keys in pairs: the V rows of keys t and t + 1,
  // interleaved element by element, meet the pair (w[g][t], w[g][t + 1]) rounded to bf16 (as flash
  // attention rounds its probabilities for the PV product); sums in fp32. A lone last key pairs
  // with zeros.
  template <int kRows>
  static void accumulate_chunk(const RowShape& s, const float* weights,
                               const uint8_t* const* v_rows, const uint8_t* const* v_scales,
                               const int64_t* groups, int b, int e, float* acc, int g0) {
    for (int tb = b; tb < e; tb += 16) {
      const int te = std::min(e, tb + 16);
      // Row i's weights of keys [tb, te) in bf16, zero past te: pair j is pairs[i][j].
      alignas(32) uint32_t pairs[kRows][8];
      const __mmask16 valid = __mmask16((1u << (te - tb)) - 1);
      const V value_scales = row_scales(v_rows, s.head_size_v, tb, tb, te);
      for (int i = 0; i < kRows; ++i) {
        const __m512 w =
            _mm512_maskz_loadu_ps(valid, weights + int64_t(g0 + i) * s.tokens + tb) * value_scales;
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[i]), (__m256i)_mm512_cvtneps_pbh(w));
      }
      int d = 0;
      if constexpr (kRows <= 4) {  // two slices of 32 per pass: enough chains in flight
        for (; d + 64 <= s.head_size_v; d += 64) {
          accumulate_slices<kRows, 2>(s, pairs, v_rows, v_scales, groups, tb, te, acc, g0, d);
        }
      }
      for (; d < s.head_size_v; d += 32) {
        accumulate_slices<kRows, 1>(s, pairs, v_rows, v_scales, groups, tb, te, acc, g0, d);
      }
    }
  }

  // Elements [d, d + 32 kSlices) of the rows' accumulators over keys [tb, te) (see above).
  template <int kRows, int kSlices>
  static void accumulate_slices(const RowShape& s, const uint32_t (*pairs)[8],
                                const uint8_t* const* v_rows, const uint8_t* const* v_scales,
                                const int64_t* groups, int tb, int te, float* acc, int g0, int d) {
    __m512 a[kSlices][2][kRows];
    for (int c = 0; c < kSlices; ++c) {
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < kRows; ++i) {
          a[c][h][i] = _mm512_loadu_ps(acc + int64_t(g0 + i) * s.dim_v + d + 32 * c + 16 * h);
        }
      }
    }
    for (int t = tb; t < te; t += 2) {
      const bool partner = t + 1 < te;
      __m512bh w[kRows];
      for (int i = 0; i < kRows; ++i)
        w[i] = (__m512bh)_mm512_set1_epi32(int(pairs[i][(t - tb) / 2]));
      for (int c = 0; c < kSlices; ++c) {
        __m512i xy[2];
        pair_bf16(v_rows[t], v_scales[t], partner ? v_rows[t + 1] : nullptr,
                  partner ? v_scales[t + 1] : nullptr, groups, d + 32 * c, xy);
        for (int i = 0; i < kRows; ++i) {
          a[c][0][i] = _mm512_dpbf16_ps(a[c][0][i], (__m512bh)xy[0], w[i]);
          a[c][1][i] = _mm512_dpbf16_ps(a[c][1][i], (__m512bh)xy[1], w[i]);
        }
      }
    }
    for (int c = 0; c < kSlices; ++c) {
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < kRows; ++i) {
          _mm512_storeu_ps(acc + int64_t(g0 + i) * s.dim_v + d + 32 * c + 16 * h, a[c][h][i]);
        }
      }
    }
  }
};

#endif  // VLLM_KV_HAVE_AVX512_BF16

}  // namespace vllm_kv::cpu::attention
