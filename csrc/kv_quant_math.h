// Scalar quantization arithmetic shared by the CPU and CUDA cache kernels.
//
// Every function here mirrors the pure-torch reference codecs in vllm/kv_quant/ operation for
// operation (docs/design.md §5), so both kernels produce the reference's bytes. No torch headers:
// the file compiles as host C++ and as CUDA device code. Multiplications and divisions go through
// kv_fmul / kv_fdiv so that nvcc can neither fuse nor approximate them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "nvfp4_scale_policy.h"

#if defined(__CUDACC__)
#define KV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KV_HOST_DEVICE inline
#endif

// Full unrolling of short fixed-trip loops, and none of a loop whose unrolled copies would only
// add register pressure, spelled for nvcc and for GCC / Clang.
#if defined(__CUDACC__) || defined(__clang__)
#define KV_UNROLL _Pragma("unroll")
#define KV_NO_UNROLL _Pragma("unroll 1")
#else
#define KV_UNROLL _Pragma("GCC unroll 16")
#define KV_NO_UNROLL _Pragma("GCC unroll 1")
#endif

// Inlines every call in the function's body (a loop's per-index lambda, so that the loop
// vectorizes); host code only.
#if defined(__CUDACC__) || !defined(__GNUC__)
#define KV_FLATTEN
#else
#define KV_FLATTEN __attribute__((flatten))
#endif

// A loop whose iterations are independent (none reads what another writes), which the compiler
// may vectorize without proving it; nothing for nvcc, which does not vectorize.
#if defined(__CUDACC__)
#define KV_INDEPENDENT_ITERATIONS
#elif defined(__clang__)
#define KV_INDEPENDENT_ITERATIONS _Pragma("clang loop vectorize(assume_safety)")
#else
#define KV_INDEPENDENT_ITERATIONS _Pragma("GCC ivdep")
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

// One IEEE fp32 addition / subtraction, never contracted into an FMA.
KV_HOST_DEVICE float kv_fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

KV_HOST_DEVICE float kv_fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// Rounds 0 <= x < 2^22 to an integer, ties to even (the default rounding mode).
KV_HOST_DEVICE float round_half_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  // Adding 2^23 leaves no fraction bits: the sum is rounded to an integer by the FPU. Unlike
  // std::nearbyint (a libm call) this is two instructions and vectorises.
  constexpr float kTwoPow23 = 8388608.0f;
  return (x + kTwoPow23) - kTwoPow23;
#endif
}

KV_HOST_DEVICE bool is_nan(float x) { return (float_as_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }

// Widening conversions of the 16-bit source formats: exact, subnormals, Inf and NaN included.
KV_HOST_DEVICE float bf16_bits_to_float(uint16_t h) { return bits_as_float(uint32_t(h) << 16); }

KV_HOST_DEVICE float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  // Branch-free, like float_to_fp8_satfinite. Zero or subnormal: mantissa * 2^-24, exact.
  const uint32_t subnormal = float_as_bits(float(mantissa) * 5.9604644775390625e-08f);
  const uint32_t normal = ((exponent + 112u) << 23) | (mantissa << 13);
  const uint32_t inf_or_nan = 0x7F800000u | (mantissa << 13);
  uint32_t magnitude = exponent == 0 ? subnormal : normal;
  magnitude = exponent == 0x1Fu ? inf_or_nan : magnitude;
  return bits_as_float(sign | magnitude);
}

