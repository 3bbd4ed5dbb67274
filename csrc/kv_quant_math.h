// Scalar quantization arithmetic shared by the CPU and CUDA cache kernels.
//
// Every function here mirrors the pure-torch reference codecs in vllm/kv_quant/ operation for
// operation (DESIGN.md §5), so both kernels produce the reference's bytes. No torch headers: the
// file compiles as host C++ and as CUDA device code. Multiplications and divisions go through
// kv_fmul / kv_fdiv so that nvcc can neither fuse nor approximate them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KV_HOST_DEVICE inline
#endif

namespace vllm_kv {

constexpr int kNvfp4GroupSize = 16;
constexpr float kFp8E4M3Max = 448.0f;
constexpr float kFp8E5M2Max = 57344.0f;
constexpr float kE2M1Max = 6.0f;
// Canonical NaN byte written for any NaN input (the sign of a NaN differs between platforms).
constexpr uint8_t kFp8NanByte = 0x7F;

KV_HOST_DEVICE uint32_t float_as_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

KV_HOST_DEVICE float bits_as_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

KV_HOST_DEVICE float kv_fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

KV_HOST_DEVICE float kv_fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

KV_HOST_DEVICE float round_half_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);  // default rounding mode: to nearest, ties to even
#endif
}

KV_HOST_DEVICE bool is_nan(float x) { return (float_as_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }

// Widening conversions of the 16-bit source formats: exact, subnormals, Inf and NaN included.
KV_HOST_DEVICE float bf16_bits_to_float(uint16_t h) { return bits_as_float(uint32_t(h) << 16); }

KV_HOST_DEVICE float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_as_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in fp32.
    const float magnitude = float(mantissa) * 5.9604644775390625e-08f;
    return sign ? -magnitude : magnitude;
  }
  return bits_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// fp32 -> FP8 with kExpBits exponent and kManBits mantissa bits: round to nearest even, saturate
// to ±max_value (±Inf too), NaN -> kFp8NanByte. max_code is the byte of max_value.
template <int kExpBits, int kManBits>
KV_HOST_DEVICE uint8_t float_to_fp8_satfinite(float x, float max_value, uint8_t max_code) {
  constexpr int kBias = (1 << (kExpBits - 1)) - 1;
  constexpr int kDroppedBits = 23 - kManBits;
  uint32_t bits = float_as_bits(x);
  const uint8_t sign = uint8_t((bits >> 24) & 0x80u);
  bits &= 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return kFp8NanByte;
  const float magnitude = bits_as_float(bits);
  if (magnitude >= max_value) return sign | max_code;
  // Smallest normal: 2^(1 - bias). Below it the code is the magnitude in units of the
  // subnormal step 2^(1 - bias - kManBits); a result of 2^kManBits is the smallest normal.
  const float min_normal = bits_as_float(uint32_t(127 + 1 - kBias) << 23);
  if (magnitude < min_normal) {
    const float to_steps = bits_as_float(uint32_t(127 - (1 - kBias - kManBits)) << 23);
    return sign | uint8_t(round_half_even(kv_fmul(magnitude, to_steps)));
  }
  const uint32_t lsb = (bits >> kDroppedBits) & 1u;
  bits += ((1u << (kDroppedBits - 1)) - 1u) + lsb;  // ties to even; a carry bumps the exponent
  const uint32_t exponent = (bits >> 23) - 127u + kBias;
  const uint32_t mantissa = (bits >> kDroppedBits) & ((1u << kManBits) - 1u);
  return sign | uint8_t((exponent << kManBits) | mantissa);
}

KV_HOST_DEVICE uint8_t float_to_e4m3_satfinite(float x) {
  return float_to_fp8_satfinite<4, 3>(x, kFp8E4M3Max, 0x7E);
}

KV_HOST_DEVICE uint8_t float_to_e5m2_satfinite(float x) {
  return float_to_fp8_satfinite<5, 2>(x, kFp8E5M2Max, 0x7B);
}

