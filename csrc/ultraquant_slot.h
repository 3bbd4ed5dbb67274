// ultraquant_4bit's packed K+V slot (docs/formats.md §6.4): the writer arithmetic shared by the CPU
// and CUDA ops, operation for operation the reference codec vllm/kv_quant/ultraquant_codec.py, so
// every writer produces its bytes. Framework-free; host and device.
//
// A slot of head size D (G = D / 32 groups a side): K codes (D / 2 bytes, FP4 E2M1, element 2j in
// byte j's low nibble), K scales (G UE8M0 bytes), then V codes and V scales alike. K is the
// Hadamard-rotated key, a torch matmul in the glue (the codec's rotate, so both see the same
// rows); V is the value as given. The unit of work is one group of 32 values of one side.
#pragma once

#include <cstdint>

#include "dispatch_utils.h"
#include "kv_quant_math.h"
#include "packed_slot.h"

namespace vllm_kv {

constexpr int kUltraQuantGroup = 32;
constexpr int kUltraQuantMinExp = -126;
constexpr int kUltraQuantMaxExp = 127;
constexpr int kUltraQuantBias = 127;
// Mantissa bits of the smallest fp32 in [1, 2) above sqrt(2): the snap rounds up from there.
constexpr uint32_t kUltraQuantSqrt2Mantissa = 0x3504F4u;

// One ultraquant_4bit store (the shared geometry in PackedStoreArgs; head_dim a multiple of 32).
struct UltraQuantWriteArgs : PackedStoreArgs {
  const float* key;  // [N, H, D]: the rotated keys (fp32)
  float constant_c;  // s_raw = constant_c * max |x| of a group
};

// Groups of one slot, K's then V's.
KV_HOST_DEVICE int ultraquant_units(int head_dim) { return 2 * (head_dim / kUltraQuantGroup); }

// The UE8M0 exponent of a finite s_raw > 0: the power of two nearest in the log domain (m * 2^E,
// m in [1, 2), rounds up when m > sqrt(2)), clamped; subnormals are below 2^-126 and clamp there.
KV_HOST_DEVICE int ultraquant_scale_exponent(float s_raw) {
  const uint32_t bits = float_as_bits(s_raw);
  const int biased = int((bits >> 23) & 0xFFu);
  if (biased == 0) return kUltraQuantMinExp;
  const int e = biased - kUltraQuantBias + ((bits & 0x7FFFFFu) >= kUltraQuantSqrt2Mantissa ? 1 : 0);
  return e < kUltraQuantMaxExp ? e : kUltraQuantMaxExp;
}

// Midpoint m (in [0, 14)) of the 15 sorted levels -6 .. -0.5, 0, 0.5 .. 6 (signed E2M1 values).
KV_HOST_DEVICE constexpr float ultraquant_midpoint(int m) {
  const int k = m < 7 ? 6 - m : m - 7;  // the magnitude's index: 0.25, 0.75, ..., 5
  const float magnitude =
      k < 4 ? 0.25f + 0.5f * float(k) : (k == 4 ? 2.5f : (k == 5 ? 3.5f : 5.0f));
  return m < 7 ? -magnitude : magnitude;
}

constexpr int kUltraQuantMidpoints = 14;

// The E2M1 code of the level of sorted index idx: -6 .. -0.5 are codes 15 .. 9; 0 .. 6: 0 .. 7.
// Int is int, or a vector of lanes on the CPU.
template <typename Int>
KV_HOST_DEVICE Int ultraquant_code_of_index(Int idx) {
  return idx < 7 ? 15 - idx : idx - 7;
}

// The E2M1 code of t: its index among the 15 sorted levels is the number of midpoints below t
// (a tie takes the lower level, as torch.bucketize), then the sorted index's code.
KV_HOST_DEVICE uint8_t ultraquant_code(float t) {
  int idx = 0;
  KV_UNROLL
  for (int m = 0; m < kUltraQuantMidpoints; ++m) idx += t > ultraquant_midpoint(m) ? 1 : 0;
  return uint8_t(ultraquant_code_of_index(idx));
}

// The scale exponent of a group from its largest magnitude and whether all its values are finite;
// below kUltraQuantMinExp (the group is stored as zero codes and scale byte 0) for a NaN or Inf
// value, or an s_raw that is 0 or overflows.
KV_HOST_DEVICE int ultraquant_group_exponent(float amax, bool finite, float constant_c) {
  const float s_raw = kv_fmul(amax, constant_c);
  if (!finite || !(s_raw > 0.0f) || (float_as_bits(s_raw) & 0x7F800000u) == 0x7F800000u) {
    return kUltraQuantMinExp - 1;
  }
  return ultraquant_scale_exponent(s_raw);
}

// Quantizes one group of 32 values (load(i) widens element i to fp32) into 16 code bytes and its
// scale byte. A group with a NaN or Inf, or whose s_raw is 0 or overflows, gets zero codes and
// byte 0.
template <typename Load>
KV_HOST_DEVICE void ultraquant_group(const Load& load, float constant_c, uint8_t* codes,
                                     uint8_t* scale_byte) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < kUltraQuantGroup; ++i) {
    const float v = load(i);
    finite = finite && (float_as_bits(v) & 0x7F800000u) != 0x7F800000u;
    amax = fmaxf(amax, fabsf(v));
  }
  const int e = ultraquant_group_exponent(amax, finite, constant_c);
  if (e < kUltraQuantMinExp) {
    for (int j = 0; j < kUltraQuantGroup / 2; ++j) codes[j] = 0;
    *scale_byte = 0;
    return;
  }
  const float scale = bits_as_float(uint32_t(e + kUltraQuantBias) << 23);
  KV_NO_UNROLL
  for (int j = 0; j < kUltraQuantGroup / 2; ++j) {
    const uint8_t lo = ultraquant_code(kv_fdiv(load(2 * j), scale));
    const uint8_t hi = ultraquant_code(kv_fdiv(load(2 * j + 1), scale));
    codes[j] = uint8_t(lo | (hi << 4));
  }
  *scale_byte = uint8_t(e + kUltraQuantBias);
}

// Writes unit `unit` (in [0, ultraquant_units(D))) of (token, head)'s slot: K group `unit`, or V
// group `unit - D / 32`. VS: the value's element type.
template <SourceType VS>
KV_HOST_DEVICE void write_ultraquant_unit(const UltraQuantWriteArgs& a, int64_t token, int head,
                                          int unit) {
  using ValueT = typename SourceTraits<VS>::Storage;
  uint8_t* dst = packed_slot(a, token, head);
  if (dst == nullptr) return;
  const int groups = a.head_dim / kUltraQuantGroup;
  const int side_bytes = a.head_dim / 2 + groups;
  if (unit < groups) {
    const float* row =
        a.key + token * a.key_token_stride + head * a.key_head_stride + unit * kUltraQuantGroup;
    ultraquant_group([&](int i) { return row[i]; }, a.constant_c, dst + unit * 16,
                     dst + a.head_dim / 2 + unit);
  } else {
    const int g = unit - groups;
    const ValueT* row = static_cast<const ValueT*>(a.value) + token * a.value_token_stride +
                        head * a.value_head_stride + g * kUltraQuantGroup;
    uint8_t* side = dst + side_bytes;
    ultraquant_group([&](int i) { return SourceTraits<VS>::to_float(row[i]); }, a.constant_c,
                     side + g * 16, side + a.head_dim / 2 + g);
  }
}

}  // namespace vllm_kv