// fp32 -> FP8 with kExpBits exponent and kManBits mantissa bits: round to nearest even, saturate
// to ±max_value (±Inf too), NaN -> kFp8NanByte. max_code is the byte of max_value. Branch-free
// (every case is computed, then selected) so that loops over it vectorise and warps do not diverge.
template <int kExpBits, int kManBits>
KV_HOST_DEVICE uint8_t float_to_fp8_satfinite(float x, float max_value, uint8_t max_code) {
  constexpr int kBias = (1 << (kExpBits - 1)) - 1;
  constexpr int kDroppedBits = 23 - kManBits;
  const uint32_t bits = float_as_bits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  const float magnitude = bits_as_float(abs_bits);
  // Smallest normal: 2^(1 - bias). Below it the code is the magnitude in units of the
  // subnormal step 2^(1 - bias - kManBits); a result of 2^kManBits is the smallest normal.
  // (Clamping keeps the rounded value small, and NaN out, where it is not used.)
  const float min_normal = bits_as_float(uint32_t(127 + 1 - kBias) << 23);
  const float to_steps = bits_as_float(uint32_t(127 - (1 - kBias - kManBits)) << 23);
  const float clamped = magnitude < min_normal ? magnitude : min_normal;
  const uint32_t subnormal = uint32_t(int32_t(round_half_even(kv_fmul(clamped, to_steps))));
  // Normal: ties to even on the kept mantissa bits; a carry bumps the exponent.
  const uint32_t rounded =
      abs_bits + ((1u << (kDroppedBits - 1)) - 1u) + ((abs_bits >> kDroppedBits) & 1u);
  const uint32_t exponent = (rounded >> 23) - 127u + kBias;
  const uint32_t mantissa = (rounded >> kDroppedBits) & ((1u << kManBits) - 1u);
  const uint32_t normal = (exponent << kManBits) | mantissa;
  uint32_t code = magnitude < min_normal ? subnormal : normal;
  code = magnitude >= max_value ? uint32_t(max_code) : code;  // ±Inf included
  return uint8_t(abs_bits > 0x7F800000u ? uint32_t(kFp8NanByte) : (sign | code));
}

KV_HOST_DEVICE uint8_t float_to_e4m3_satfinite(float x) {
  return float_to_fp8_satfinite<4, 3>(x, kFp8E4M3Max, 0x7E);
}

KV_HOST_DEVICE uint8_t float_to_e5m2_satfinite(float x) {
  return float_to_fp8_satfinite<5, 2>(x, kFp8E5M2Max, 0x7B);
}

// FP8 e4m3fn byte -> fp32 (exact). Branch-free, like float_to_fp8_satfinite.
KV_HOST_DEVICE float e4m3_to_float(uint8_t byte) {
  const uint32_t sign = uint32_t(byte & 0x80u) << 24;
  const uint32_t exponent = (byte >> 3) & 0xFu;
  const uint32_t mantissa = byte & 0x7u;
  const uint32_t subnormal = float_as_bits(float(mantissa) * 0.001953125f);  // mantissa * 2^-9
  const uint32_t normal = ((exponent + 120u) << 23) | (mantissa << 20);
  uint32_t magnitude = exponent == 0 ? subnormal : normal;
  magnitude = (byte & 0x7Fu) == 0x7Fu ? 0x7FC00000u : magnitude;
  return bits_as_float(sign | magnitude);
}

// FP8 e5m2 byte -> fp32 (exact): e5m2 is the upper byte of an fp16 with the same value.
KV_HOST_DEVICE float e5m2_to_float(uint8_t byte) {
  return fp16_bits_to_float(uint16_t(uint16_t(byte) << 8));
}

