// Row-at-a-time CPU writers of TurboQuant and ultraquant_4bit slots. The per-value arithmetic is
// turboquant_slot.h's and ultraquant_slot.h's (so the bytes are the CUDA kernels' and the codecs'),
// here in vector lanes (cpu/writer_lanes.h): extremes as integer-ordered lane reductions, codes as
// counts of midpoints, 4-bit codes packed from lane pairs, 3-bit ones eight at a time. The shared
// writers push one code at a time, which suits a CUDA thread, not a vector unit. Framework-free,
// host only.
#pragma once

#include <bit>
#include <climits>
#include <cstdint>
#include <cstring>

#include "cpu/writer_lanes.h"
#include "turboquant_slot.h"
#include "ultraquant_slot.h"

namespace vllm_kv::cpu {

// Values coded per step of a row: a multiple of the 8-code packing group, in L1 with its codes.
constexpr int kPackedRowChunk = 64;

// fp32 bits as an int32 ordered as the floats are (-0.0 just below +0.0); an involution. Int is
// int32_t or a vector of them.
template <typename Int>
inline Int ordered_float_bits(Int bits) {
  return bits ^ ((bits >> 31) & INT32_MAX);
}

// n codes (n a multiple of 8, each < 2^kBits) as a little-endian bit stream: code j in bits
// [kBits * j, kBits * j + kBits), kBits bytes per 8 codes.
template <int kBits>
inline void pack_code_stream(const uint8_t* codes, int n, uint8_t* dst) {
  for (int g = 0; g < n / kTurboQuantCodeGroup; ++g) {
    uint64_t eight;
    std::memcpy(&eight, codes + g * kTurboQuantCodeGroup, sizeof(eight));  // code j: byte j
    uint64_t word = 0;
    for (int j = 0; j < kTurboQuantCodeGroup; ++j) {
      word |= (eight >> ((8 - kBits) * j)) & (((uint64_t(1) << kBits) - 1) << (kBits * j));
    }
    for (int byte = 0; byte < kBits; ++byte) dst[g * kBits + byte] = uint8_t(word >> (8 * byte));
  }
}

// Lane codes at value i of a chunk: 4-bit ones straight into the chunk's bytes (`nibbles`, the
// stream of 4-bit codes), others into `codes` for pack_code_stream.
inline void store_codes(U32v code, int bits, int i, uint8_t* codes, uint8_t* nibbles) {
  if (bits == 4) {
    store_nibble_pairs(code, nibbles + i / 2);
  } else {
    store_lane_bytes(code, codes + i);
  }
}

// Whether the row writer takes a head size: whole vectors of lanes.
inline bool rows_fit(int head_dim) { return head_dim % kLanes == 0; }

// The value row's extremes as the shared writer finds them (NaN skipped, the first of equal
// extremes kept); false where that needs the scalar scan: a NaN first value (which the scalar
// scan keeps), or a zero extreme (+0.0 and -0.0 are equal, the first one's sign is stored).
template <SourceType VS>
inline bool turboquant_row_extremes(const typename SourceTraits<VS>::Storage* row, int d, float& lo,
                                    float& hi) {
  I32v lo_bits = I32v{} + INT32_MAX;
  I32v hi_bits = I32v{} + INT32_MIN;
  for (int i = 0; i < d; i += kLanes) {
    const I32v bits = std::bit_cast<I32v>(load_lanes<VS>(row + i));
    const I32v ordered = ordered_float_bits(bits);
    const I32v number = (bits & INT32_MAX) <= int32_t(0x7F800000u);  // lanes of -1: not NaN
    lo_bits = (number & (ordered < lo_bits)) != 0 ? ordered : lo_bits;
    hi_bits = (number & (ordered > hi_bits)) != 0 ? ordered : hi_bits;
  }
  const int32_t lo_lane =
      fold_lanes<kLanes>(lo_bits, [](I32v a, I32v b) { return a < b ? a : b; })[0];
  const int32_t hi_lane =
      fold_lanes<kLanes>(hi_bits, [](I32v a, I32v b) { return a > b ? a : b; })[0];
  lo = bits_as_float(uint32_t(ordered_float_bits(lo_lane)));
  hi = bits_as_float(uint32_t(ordered_float_bits(hi_lane)));
  return !is_nan(SourceTraits<VS>::to_float(row[0])) && lo != 0.0f && hi != 0.0f;
}

// write_turboquant_slot's bytes, row at a time (through it where a row is no whole vectors).
template <SourceType KS, SourceType VS>
inline void write_turboquant_slot_rows(const TurboQuantWriteArgs& a, int64_t token, int head) {
  using KeyT = typename SourceTraits<KS>::Storage;
  using ValueT = typename SourceTraits<VS>::Storage;
  uint8_t* dst = packed_slot(a, token, head);
  if (dst == nullptr) return;
  const int d = a.head_dim;
  const ValueT* value = static_cast<const ValueT*>(a.value) + token * a.value_token_stride +
                        head * a.value_head_stride;
  float lo, hi;
  if (!rows_fit(d) || !turboquant_row_extremes<VS>(value, d, lo, hi)) {
    write_turboquant_slot<KS, VS>(a, token, head);
    return;
  }
  const KeyT* key =
      static_cast<const KeyT*>(a.key) + token * a.key_token_stride + head * a.key_head_stride;
  uint8_t codes[kPackedRowChunk];
  if (a.key_bits == kTurboQuantFp8KeyBits) {
    for (int i = 0; i < d; i += kLanes) {
      store_lane_bytes(float_to_e4m3_satfinite(load_lanes<KS>(key + i)), dst + i);
    }
    dst += d;
  } else {
    const int num_mid = (1 << a.key_bits) - 1;
    for (int start = 0; start < d; start += kPackedRowChunk) {
      const int n = d - start < kPackedRowChunk ? d - start : kPackedRowChunk;
      for (int i = 0; i < n; i += kLanes) {
        const F32v y = load_lanes<KS>(key + start + i);
        // turboquant_at_or_above summed over the midpoints, lane by lane.
        const I32v code = count_above_sorted<Above::kAtOrAbove>(y, a.midpoints, num_mid);
        store_codes(std::bit_cast<U32v>(code), a.key_bits, i, codes, dst + start / 2);
      }
      if (a.key_bits != 4) pack_code_stream<3>(codes, n, dst + start * 3 / 8);
    }
    dst += d * a.key_bits / 8;
    turboquant_put_fp16(dst, a.key_norms[token * a.num_heads + head]);
    dst += 2;
  }
  const int levels = (1 << a.value_bits) - 1;
  const float scale = turboquant_value_scale(lo, hi, levels);
  for (int start = 0; start < d; start += kPackedRowChunk) {
    const int n = d - start < kPackedRowChunk ? d - start : kPackedRowChunk;
    for (int i = 0; i < n; i += kLanes) {
      // turboquant_value_code lane by lane, the same operations.
      const F32v t = (load_lanes<VS>(value + start + i) - lo) / scale + 0.5f;
      const F32v top = F32v{} + float(levels);
      const F32v clamped = t < top ? t : top;
      const I32v code = clamped > 0.0f ? __builtin_convertvector(clamped, I32v) : I32v{};
      store_codes(std::bit_cast<U32v>(code), a.value_bits, i, codes, dst + start / 2);
    }
    if (a.value_bits != 4) pack_code_stream<3>(codes, n, dst + start * 3 / 8);
  }
  dst += d * a.value_bits / 8;
  turboquant_put_fp16(dst, scale);
  turboquant_put_fp16(dst + 2, lo);
}

// ultraquant_group's bytes for a group of 32 values of type S, lane by lane.
template <SourceType S>
inline void ultraquant_group_row(const typename SourceTraits<S>::Storage* src, float constant_c,
                                 uint8_t* codes, uint8_t* scale_byte) {
  constexpr int kVectors = kUltraQuantGroup / kLanes;
  static constexpr float kMidpoints[kUltraQuantMidpoints] = {
      ultraquant_midpoint(0),  ultraquant_midpoint(1),  ultraquant_midpoint(2),
      ultraquant_midpoint(3),  ultraquant_midpoint(4),  ultraquant_midpoint(5),
      ultraquant_midpoint(6),  ultraquant_midpoint(7),  ultraquant_midpoint(8),
      ultraquant_midpoint(9),  ultraquant_midpoint(10), ultraquant_midpoint(11),
      ultraquant_midpoint(12), ultraquant_midpoint(13)};
  F32v x[kVectors];
  U32v amax_bits{};  // of finite values, the largest magnitude's bits: the largest bits
  U32v nonfinite{};
  for (int k = 0; k < kVectors; ++k) {
    x[k] = load_lanes<S>(src + k * kLanes);
    const U32v magnitude = std::bit_cast<U32v>(x[k]) & 0x7FFFFFFFu;
    nonfinite |= magnitude >= 0x7F800000u;
    amax_bits = magnitude > amax_bits ? magnitude : amax_bits;
  }
  const int e = ultraquant_group_exponent(bits_as_float(lanes_max(amax_bits)),
                                          lanes_or(nonfinite) == 0, constant_c);
  if (e < kUltraQuantMinExp) {
    std::memset(codes, 0, kUltraQuantGroup / 2);
    *scale_byte = 0;
    return;
  }
  // x / 2^e as x * 2^-e: both are the exact quotient rounded once, as 2^-e (e in [-126, 127]) is
  // an fp32, subnormal 2^-127 for e = 127; a multiply costs a fraction of a vector division.
  const float inverse_scale =
      bits_as_float(e < kUltraQuantMaxExp ? uint32_t(kUltraQuantBias - e) << 23 : 0x00400000u);
  for (int k = 0; k < kVectors; ++k) {
    const F32v t = x[k] * inverse_scale;  // ultraquant_code lane by lane
    const I32v idx = count_above_sorted<Above::kGreater>(t, kMidpoints, kUltraQuantMidpoints);
    store_nibble_pairs(std::bit_cast<U32v>(ultraquant_code_of_index(idx)),
                       codes + k * (kLanes / 2));
  }
  *scale_byte = uint8_t(e + kUltraQuantBias);
}

// The slot of (token, head), all of write_ultraquant_unit's units.
template <SourceType VS>
inline void write_ultraquant_slot_rows(const UltraQuantWriteArgs& a, int64_t token, int head) {
  using ValueT = typename SourceTraits<VS>::Storage;
  uint8_t* dst = packed_slot(a, token, head);
  if (dst == nullptr) return;
  const int d = a.head_dim;
  const int groups = d / kUltraQuantGroup;
  const float* key = a.key + token * a.key_token_stride + head * a.key_head_stride;
  const ValueT* value = static_cast<const ValueT*>(a.value) + token * a.value_token_stride +
                        head * a.value_head_stride;
  uint8_t* value_side = dst + d / 2 + groups;
  for (int g = 0; g < groups; ++g) {
    ultraquant_group_row<SourceType::kFloat32>(key + g * kUltraQuantGroup, a.constant_c,
                                               dst + g * kUltraQuantGroup / 2, dst + d / 2 + g);
    ultraquant_group_row<VS>(value + g * kUltraQuantGroup, a.constant_c,
                             value_side + g * kUltraQuantGroup / 2, value_side + d / 2 + g);
  }
}

}  // namespace vllm_kv::cpu
