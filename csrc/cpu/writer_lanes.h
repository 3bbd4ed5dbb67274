// Vector-lane helpers of the CPU writers (cpu/packed_slot_rows.h, cpu/octave_slot_lanes.h,
// cpu/per_token_head_lanes.h) on nvfp4_lanes.h's vectors: widening loads, narrowing stores,
// counts of compares, reductions. Framework-free, host only.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu/nvfp4_lanes.h"
#include "dispatch_utils.h"

namespace vllm_kv::cpu {

using I32v = Vec<int32_t>;

// kLanes elements of type S widened to fp32.
template <SourceType S>
inline F32v load_lanes(const typename SourceTraits<S>::Storage* x) {
  float widened[kLanes];
  for (int i = 0; i < kLanes; ++i) widened[i] = SourceTraits<S>::to_float(x[i]);
  F32v v;
  std::memcpy(&v, widened, sizeof(v));
  return v;
}

// The low byte of each lane, kLanes bytes.
inline void store_lane_bytes(U32v lanes, uint8_t* dst) {
#if defined(__AVX512F__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm512_maskz_cvtepi32_epi8(0xFFFF, std::bit_cast<__m512i>(lanes)));
#else
  for (int l = 0; l < kLanes; ++l) dst[l] = uint8_t(lanes[l]);
#endif
}

// 4-bit codes in lanes, two per byte (lane 2j in byte j's low nibble): kLanes / 2 bytes.
inline void store_nibble_pairs(U32v codes, uint8_t* dst) {
  const U64v pairs = std::bit_cast<U64v>(codes);  // lane 2j low, lane 2j + 1 high
  const U64v bytes = pairs | (pairs >> 28);
#if defined(__AVX512F__)
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst),
                   _mm512_maskz_cvtepi64_epi8(0xFF, std::bit_cast<__m512i>(bytes)));
#else
  for (int j = 0; j < kLanes / 2; ++j) dst[j] = uint8_t(bytes[j]);
#endif
}

// The largest lane, and all lanes or-ed.
// v with lane i + kShift moved to lane i (wrapping around).
template <int kShift, typename V, size_t... kI>
inline V lanes_shifted_down(V v, std::index_sequence<kI...>) {
  return __builtin_shufflevector(v, v, int((kI + kShift) % kLanes)...);
}

// op over all lanes, folded in halves (lane i with lane i + w, w = kWidth / 2, ..., 1): the
// halving-tree order, result in lane 0.
template <int kWidth, typename V, typename Op>
inline V fold_lanes(V v, const Op& op) {
  if constexpr (kWidth > 1) {
    return fold_lanes<kWidth / 2>(
        op(v, lanes_shifted_down<kWidth / 2>(v, std::make_index_sequence<kLanes>{})), op);
  } else {
    return v;
  }
}

inline uint32_t lanes_max(U32v v) {
  return fold_lanes<kLanes>(v, [](U32v a, U32v b) { return a > b ? a : b; })[0];
}

inline uint32_t lanes_or(U32v v) {
  return fold_lanes<kLanes>(v, [](U32v a, U32v b) { return a | b; })[0];
}

// When a lane counts as above a threshold: x > t; x >= t; x > t or x NaN (above every threshold).
enum class Above { kGreater, kAtOrAbove, kGreaterOrNaN };

// How many of the n (< 16) ascending thresholds each lane of x is above: a bucket index. AVX-512:
// four steps of bisection over the thresholds in one register; elsewhere, a compare each.
template <Above kAbove>
inline I32v count_above_sorted(F32v x, const float* thresholds, int n) {
#if defined(__AVX512F__)
  constexpr int kPredicate = kAbove == Above::kGreater     ? _CMP_GT_OQ
                             : kAbove == Above::kAtOrAbove ? _CMP_GE_OQ
                                                           : _CMP_NLE_UQ;
  const __m512 table = _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1u), thresholds);
  const __m512 v = std::bit_cast<__m512>(x);
  const __m512i limit = _mm512_set1_epi32(n);
  // n = 2^k - 1 thresholds (the codebooks' midpoints): k steps from 2^(k-1), every candidate
  // a threshold; otherwise four steps from 8, candidates past n masked off.
  const bool full = (n & (n + 1)) == 0;
  __m512i count = _mm512_setzero_si512();
  for (int step = full ? (n + 1) / 2 : 8; step >= 1; step /= 2) {  // the largest count below x
    const __m512i candidate = _mm512_add_epi32(count, _mm512_set1_epi32(step));
    const __mmask16 valid = full ? __mmask16(0xFFFF) : _mm512_cmple_epi32_mask(candidate, limit);
    const __m512 threshold = _mm512_maskz_permutexvar_ps(
        0xFFFF, _mm512_sub_epi32(candidate, _mm512_set1_epi32(1)), table);
    const __mmask16 above = _mm512_mask_cmp_ps_mask(valid, v, threshold, kPredicate);
    count = _mm512_mask_mov_epi32(count, above, candidate);
  }
  return std::bit_cast<I32v>(count);
#else
  I32v count{};
  for (int m = 0; m < n; ++m) {
    const float t = thresholds[m];
    if constexpr (kAbove == Above::kGreater) {
      count -= x > t;  // lanes of -1 where true
    } else if constexpr (kAbove == Above::kAtOrAbove) {
      count -= x >= t;
    } else {
      count -= (x <= t) == 0;
    }
  }
  return count;
#endif
}

// table[idx] lane by lane (idx in [0, 16), a table of 16 floats).
inline F32v lookup_lanes(I32v idx, const float* table) {
#if defined(__AVX512F__)
  return std::bit_cast<F32v>(
      _mm512_maskz_permutexvar_ps(0xFFFF, std::bit_cast<__m512i>(idx), _mm512_loadu_ps(table)));
#else
  F32v out;
  for (int l = 0; l < kLanes; ++l) out[l] = table[idx[l]];
  return out;
#endif
}

}  // namespace vllm_kv::cpu