// fp32 -> bf16 bits: round to nearest even on the upper 16 bits (a carry may give ±Inf, as it
// should); a NaN stays a quiet NaN. torch's fp32 -> bf16 cast gives the same bits for non-NaN x.
KV_HOST_DEVICE uint16_t float_to_bf16_bits(float x) {
  const uint32_t bits = float_as_bits(x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return uint16_t(is_nan(x) ? ((bits >> 16) | 0x40u) : rounded);
}

// fp32 -> IEEE fp16 bits: round to nearest even, subnormal results kept, |x| >= 65520 (±Inf
// included) -> ±Inf, a NaN -> the quiet NaN 0x7E00 with its sign. torch's fp32 -> fp16 cast on the
// CPU gives the same bits for every x. Branch-free, like float_to_fp8_satfinite (fp16 has no
// saturation: it overflows).
KV_HOST_DEVICE uint16_t float_to_fp16_bits(float x) {
  constexpr uint32_t kMinNormalBits = 0x38800000u;  // 2^-14
  constexpr uint32_t kToInfBits = 0x477FF000u;      // 65520: the tie above 65504 rounds up
  const uint32_t bits = float_as_bits(x);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  // Normal: ties to even on the 10 kept mantissa bits; a carry bumps the exponent (rebias 127 ->
  // 15). Wrong for |x| below 2^-14 or from 65520 on, where it is not selected.
  const uint32_t normal =
      ((abs_bits + 0xFFFu + ((abs_bits >> 13) & 1u)) >> 13) - (uint32_t(127 - 15) << 10);
  // Subnormal: |x| in units of 2^-24, ties to even (1024 units is the smallest normal, 0x0400).
  const float min_normal = bits_as_float(kMinNormalBits);
  const float magnitude = bits_as_float(abs_bits);
  const float clamped = magnitude < min_normal ? magnitude : min_normal;
  const uint32_t subnormal =
      uint32_t(int32_t(round_half_even(kv_fmul(clamped, 16777216.0f /* 2^24 */))));
  uint32_t code = abs_bits < kMinNormalBits ? subnormal : normal;
  code = abs_bits >= kToInfBits ? 0x7C00u : code;
  code = abs_bits > 0x7F800000u ? 0x7E00u : code;
  return uint16_t(sign | code);
}

// fp32 -> E2M1 code (bit 3 = sign, bits 0-2 = index into {0, .5, 1, 1.5, 2, 3, 4, 6}): round half
// to even on the E2M1 grid, saturate to ±6. The sign of a value that rounds to zero is kept; NaN
// gives code 0.
KV_HOST_DEVICE uint8_t float_to_e2m1(float v) {
  const float a = fabsf(v);  // NaN fails every comparison: magnitude 0
  const uint8_t magnitude = uint8_t(a > 0.25f) + uint8_t(a >= 0.75f) + uint8_t(a > 1.25f) +
                            uint8_t(a >= 1.75f) + uint8_t(a > 2.5f) + uint8_t(a >= 3.5f) +
                            uint8_t(a > 5.0f);
  const uint8_t sign = is_nan(v) ? 0 : uint8_t((float_as_bits(v) >> 28) & 0x8u);  // branch-free
  return sign | magnitude;
}

// NVFP4 block-scale byte of a group (docs/design.md §5, steps 1-3, 6) from its amax = max |x_i| and
// whether it holds a NaN: e4m3_satfinite((amax * inv_global_scale) / 6), kFp8NanByte for NaN.
KV_HOST_DEVICE uint8_t nvfp4_scale_byte(float amax, bool has_nan, float inv_global_scale) {
  const float block_scale =
      has_nan ? bits_as_float(0x7FC00000u) : kv_fdiv(kv_fmul(amax, inv_global_scale), kE2M1Max);
  return float_to_e4m3_satfinite(block_scale);
}

// Step 4: the multiplier that maps a group's values onto the E2M1 grid (0 for a zero scale).
// Not for the NaN scale byte, whose group is all-zero data.
KV_HOST_DEVICE float nvfp4_multiplier(uint8_t scale_byte, float inv_global_scale) {
  const float scale_f = e4m3_to_float(scale_byte);
  return scale_f == 0.0f ? 0.0f : kv_fdiv(inv_global_scale, scale_f);
}

// The group's largest magnitude (fmaxf skips NaN); has_nan says whether a NaN was seen.
KV_HOST_DEVICE float nvfp4_group_amax(const float (&x)[kNvfp4GroupSize], bool& has_nan) {
  float amax = 0.0f;
  KV_UNROLL
  for (int i = 0; i < kNvfp4GroupSize; ++i) {
    has_nan |= is_nan(x[i]);
    amax = fmaxf(amax, fabsf(x[i]));
  }
  return amax;
}

// Quantizes one group of 16 fp32 values to NVFP4 (docs/design.md §5, steps 1-6) given
// inv_global_scale = 1 / global_scale. Writes 8 packed bytes (even element in the low nibble)
// and returns the FP8-e4m3 block-scale byte.
KV_HOST_DEVICE uint8_t nvfp4_quantize_group(const float (&x)[kNvfp4GroupSize],
                                            float inv_global_scale,
                                            uint8_t (&packed)[kNvfp4GroupSize / 2]) {
  bool has_nan = false;
  const float amax = nvfp4_group_amax(x, has_nan);
  const uint8_t scale_byte = nvfp4_scale_byte(amax, has_nan, inv_global_scale);
  if (scale_byte == kFp8NanByte) {
    KV_UNROLL
    for (int j = 0; j < kNvfp4GroupSize / 2; ++j) packed[j] = 0;
    return scale_byte;
  }
  const float multiplier = nvfp4_multiplier(scale_byte, inv_global_scale);
  KV_UNROLL
  for (int j = 0; j < kNvfp4GroupSize / 2; ++j) {
    const uint8_t lo = float_to_e2m1(kv_fmul(x[2 * j], multiplier));
    const uint8_t hi = float_to_e2m1(kv_fmul(x[2 * j + 1], multiplier));
    packed[j] = uint8_t((hi << 4) | lo);
  }
  return scale_byte;
}

// fp32 magnitude of E2M1 code bits 0-2, with the sign of bit 3 (code 8 is -0.0).
KV_HOST_DEVICE float e2m1_to_float(uint8_t code) {
  const uint8_t m = code & 0x7u;
  const float magnitude =
      m < 4 ? 0.5f * float(m) : (m == 4 ? 2.0f : (m == 5 ? 3.0f : (m == 6 ? 4.0f : 6.0f)));
  return (code & 0x8u) ? -magnitude : magnitude;
}

// The squared error of one group under candidate scale byte c (docs/design.md §5.3, nvfp4_mse step
// 3): codes by step 5 with mult = inv / float(c) (0 for c == 0), then
// err = sum_{i = 0..15} (E2M1[code_i] * c_f - x_i * inv)^2, every op one rounded fp32 op, summed
// strictly in order i = 0, 1, ..., 15.
KV_HOST_DEVICE float nvfp4_candidate_error(const float (&x)[kNvfp4GroupSize], uint8_t c,
                                           float inv_global_scale) {
  const float c_f = e4m3_to_float(c);
  const float mult = nvfp4_multiplier(c, inv_global_scale);
  float err = 0.0f;
  KV_UNROLL
  for (int i = 0; i < kNvfp4GroupSize; ++i) {
    const float q = e2m1_to_float(float_to_e2m1(kv_fmul(x[i], mult)));
    const float d = kv_fsub(kv_fmul(q, c_f), kv_fmul(x[i], inv_global_scale));
    err = kv_fadd(err, kv_fmul(d, d));
  }
  return err;
}

// nvfp4_mse (docs/design.md §5.3): the plain block-scale byte sf, then the e4m3 bytes sf, sf - 1,
// sf + 1 (in that order, within [0x00, 0x7E]) are tried and the one with the smallest squared group
// error wins (ties: the earlier); its codes are those of step 5 under it. NaN, all-zero and Inf
// groups keep the plain rule. Same outputs as nvfp4_quantize_group.
KV_HOST_DEVICE uint8_t nvfp4_mse_quantize_group(const float (&x)[kNvfp4GroupSize],
                                                float inv_global_scale,
                                                uint8_t (&packed)[kNvfp4GroupSize / 2]) {
  bool has_nan = false;
  const float amax = nvfp4_group_amax(x, has_nan);
  const bool has_inf = float_as_bits(amax) == 0x7F800000u;
  if (has_nan || has_inf || amax == 0.0f) {
    return nvfp4_quantize_group(x, inv_global_scale, packed);
  }
  const uint8_t sf = nvfp4_scale_byte(amax, false, inv_global_scale);
  uint8_t best = sf;
  float best_err = nvfp4_candidate_error(x, sf, inv_global_scale);
  KV_UNROLL
  for (int k = 0; k < 2; ++k) {
    const int c = k == 0 ? int(sf) - 1 : int(sf) + 1;
    if (c < 0 || c > 0x7E) continue;
    const float err = nvfp4_candidate_error(x, uint8_t(c), inv_global_scale);
    if (err < best_err) {  // strictly smaller: a tie keeps the earlier candidate
      best_err = err;
      best = uint8_t(c);
    }
  }
  const float multiplier = nvfp4_multiplier(best, inv_global_scale);
  KV_UNROLL
  for (int j = 0; j < kNvfp4GroupSize / 2; ++j) {
    const uint8_t lo = float_to_e2m1(kv_fmul(x[2 * j], multiplier));
    const uint8_t hi = float_to_e2m1(kv_fmul(x[2 * j + 1], multiplier));
    packed[j] = uint8_t((hi << 4) | lo);
  }
  return best;
}

// 1 / v rounded to fp32 with subnormal inputs and results flushed to signed zero: upstream's
// rcp.approx.ftz.f32 in its 4over6 writer, taken as correctly rounded (vllm.kv_quant.nvfp4).
KV_HOST_DEVICE float nvfp4_rcp_ftz(float v) {
  const uint32_t bits = float_as_bits(v);
  if ((bits & 0x7FFFFFFFu) < 0x00800000u) return bits_as_float((bits & 0x80000000u) | 0x7F800000u);
  const float r = kv_fdiv(1.0f, v);
  const uint32_t r_bits = float_as_bits(r);
  return (r_bits & 0x7FFFFFFFu) < 0x00800000u ? bits_as_float(r_bits & 0x80000000u) : r;
}

struct Nvfp4Candidate {
  uint8_t scale_byte;
  float multiplier;  // maps the group onto the E2M1 grid (0 for a zero scale)
  float error;       // squared group error, NaN for a NaN group
};

// One nvfp4_4over6 candidate, block scale amax / denominator: sf = e4m3(inv * (amax * rcp(d))),
// mult = rcp(float(sf) * rcp(inv)), error = sum over pairs k = 0..7 (in order) of
// (d_2k^2 + d_2k+1^2), d_i = E2M1(x_i * mult) * rcp(mult) - x_i; one rounded fp32 op each.
KV_HOST_DEVICE Nvfp4Candidate nvfp4_4over6_candidate(const float (&x)[kNvfp4GroupSize], float amax,
                                                     bool has_nan, float inv, float inv_rcp,
                                                     float denominator) {
  const float t = has_nan ? bits_as_float(0x7FC00000u)
                          : kv_fmul(inv, kv_fmul(amax, nvfp4_rcp_ftz(denominator)));
  const uint8_t sf = float_to_e4m3_satfinite(t);
  const float sf_f = e4m3_to_float(sf);
  const float mult = sf_f == 0.0f ? 0.0f : nvfp4_rcp_ftz(kv_fmul(sf_f, inv_rcp));
  const float deq = mult == 0.0f ? 0.0f : nvfp4_rcp_ftz(mult);
  float err = 0.0f;
  KV_UNROLL
  for (int i = 0; i < kNvfp4GroupSize; i += 2) {
    const float d0 = kv_fsub(kv_fmul(e2m1_to_float(float_to_e2m1(kv_fmul(x[i], mult))), deq), x[i]);
    const float d1 =
        kv_fsub(kv_fmul(e2m1_to_float(float_to_e2m1(kv_fmul(x[i + 1], mult))), deq), x[i + 1]);
    err = kv_fadd(err, kv_fadd(kv_fmul(d0, d0), kv_fmul(d1, d1)));
  }
  return {sf, mult, err};
}

// nvfp4_4over6 (upstream v0.33 cvt_warp_fp16_to_fp4_4over6): the group's block scale is amax / 6
// or amax / 4, the latter only where its squared error is strictly lower (ties and NaN keep /6);
// codes E2M1(x_i * mult). A NaN group gets scale byte kFp8NanByte and all-zero data.
KV_HOST_DEVICE uint8_t nvfp4_4over6_quantize_group(const float (&x)[kNvfp4GroupSize],
                                                   float inv_global_scale,
                                                   uint8_t (&packed)[kNvfp4GroupSize / 2]) {
  bool has_nan = false;
  const float amax = nvfp4_group_amax(x, has_nan);
  const float inv_rcp = nvfp4_rcp_ftz(inv_global_scale);
  const Nvfp4Candidate c6 =
      nvfp4_4over6_candidate(x, amax, has_nan, inv_global_scale, inv_rcp, kE2M1Max);
  const Nvfp4Candidate c4 =
      nvfp4_4over6_candidate(x, amax, has_nan, inv_global_scale, inv_rcp, 4.0f);
  const Nvfp4Candidate& best = c4.error < c6.error ? c4 : c6;
  KV_UNROLL
  for (int j = 0; j < kNvfp4GroupSize / 2; ++j) {
    const uint8_t lo = float_to_e2m1(kv_fmul(x[2 * j], best.multiplier));
    const uint8_t hi = float_to_e2m1(kv_fmul(x[2 * j + 1], best.multiplier));
    packed[j] = uint8_t((hi << 4) | lo);
  }
  return best.scale_byte;
}

// One group under `policy` (kNearest: the scalar nvfp4_quantize_group).
KV_HOST_DEVICE uint8_t nvfp4_policy_quantize_group(Nvfp4ScalePolicy policy,
                                                   const float (&x)[kNvfp4GroupSize],
                                                   float inv_global_scale,
                                                   uint8_t (&packed)[kNvfp4GroupSize / 2]) {
  switch (policy) {
    case Nvfp4ScalePolicy::kMse:
      return nvfp4_mse_quantize_group(x, inv_global_scale, packed);
    case Nvfp4ScalePolicy::k4over6:
      return nvfp4_4over6_quantize_group(x, inv_global_scale, packed);
    default:
      return nvfp4_quantize_group(x, inv_global_scale, packed);
  }
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