// FP8 e4m3fn byte -> fp32 (exact).
KV_HOST_DEVICE float e4m3_to_float(uint8_t byte) {
  const uint32_t sign = uint32_t(byte & 0x80u) << 24;
  const uint32_t exponent = (byte >> 3) & 0xFu;
  const uint32_t mantissa = byte & 0x7u;
  if (exponent == 0xFu && mantissa == 0x7u) return bits_as_float(sign | 0x7FC00000u);
  if (exponent == 0) {
    const float magnitude = float(mantissa) * 0.001953125f;  // mantissa * 2^-9
    return sign ? -magnitude : magnitude;
  }
  return bits_as_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// fp32 -> E2M1 code (bit 3 = sign, bits 0-2 = index into {0, .5, 1, 1.5, 2, 3, 4, 6}): round half
// to even on the E2M1 grid, saturate to ±6. The sign of a value that rounds to zero is kept; NaN
// gives code 0.
KV_HOST_DEVICE uint8_t float_to_e2m1(float v) {
  if (is_nan(v)) return 0;
  const float a = fabsf(v);
  const uint8_t magnitude = uint8_t(a > 0.25f) + uint8_t(a >= 0.75f) + uint8_t(a > 1.25f) +
                            uint8_t(a >= 1.75f) + uint8_t(a > 2.5f) + uint8_t(a >= 3.5f) +
                            uint8_t(a > 5.0f);
  return uint8_t((float_as_bits(v) >> 28) & 0x8u) | magnitude;
}

// Quantizes one group of 16 fp32 values to NVFP4 (DESIGN.md §5, steps 1-6) given
// inv_global_scale = 1 / global_scale. Writes 8 packed bytes (even element in the low nibble)
// and returns the FP8-e4m3 block-scale byte.
KV_HOST_DEVICE uint8_t nvfp4_quantize_group(const float (&x)[kNvfp4GroupSize], float inv_global_scale,
                                            uint8_t (&packed)[kNvfp4GroupSize / 2]) {
  float amax = 0.0f;
  bool has_nan = false;
#pragma unroll
  for (int i = 0; i < kNvfp4GroupSize; ++i) {
    has_nan |= is_nan(x[i]);
    amax = fmaxf(amax, fabsf(x[i]));
  }
  const float block_scale =
      has_nan ? bits_as_float(0x7FC00000u) : kv_fdiv(kv_fmul(amax, inv_global_scale), kE2M1Max);
  const uint8_t scale_byte = float_to_e4m3_satfinite(block_scale);
  if (scale_byte == kFp8NanByte) {
#pragma unroll
    for (int j = 0; j < kNvfp4GroupSize / 2; ++j) packed[j] = 0;
    return scale_byte;
  }
  const float scale_f = e4m3_to_float(scale_byte);
  const float multiplier = scale_f == 0.0f ? 0.0f : kv_fdiv(inv_global_scale, scale_f);
#pragma unroll
  for (int j = 0; j < kNvfp4GroupSize / 2; ++j) {
    const uint8_t lo = float_to_e2m1(kv_fmul(x[2 * j], multiplier));
    const uint8_t hi = float_to_e2m1(kv_fmul(x[2 * j + 1], multiplier));
    packed[j] = uint8_t((hi << 4) | lo);
  }
  return scale_byte;
}

// Where the block scale of (token t, group s) lives inside a head's [N, S] scale plane.
// Linear: (t, s). Interleave4 (needs N % 4 == 0 and S % 4 == 0): the 4-token interleave read by
// TRT-LLM-generation kernels.
KV_HOST_DEVICE void interleave4_position(int t, int s, int num_groups, int& row, int& col) {
  const int quarter = num_groups / 4;
  row = (t / 4) * 4 + s / quarter;
  col = (s % quarter) * 4 + t % 4;
}

}  // namespace vllm_kv
