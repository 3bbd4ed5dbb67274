// Branch-free versions of the per-element encoders of kv_quant_math.h, for the GPU kernels.
//
// The kv_quant_math.h encoders are written as readable if-chains; nvcc turns them into real
// branches and ~25-30 instructions per element, which makes the FP8 and NVFP4 cache writes
// instruction-bound instead of memory-bound on H100/H200. The functions below compute the same
// bytes with integer arithmetic on the fp32 bit pattern and selects:
//   float_to_e4m3_satfinite_fast / float_to_e5m2_satfinite_fast == float_to_e4m3/e5m2_satfinite
//   float_to_e2m1_fast                                           == float_to_e2m1
//   float_to_e2m1_not_nan                                        == float_to_e2m1 (non-NaN input)
//   e4m3_to_float_fast                                           == e4m3_to_float (all 256 bytes)
// for every one of the 2^32 fp32 inputs (exhaustively checked on the host by
// csrc/cuda/tests/check_kv_quant_fast.cpp, which tools/compile_cuda_kernels.sh runs), and
// nvfp4_quantize_group_fast performs exactly the fp32 operations of nvfp4_quantize_group
// (docs/design.md §5, steps 1-6, same order and rounding) with those encoders. Framework-free;
// compiles as host C++ and as CUDA device code.
#pragma once

#include <cstdint>

#include "../kv_quant_math.h"

// `#pragma unroll` in the device pass only (host compilers warn about the unknown pragma).
#if defined(__CUDA_ARCH__)
#define KV_DEVICE_UNROLL _Pragma("unroll")
#else
#define KV_DEVICE_UNROLL
#endif

