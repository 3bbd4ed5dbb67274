// Per-token-head INT8 / FP8 rows (docs/design.md §5.4): the scalar arithmetic and the row writer
// shared by the CPU and CUDA kernels, operation for operation the reference codec
// vllm/kv_quant/per_token_head.py, so both produce its bytes. Framework-free; host and device.
#pragma once

#include <cstdint>

#include "cache_kernels.h"
#include "kv_quant_math.h"

namespace vllm_kv {

constexpr float kInt8PerTokenHeadMax = 127.0f;
// Smallest stored scale: keeps the inverse of an all-zero (or tiny) row finite.
constexpr float kPerTokenHeadScaleFloor = 1e-6f;
constexpr int kPerTokenHeadScaleBytes = 4;
// The scale of a row that held a NaN: the whole row then reads back as NaN.
constexpr uint32_t kPerTokenHeadNanScaleBits = 0x7FC00000u;

KV_HOST_DEVICE constexpr bool is_per_token_head(CacheKind kind) {
  return kind == CacheKind::kInt8PerTokenHead || kind == CacheKind::kFp8PerTokenHead;
}

// Largest magnitude a row's amax is mapped to: 127 (int8) or 448 (e4m3).
template <CacheKind K>
KV_HOST_DEVICE constexpr float per_token_head_max() {
  static_assert(is_per_token_head(K), "per-token-head kinds only");
  return K == CacheKind::kInt8PerTokenHead ? kInt8PerTokenHeadMax : kFp8E4M3Max;
}

// A row's statistics: max |x| over its finite values (Inf saturates in the encoding instead of
// wiping the row's scale out) and whether it holds a NaN.
struct PerTokenHeadStats {
  float finite_amax = 0.0f;
  bool has_nan = false;

