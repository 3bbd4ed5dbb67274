// TurboQuant's packed K+V slot (docs/formats.md §6.3): the writer arithmetic shared by the CPU and
// CUDA ops, operation for operation the reference codec vllm/kv_quant/turboquant/codec.py, so
// every writer produces its bytes. Framework-free; host and device.
//
// One slot holds one (token, KV head), little-endian throughout: the key (D e4m3 bytes, or the
// Lloyd-Max codes of the rotated unit key then its fp16 norm), then the value's uniform codes, its
// fp16 scale and fp16 minimum. Codes of b bits pack as a bit stream, code d in bits [b*d, b*d + b).
// The rotation y = k / (|k| + 1e-8) @ PiT is a torch matmul in the glue (the codec's
// rotate_unit_keys, shared with the Triton store), so the kernels code y and store the norm.
#pragma once

#include <cstdint>

#include "dispatch_utils.h"
#include "kv_quant_math.h"
#include "packed_slot.h"

namespace vllm_kv {

constexpr int kTurboQuantFp8KeyBits = 8;
constexpr int kTurboQuantCodeGroup = 8;  // codes per packed group: b bytes hold 8 codes of b bits
constexpr float kTurboQuantValueScaleFloor = 1e-8f;
constexpr int kTurboQuantMaxMidpoints = 15;  // 4-bit Lloyd-Max keys

// One TurboQuant store (the shared geometry in PackedStoreArgs).
struct TurboQuantWriteArgs : PackedStoreArgs {
  const void* key;         // [N, H, D]: the key (FP8 presets) or y, its rotated unit vector (fp32)
  const float* key_norms;  // [N * H] contiguous: the keys' L2 norms (Lloyd-Max presets)
  const float* midpoints;  // [2^key_bits - 1] ascending (Lloyd-Max presets)
  int key_bits;            // 3 or 4 (Lloyd-Max codes) or kTurboQuantFp8KeyBits
  int value_bits;          // 3 or 4
};

// Key bytes of a slot: D e4m3 bytes, or the codes then the fp16 norm.
KV_HOST_DEVICE constexpr int turboquant_key_bytes(int head_dim, int key_bits) {
  return key_bits == kTurboQuantFp8KeyBits ? head_dim : head_dim * key_bits / 8 + 2;
}

// Appends code `code` (< 2^bits) as element j of the current group of 8 codes; the group's
// `bits` bytes go out once its last code is in.
KV_HOST_DEVICE void turboquant_push_code(uint8_t*& dst, uint32_t& word, uint32_t code, int j,
                                         int bits) {
  word |= code << (bits * j);
  if (j == kTurboQuantCodeGroup - 1) {
    for (int byte = 0; byte < bits; ++byte) *dst++ = uint8_t(word >> (8 * byte));
    word = 0;
  }
}

KV_HOST_DEVICE void turboquant_put_fp16(uint8_t* dst, float x) {
  const uint16_t bits = float_to_fp16_bits(x);
  dst[0] = uint8_t(bits);
  dst[1] = uint8_t(bits >> 8);
}

// 1 where the Lloyd-Max key y is at or above midpoint m: a key's code is the number of midpoints it
// is at or above (searchsorted, right side); a NaN is above none, code 0.
KV_HOST_DEVICE uint32_t turboquant_at_or_above(float y, float midpoint) {
  return midpoint <= y ? 1u : 0u;
}

// The value's uniform step over [lo, hi] in `levels` steps, floored.
KV_HOST_DEVICE float turboquant_value_scale(float lo, float hi, int levels) {
  const float scale = kv_fdiv(kv_fsub(hi, lo), float(levels));
  return scale > kTurboQuantValueScaleFloor ? scale : kTurboQuantValueScaleFloor;
}

// trunc((v - lo) / scale + 0.5) clamped to [0, levels]; finite rows stay within. Branch-free, so
// loops over it vectorize.
KV_HOST_DEVICE uint32_t turboquant_value_code(float v, float lo, float scale, int levels) {
  const float t = kv_fadd(kv_fdiv(kv_fsub(v, lo), scale), 0.5f);
  const float clamped = t < float(levels) ? t : float(levels);
  return uint32_t(clamped > 0.0f ? int(clamped) : 0);
}

// Writes the slot of (token, head). KS: element type of the key rows (fp32 for Lloyd-Max keys,
// whose rows are y); VS: the value's. Values are assumed finite, as the codec assumes.
template <SourceType KS, SourceType VS>
KV_HOST_DEVICE void write_turboquant_slot(const TurboQuantWriteArgs& a, int64_t token, int head) {
  using KeyT = typename SourceTraits<KS>::Storage;
  using ValueT = typename SourceTraits<VS>::Storage;
  uint8_t* dst = packed_slot(a, token, head);
  if (dst == nullptr) return;
  const int d = a.head_dim;
  const KeyT* key =
      static_cast<const KeyT*>(a.key) + token * a.key_token_stride + head * a.key_head_stride;
  if (a.key_bits == kTurboQuantFp8KeyBits) {
    for (int i = 0; i < d; ++i)
      *dst++ = float_to_e4m3_satfinite(SourceTraits<KS>::to_float(key[i]));
  } else {
    const int num_mid = (1 << a.key_bits) - 1;
    uint32_t word = 0;
    KV_NO_UNROLL
    for (int i = 0; i < d; ++i) {
      // The number of midpoints <= y (searchsorted, right side); a NaN compares false: code 0.
      const float y = SourceTraits<KS>::to_float(key[i]);
      uint32_t code = 0;
      for (int m = 0; m < num_mid; ++m) code += turboquant_at_or_above(y, a.midpoints[m]);
      turboquant_push_code(dst, word, code, i % kTurboQuantCodeGroup, a.key_bits);
    }
    turboquant_put_fp16(dst, a.key_norms[token * a.num_heads + head]);
    dst += 2;
  }

  const ValueT* value = static_cast<const ValueT*>(a.value) + token * a.value_token_stride +
                        head * a.value_head_stride;
  // The first of equal extremes wins (torch's amin / amax): -0.0 and +0.0 differ in the stored lo.
  float lo = SourceTraits<VS>::to_float(value[0]);
  float hi = lo;
  for (int i = 1; i < d; ++i) {
    const float v = SourceTraits<VS>::to_float(value[i]);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  const int levels = (1 << a.value_bits) - 1;
  const float scale = turboquant_value_scale(lo, hi, levels);
  uint32_t word = 0;
  KV_NO_UNROLL
  for (int i = 0; i < d; ++i) {
    const uint32_t code =
        turboquant_value_code(SourceTraits<VS>::to_float(value[i]), lo, scale, levels);
    turboquant_push_code(dst, word, code, i % kTurboQuantCodeGroup, a.value_bits);
  }
  turboquant_put_fp16(dst, scale);
  turboquant_put_fp16(dst + 2, lo);
}

// Calls fn(SourceTag<KS>{}, SourceTag<VS>{}) for a store's element types: Lloyd-Max keys are fp32
// rows (y); FP8 keys share the value's type.
template <typename Fn>
void dispatch_turboquant_types(bool key_fp8, SourceType value_type, Fn&& fn) {
  dispatch_source_type(value_type, [&](auto vs) {
    if (key_fp8) {
      fn(vs, vs);
    } else {
      fn(SourceTag<SourceType::kFloat32>{}, vs);
    }
  });
}

}  // namespace vllm_kv
