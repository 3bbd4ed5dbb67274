// The per-token-head INT8 / FP8 row writer of the CPU reshape_and_cache_flash in vector lanes:
// per_token_head.h's quantize_per_token_head_row (the CUDA writer runs its lane split) with the
// same operations, its amax an integer max over magnitude bits, its codes kLanes at a time.
// Framework-free, host only.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

#include "cpu/writer_lanes.h"
#include "per_token_head.h"

namespace vllm_kv::cpu {

// float_to_int8_rne_sat lane by lane (y never NaN).
inline U32v float_to_int8_rne_sat(F32v y) {
#if defined(__AVX512F__)
  if constexpr (sizeof(F32v) == sizeof(__m512)) {  // clamp, then one conversion rounding to even
    const __m512 clamped = _mm512_min_ps(
        _mm512_max_ps(std::bit_cast<__m512>(y), _mm512_set1_ps(-kInt8PerTokenHeadMax)),
        _mm512_set1_ps(kInt8PerTokenHeadMax));
    const __m512i rounded =
        _mm512_cvt_roundps_epi32(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return std::bit_cast<U32v>(rounded) & 0xFFu;
  }
#endif
  const F32v low = F32v{} - kInt8PerTokenHeadMax;
  const F32v high = F32v{} + kInt8PerTokenHeadMax;
  const F32v clamped_low = y > low ? y : low;
  const F32v clamped = clamped_low < high ? clamped_low : high;
  const F32v magnitude = std::bit_cast<F32v>(std::bit_cast<U32v>(clamped) & 0x7FFFFFFFu);
  constexpr float kTwoPow23 = 8388608.0f;  // round_half_even's trick
  const I32v rounded = __builtin_convertvector((magnitude + kTwoPow23) - kTwoPow23, I32v);
  return std::bit_cast<U32v>(clamped < 0.0f ? -rounded : rounded) & 0xFFu;
}

// quantize_per_token_head_row's bytes for a row of head_size values of type S at x.
template <CacheKind K, SourceType S>
inline void quantize_per_token_head_row_lanes(const typename SourceTraits<S>::Storage* x,
                                              int head_size, uint8_t* row) {
  if (head_size % kLanes != 0) {
    quantize_per_token_head_row<K>([x](int j) { return SourceTraits<S>::to_float(x[j]); },
                                   head_size, row);
    return;
  }
  U32v amax_bits{};  // PerTokenHeadStats: the largest finite magnitude orders like its bits
  U32v nan{};
  for (int i = 0; i < head_size; i += kLanes) {
    const U32v bits = std::bit_cast<U32v>(load_lanes<S>(x + i)) & 0x7FFFFFFFu;
    nan |= bits > 0x7F800000u;
    const U32v finite = bits < 0x7F800000u ? bits : U32v{};
    amax_bits = finite > amax_bits ? finite : amax_bits;
  }
  PerTokenHeadStats stats;
  stats.finite_amax = bits_as_float(lanes_max(amax_bits));
  stats.has_nan = lanes_or(nan) != 0;
  const float scale = per_token_head_scale<K>(stats);
  if (stats.has_nan) {
    std::memset(row, 0, head_size);
  } else {
    const float inv = kv_fdiv(1.0f, scale);
    for (int i = 0; i < head_size; i += kLanes) {
      const F32v y = load_lanes<S>(x + i) * inv;
      if constexpr (K == CacheKind::kInt8PerTokenHead) {
        store_lane_bytes(float_to_int8_rne_sat(y), row + i);
      } else {
        static_assert(K == CacheKind::kFp8PerTokenHead, "per-token-head kinds only");
        store_lane_bytes(float_to_e4m3_satfinite(y), row + i);
      }
    }
  }
  const uint32_t bits = float_as_bits(scale);
  for (int b = 0; b < kPerTokenHeadScaleBytes; ++b) row[head_size + b] = uint8_t(bits >> (8 * b));
}

}  // namespace vllm_kv::cpu