  KV_HOST_DEVICE void add(float x) {
    const uint32_t abs_bits = float_as_bits(x) & 0x7FFFFFFFu;
    has_nan |= abs_bits > 0x7F800000u;
    // |x| orders like its bits; Inf and NaN (>= 0x7F800000) do not count.
    const float magnitude = abs_bits < 0x7F800000u ? bits_as_float(abs_bits) : 0.0f;
    finite_amax = fmaxf(finite_amax, magnitude);
  }
};

// scale = max(amax / QMAX, 1e-6), or the NaN scale for a row holding a NaN.
template <CacheKind K>
KV_HOST_DEVICE float per_token_head_scale(const PerTokenHeadStats& stats) {
  const float scale =
      fmaxf(kv_fdiv(stats.finite_amax, per_token_head_max<K>()), kPerTokenHeadScaleFloor);
  return stats.has_nan ? bits_as_float(kPerTokenHeadNanScaleBits) : scale;
}

// fp32 -> int8: clamp to [-127, 127] (symmetric, so -Inf mirrors +Inf), then round half to even
// on the magnitude (the 2^23 trick of round_half_even needs a non-negative input). y is never NaN
// here (NaN rows are zeroed).
KV_HOST_DEVICE uint8_t float_to_int8_rne_sat(float y) {
  const float clamped = fminf(fmaxf(y, -kInt8PerTokenHeadMax), kInt8PerTokenHeadMax);
  const int magnitude = int(round_half_even(fabsf(clamped)));
  return uint8_t(int8_t(clamped < 0.0f ? -magnitude : magnitude));
}

// The stored byte of y = x * inv: int8 two's complement or an e4m3 byte (saturating, RNE).
template <CacheKind K>
KV_HOST_DEVICE uint8_t per_token_head_encode(float y) {
  if constexpr (K == CacheKind::kInt8PerTokenHead) {
    return float_to_int8_rne_sat(y);
  } else {
    static_assert(K == CacheKind::kFp8PerTokenHead, "per-token-head kinds only");
    return float_to_e4m3_satfinite(y);
  }
}

// The stored byte of value x of a row whose scale's inverse is inv: 0 in a row holding a NaN.
template <CacheKind K>
KV_HOST_DEVICE uint8_t per_token_head_byte(float x, float inv, bool row_has_nan) {
  return row_has_nan ? uint8_t{0} : per_token_head_encode<K>(kv_fmul(x, inv));
}

// The row's fp32 scale as 4 bytes after its head_size values, little-endian, one at a time.
KV_HOST_DEVICE void put_per_token_head_scale(uint8_t* row, int head_size, float scale) {
  const uint32_t bits = float_as_bits(scale);
  for (int b = 0; b < kPerTokenHeadScaleBytes; ++b) row[head_size + b] = uint8_t(bits >> (8 * b));
}

// Quantizes one row of head_size values (load(i): element i widened to fp32 exactly) into row:
// head_size value bytes, then the fp32 scale's 4 bytes, little-endian, one byte at a time (rows
// of a padded or odd-strided page need not be 4-byte aligned).
template <CacheKind K, typename Load>
KV_HOST_DEVICE void quantize_per_token_head_row(const Load& load, int head_size, uint8_t* row) {
  PerTokenHeadStats stats;
  for (int i = 0; i < head_size; ++i) stats.add(load(i));
  const float scale = per_token_head_scale<K>(stats);
  const float inv = kv_fdiv(1.0f, scale);  // finite: scale >= 1e-6 (unused for a NaN row)
  for (int i = 0; i < head_size; ++i) row[i] = per_token_head_byte<K>(load(i), inv, stats.has_nan);
  put_per_token_head_scale(row, head_size, scale);
}

// The CUDA writer's split of a row over the lanes of a warp: lane l takes the runs of kRowRun
// elements starting at kRowRun * (l + k * kRowLanes), so a warp's loads and 4-byte stores are
// contiguous; every lane derives the scale from the whole row's statistics, merged across lanes
// (max and or: the same result in any order).
constexpr int kRowLanes = 32;
constexpr int kRowRun = 4;

KV_HOST_DEVICE PerTokenHeadStats merge_stats(PerTokenHeadStats a, const PerTokenHeadStats& b) {
  a.finite_amax = fmaxf(a.finite_amax, b.finite_amax);  // both >= +0, never NaN
  a.has_nan = a.has_nan || b.has_nan;
  return a;
}

// The statistics of lane `lane`'s runs of a row of head_size values (load(i): element i).
template <typename Load>
KV_HOST_DEVICE PerTokenHeadStats per_token_head_lane_stats(const Load& load, int head_size,
                                                           int lane) {
  PerTokenHeadStats stats;
  for (int start = lane * kRowRun; start < head_size; start += kRowLanes * kRowRun) {
    const int end = start + kRowRun < head_size ? start + kRowRun : head_size;
    for (int i = start; i < end; ++i) stats.add(load(i));
  }
  return stats;
}

// Lane `lane`'s bytes of the row quantize_per_token_head_row writes, given the whole row's
// statistics: its runs' value bytes (one 4-byte store per whole run where the row is 4-byte
// aligned) and, from lane 0, the scale. run(start, n): called after each run is stored.
template <CacheKind K, typename Load, typename AfterRun>
KV_HOST_DEVICE void quantize_per_token_head_lane(const Load& load, int head_size, int lane,
                                                 const PerTokenHeadStats& stats, uint8_t* row,
                                                 const AfterRun& after_run) {
  const float scale = per_token_head_scale<K>(stats);
  const float inv = kv_fdiv(1.0f, scale);  // finite: scale >= 1e-6 (unused for a NaN row)
  const bool aligned = reinterpret_cast<uintptr_t>(row) % 4 == 0;
  for (int start = lane * kRowRun; start < head_size; start += kRowLanes * kRowRun) {
    const int n = start + kRowRun < head_size ? kRowRun : head_size - start;
    uint32_t word = 0;
    for (int i = 0; i < n; ++i) {
      word |= uint32_t(per_token_head_byte<K>(load(start + i), inv, stats.has_nan)) << (8 * i);
    }
    if (aligned && n == kRowRun) {
      *reinterpret_cast<uint32_t*>(row + start) = word;
    } else {
      for (int i = 0; i < n; ++i) row[start + i] = uint8_t(word >> (8 * i));
    }
    after_run(start, n);
  }
  if (lane == 0) put_per_token_head_scale(row, head_size, scale);
}

// The value of byte q of a per-token-head row (before the scale): int8 or e4m3.
template <CacheKind K>
KV_HOST_DEVICE float per_token_head_decode(uint8_t q) {
  if constexpr (K == CacheKind::kInt8PerTokenHead) {
    return float(int8_t(q));
  } else {
    static_assert(K == CacheKind::kFp8PerTokenHead, "per-token-head kinds only");
    return e4m3_to_float(q);
  }
}

// The fp32 scale stored after the head_size values of a row.
KV_HOST_DEVICE float per_token_head_row_scale(const uint8_t* row, int head_size) {
  uint32_t bits = 0;
  for (int b = 0; b < kPerTokenHeadScaleBytes; ++b) bits |= uint32_t(row[head_size + b]) << (8 * b);
  return bits_as_float(bits);
}

}  // namespace vllm_kv
