// int4_per_token_head rows (docs/formats.md §6.2): the row writer and reader arithmetic shared by
// the CPU and CUDA kernels, operation for operation the reference codec
// vllm/kv_quant/int4_per_token_head.py, so every writer produces its bytes. Framework-free; host
// and device.
//
// A row of D values is D / 2 bytes of 4-bit codes (low nibble first) then one fp32 word,
// little-endian: the scale with its low 4 mantissa bits replaced by the zero point. The values are
// first rotated by a randomized Hadamard transform over blocks of b values (b the largest power of
// two dividing D); its ±1 signs come from the caller (the glue draws them as the codec does).
#pragma once

#include <cstdint>

#include "cache_kernels.h"
#include "kv_quant_math.h"

namespace vllm_kv {

constexpr float kInt4Qmax = 15.0f;
constexpr float kInt4ScaleFloor = 1e-6f;
constexpr uint32_t kInt4ZeroPointMask = 0xFu;
constexpr int kInt4WordBytes = 4;
// Largest head size the compiled writers take (a row is rotated in a scratch array of fp32).
constexpr int kInt4MaxHeadSize = 512;

// Bytes of one cached row of head_size values.
KV_HOST_DEVICE constexpr int64_t int4_row_bytes(int64_t head_size) {
  return head_size / 2 + kInt4WordBytes;
}

// The Hadamard block of a head size: its largest power-of-two divisor.
KV_HOST_DEVICE constexpr int int4_rht_block(int head_size) { return head_size & -head_size; }

// Unnormalized Walsh-Hadamard transform of each block of `block` values of x[0, n): butterflies
// h = 1, 2, 4, ... with (lo + hi, lo - hi) in fp32, the codec's sums in its order. (Unrolled, the
// runtime-bound loops spill registers on sm_80.)
KV_HOST_DEVICE void int4_hadamard_blocks(float* x, int n, int block) {
  for (int h = 1; h < block; h *= 2) {
    KV_NO_UNROLL
    for (int base = 0; base < n; base += 2 * h) {
      KV_NO_UNROLL
      for (int j = base; j < base + h; ++j) {
        const float lo = x[j];
        const float hi = x[j + h];
        x[j] = kv_fadd(lo, hi);
        x[j + h] = kv_fsub(lo, hi);
      }
    }
  }
}

// Rotates a row of n values in place, block by block: x := H(x * signs) * factor (forward, the
// writer's rotation) or x := H(x) * signs * factor (inverse). A reader that keeps the rows in
// their rotated domain y attends with the query forward-rotated with factor 1 / b (q . k ==
// (H(q * s) / b) . y) and turns its output back with the inverse rotation, factor 1 / b.
KV_HOST_DEVICE void int4_rotate_row(float* x, int n, const float* signs, bool inverse,
                                    float factor) {
  const int block = int4_rht_block(n);
  if (!inverse) {
    for (int i = 0; i < n; ++i) x[i] = kv_fmul(x[i], signs[i & (block - 1)]);
  }
  int4_hadamard_blocks(x, n, block);
  for (int i = 0; i < n; ++i) {
    x[i] = kv_fmul(inverse ? kv_fmul(x[i], signs[i & (block - 1)]) : x[i], factor);
  }
}

// Rounds half away from zero as the codec does: trunc(t ± 0.5), the sum one fp32 rounding.
KV_HOST_DEVICE float int4_round_half_away(float t) {
  return truncf(t >= 0.0f ? kv_fadd(t, 0.5f) : kv_fsub(t, 0.5f));
}

// Quantizes one row: load(i) is element i widened to fp32 exactly; round_to_source(v) rounds an
// fp32 to the source dtype and widens it back (the codec rotates in fp32, then rounds there);
// signs[b] the rotation's ±1 vector; r a scratch array of head_size floats (the caller's: a stack
// array on the CPU, the thread's slice of shared memory on the GPU). Rows are assumed finite, as
// upstream assumes.
template <typename Load, typename RoundToSource>
KV_HOST_DEVICE void quantize_int4_per_token_head_row(const Load& load,
                                                     const RoundToSource& round_to_source,
                                                     const float* signs, int head_size, float* r,
                                                     uint8_t* row) {
  for (int i = 0; i < head_size; ++i) r[i] = load(i);
  int4_rotate_row(r, head_size, signs, /*inverse=*/false, 1.0f);
  float lo = INFINITY;
  float hi = -INFINITY;
  for (int i = 0; i < head_size; ++i) {
    r[i] = round_to_source(r[i]);
    lo = fminf(lo, r[i]);
    hi = fmaxf(hi, r[i]);
  }
  const float scale = fmaxf(kv_fdiv(kv_fsub(hi, lo), kInt4Qmax), kInt4ScaleFloor);
  const float zp = fminf(fmaxf(int4_round_half_away(kv_fdiv(-lo, scale)), 0.0f), kInt4Qmax);
  const float inv = kv_fdiv(1.0f, scale);
  for (int i = 0; i < head_size; i += 2) {
    uint8_t pair = 0;
    for (int k = 0; k < 2; ++k) {
      const float t = int4_round_half_away(kv_fadd(kv_fmul(r[i + k], inv), zp));
      pair |= uint8_t(uint32_t(fminf(fmaxf(t, 0.0f), kInt4Qmax)) << (4 * k));
    }
    row[i / 2] = pair;
  }
  const uint32_t word = (float_as_bits(scale) & ~kInt4ZeroPointMask) | uint32_t(zp);
  for (int b = 0; b < kInt4WordBytes; ++b) row[head_size / 2 + b] = uint8_t(word >> (8 * b));
}

// A row's scale word split: the zero point and the scale with those bits cleared.
struct Int4RowScale {
  float scale;
  float zero_point;
};

KV_HOST_DEVICE Int4RowScale int4_row_scale(const uint8_t* row, int head_size) {
  uint32_t word = 0;
  for (int b = 0; b < kInt4WordBytes; ++b) word |= uint32_t(row[head_size / 2 + b]) << (8 * b);
  return {bits_as_float(word & ~kInt4ZeroPointMask), float(word & kInt4ZeroPointMask)};
}

// Value i of a row in the rotated domain: (q - zp) * scale, as the codec reads it.
KV_HOST_DEVICE float int4_rotated_value(const uint8_t* row, const Int4RowScale& s, int i) {
  const float q = float((row[i / 2] >> (4 * (i & 1))) & 0xFu);
  return kv_fmul(kv_fsub(q, s.zero_point), s.scale);
}

}  // namespace vllm_kv