namespace vllm_kv {

KV_HOST_DEVICE uint32_t kv_umin(uint32_t a, uint32_t b) { return a < b ? a : b; }
KV_HOST_DEVICE uint32_t kv_umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

// kv_fadd (one IEEE fp32 addition, never contracted into an FMA) lives in kv_quant_math.h.

// Round-half-even of |x| to a multiple of 2^kStepExp, as a count of steps, for |x| < 2^(kStepExp
// + 22): adding M = 1.5 * 2^(kStepExp + 23), whose ulp is the step, rounds once (ties to even) and
// leaves the step count in the low mantissa bits. For larger |x| the result is meaningless (and
// callers do not select it).
template <int kStepExp>
KV_HOST_DEVICE uint32_t round_to_steps(float abs_x) {
  constexpr uint32_t kMagicBits = uint32_t(127 + kStepExp + 23) << 23 | 0x400000u;
  return float_as_bits(kv_fadd(abs_x, bits_as_float(kMagicBits))) - kMagicBits;
}

// fp32 -> FP8 (kExpBits, kManBits): round to nearest even, saturate to ±max (±Inf too), NaN ->
// kFp8NanByte. max_bits is the fp32 bit pattern of the largest finite value, max_code its byte.
template <int kExpBits, int kManBits>
KV_HOST_DEVICE uint8_t float_to_fp8_satfinite_fast(float x, uint32_t max_bits, uint32_t max_code) {
  constexpr int kBias = (1 << (kExpBits - 1)) - 1;
  constexpr int kDroppedBits = 23 - kManBits;
  constexpr uint32_t kMinNormalBits = uint32_t(127 + 1 - kBias) << 23;
  const uint32_t bits = float_as_bits(x);
  const uint32_t a = bits & 0x7FFFFFFFu;
  // Normal range: round the mantissa to kManBits (ties to even; a carry bumps the exponent), then
  // rebias the exponent. Unsigned wrap-around for small a is harmless: the value is not selected.
  const uint32_t lsb = (a >> kDroppedBits) & 1u;
  const uint32_t normal = ((a + ((1u << (kDroppedBits - 1)) - 1u) + lsb) >> kDroppedBits) -
                          (uint32_t(127 - kBias) << kManBits);
  // Subnormal range: |x| in units of the subnormal step 2^(1 - bias - kManBits), ties to even.
  const uint32_t subnormal = round_to_steps<1 - kBias - kManBits>(bits_as_float(a));
  uint32_t code = a < kMinNormalBits ? subnormal : normal;
  code = a >= max_bits ? max_code : code;
  code |= (bits >> 24) & 0x80u;
  return uint8_t(a > 0x7F800000u ? uint32_t(kFp8NanByte) : code);
}

KV_HOST_DEVICE uint8_t float_to_e4m3_satfinite_fast(float x) {
  return float_to_fp8_satfinite_fast<4, 3>(x, 0x43E00000u /* 448 */, 0x7Eu);
}

KV_HOST_DEVICE uint8_t float_to_e5m2_satfinite_fast(float x) {
  return float_to_fp8_satfinite_fast<5, 2>(x, 0x47600000u /* 57344 */, 0x7Bu);
}

// FP8 e4m3fn byte -> fp32, exactly e4m3_to_float for every byte (NaN bytes give a NaN). Normal
// codes rebias the exponent; subnormal codes m * 2^-9 are computed as (1 + m/8) * 2^-6 - 2^-6,
// an exact subtraction.
KV_HOST_DEVICE float e4m3_to_float_fast(uint8_t byte) {
  const uint32_t m = byte & 0x7Fu;
  const uint32_t sign = uint32_t(byte & 0x80u) << 24;
  const bool subnormal = m < 8u;
  const float magnitude = bits_as_float((m << 20) + ((subnormal ? 121u : 120u) << 23));
  const float value = subnormal ? kv_fadd(magnitude, -0.015625f) : magnitude;
  return m == 0x7Fu ? bits_as_float(sign | 0x7FC00000u)
                    : bits_as_float(float_as_bits(value) | sign);
}

// fp32 -> E2M1 code for a non-NaN input, as float_to_e2m1: round half to even on
// {0, .5, 1, 1.5, 2, 3, 4, 6}, saturate to ±6, keep the sign of values that round to 0.
KV_HOST_DEVICE uint32_t float_to_e2m1_not_nan(float v) {
  const uint32_t bits = float_as_bits(v);
  const uint32_t a = bits & 0x7FFFFFFFu;
  // |v| >= 1: E2M1 is a 1-mantissa-bit float there; round the fp32 mantissa to 1 bit (ties to
  // even), code = (exponent << 1 | mantissa) - (127 << 1) + 2, saturated to 7 (= 6.0).
  const uint32_t big = kv_umin(((a + 0x1FFFFFu + ((a >> 22) & 1u)) >> 22) - 252u, 7u);
  // |v| < 1: the code is the number of 0.5 steps (0, 1 or 2), ties to even.
  const uint32_t small = round_to_steps<-1>(bits_as_float(a));
  return (a < 0x3F800000u /* 1.0 */ ? small : big) | ((bits >> 28) & 0x8u);
}

// fp32 -> E2M1 code, exactly float_to_e2m1 (NaN -> 0).
KV_HOST_DEVICE uint8_t float_to_e2m1_fast(float v) {
  const uint32_t code = float_to_e2m1_not_nan(v);
  return uint8_t((float_as_bits(v) & 0x7FFFFFFFu) > 0x7F800000u ? 0u : code);
}

// nvfp4_quantize_group with the branch-free encoders: identical fp32 operations in the same order.
// amax and the NaN test come from one integer max over |x_i| bit patterns: for non-NaN values the
// integer order of those patterns is the float order (and equals fmaxf's result, +0 for zeros),
// and any NaN pattern exceeds 0x7F800000. A product x_i * multiplier can only be NaN when the
// multiplier is infinite (0 * Inf; NaN inputs and NaN scales give a NaN group, handled first), so
// the per-element NaN test is needed only then.
KV_HOST_DEVICE uint8_t nvfp4_quantize_group_fast(const float (&x)[kNvfp4GroupSize],
                                                 float inv_global_scale,
                                                 uint8_t (&packed)[kNvfp4GroupSize / 2]) {
  uint32_t amax_bits = 0;
  KV_DEVICE_UNROLL
  for (int i = 0; i < kNvfp4GroupSize; ++i) {
    amax_bits = kv_umax(amax_bits, float_as_bits(x[i]) & 0x7FFFFFFFu);
  }
  const bool has_nan = amax_bits > 0x7F800000u;
  const float block_scale =
      has_nan ? bits_as_float(0x7FC00000u)
              : kv_fdiv(kv_fmul(bits_as_float(amax_bits), inv_global_scale), kE2M1Max);
  const uint8_t scale_byte = float_to_e4m3_satfinite_fast(block_scale);
  if (scale_byte == kFp8NanByte) {
    KV_DEVICE_UNROLL
    for (int j = 0; j < kNvfp4GroupSize / 2; ++j) packed[j] = 0;
    return scale_byte;
  }
  const float scale_f = e4m3_to_float_fast(scale_byte);
  const float multiplier = scale_f == 0.0f ? 0.0f : kv_fdiv(inv_global_scale, scale_f);
  if ((float_as_bits(multiplier) & 0x7FFFFFFFu) < 0x7F800000u) {  // finite: no NaN products
    KV_DEVICE_UNROLL
    for (int j = 0; j < kNvfp4GroupSize / 2; ++j) {
      const uint32_t lo = float_to_e2m1_not_nan(kv_fmul(x[2 * j], multiplier));
      const uint32_t hi = float_to_e2m1_not_nan(kv_fmul(x[2 * j + 1], multiplier));
      packed[j] = uint8_t((hi << 4) | lo);
    }
  } else {
    KV_DEVICE_UNROLL
    for (int j = 0; j < kNvfp4GroupSize / 2; ++j) {
      const uint32_t lo = float_to_e2m1_fast(kv_fmul(x[2 * j], multiplier));
      const uint32_t hi = float_to_e2m1_fast(kv_fmul(x[2 * j + 1], multiplier));
      packed[j] = uint8_t((hi << 4) | lo);
    }
  }
  return scale_byte;
}

}  // namespace vllm_kv
