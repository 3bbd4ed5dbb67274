// Octave's packed K+V slots (octave_slot.h) written kLanes at a time by the CPU op: lane l of every
// vector belongs to slot l of a run of consecutive slots, so each step of octave_code_side (sign
// flips, Walsh-Hadamard butterflies, the halving-tree sums of each quantization group, codes,
// scales, packed words) is one vector operation per value index, lane for lane the team steps'
// operations in their order: the same bits, with no shuffles but the kLanes x kLanes transposes
// that bring the rows in. Framework-free, host only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu/writer_lanes.h"
#include "octave_slot.h"

namespace vllm_kv::cpu {

// Rows r and r + kB of m (r with bit kB clear) swap their off-diagonal kB-lane blocks.
template <int kB, typename V, size_t... kI>
inline void swap_lane_blocks(V* m, std::index_sequence<kI...>) {
  for (int r = 0; r < kLanes; ++r) {
    if (r & kB) continue;
    const V lo = m[r], hi = m[r + kB];
    m[r] = __builtin_shufflevector(lo, hi, int((kI & kB) ? kLanes + kI - kB : kI)...);
    m[r + kB] = __builtin_shufflevector(lo, hi, int((kI & kB) ? kLanes + kI : kI + kB)...);
  }
}

// Transposes the kLanes x kLanes matrix of kLanes vectors m (lane j of m[r] becomes lane r of
// m[j]) in log2(kLanes) block swaps.
template <int kB = kLanes / 2, typename V>
inline void transpose_lanes(V* m) {
  if constexpr (kB >= 1) {
    swap_lane_blocks<kB>(m, std::make_index_sequence<kLanes>{});
    transpose_lanes<kB / 2>(m);
  }
}

// The codebook of `bits` bits as tables: levels, then the midpoints between adjacent levels.
template <int kBits>
struct OctaveTables {
  float levels[16] = {};
  float midpoints[16] = {};
  constexpr OctaveTables() {
    for (int c = 0; c < (1 << kBits); ++c) levels[c] = float(octave_lut(kBits, c));
    for (int c = 0; c + 1 < (1 << kBits); ++c) midpoints[c] = octave_midpoint(kBits, c);
  }
};

// One worker's vectors (lane l: slot l): a side's rotated values, the sum trees, the codes.
struct OctaveSlotLanes {
  F32v x[kOctaveMaxHeadDim];
  F32v sums[kOctaveMaxHeadDim];
  I32v code[kOctaveMaxHeadDim];
};

// t[0] = the sum of t[0 .. width) in the codec's halving-tree order (tree_sum), lane by lane.
inline F32v tree_sum_lanes(F32v* t, int width) {
  for (int w = width / 2; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) t[i] = t[i] + t[i + w];
  }
  return t[0];
}

// kLevels butterfly levels, strides stride, 2 stride, ..., on the 2^kLevels vectors
// x[j + m * stride] of each run in registers (the codec's order: the shortest stride first), then,
// with kScale (the rotation's last levels), times `norm`.
template <int kLevels, bool kScale>
inline void butterfly_pass(F32v* x, int d, int stride, float norm) {
  constexpr int kRun = 1 << kLevels;
  for (int base = 0; base < d; base += kRun * stride) {
    for (int j = base; j < base + stride; ++j) {
      F32v v[kRun];
      for (int m = 0; m < kRun; ++m) v[m] = x[j + m * stride];
      for (int w = 1; w < kRun; w *= 2) {
        for (int m = 0; m < kRun; ++m) {
          if (m & w) continue;
          const F32v lo = v[m], hi = v[m + w];
          v[m] = lo + hi;
          v[m + w] = lo - hi;
        }
      }
      for (int m = 0; m < kRun; ++m) x[j + m * stride] = kScale ? v[m] * norm : v[m];
    }
  }
}

// Codes of values x[0 .. n) of one group under rms (octave_bucket of x / rms * LUT_MULT, a NaN on
// top) into code[], and the codebook levels of those codes times x into terms[].
template <int kBits>
inline void octave_code_group(const F32v* x, int n, F32v rms, I32v* code, F32v* terms) {
  static constexpr OctaveTables<kBits> kTables{};
  constexpr float kMult = kBits == 4 ? 46.0f : 59.0f;  // LUT_MULT
  for (int i = 0; i < n; ++i) {
    const F32v t = x[i] / rms * kMult;
    code[i] = count_above_sorted<Above::kGreaterOrNaN>(t, kTables.midpoints, (1 << kBits) - 1);
    terms[i] = x[i] * lookup_lanes(code[i], kTables.levels);
  }
}

// octave_code_side on kLanes rows at once (rows[l]: slot l's d values of type S): codes in
// s.code, and the fp16 bits of group g's scale of slot l in scale_bits[g][l].
template <SourceType S>
inline void octave_code_slots(OctaveSlotLanes& s, int d, const OctaveSide& side,
                              const int32_t* signs,
                              const typename SourceTraits<S>::Storage* const* rows,
                              uint16_t (*scale_bits)[kLanes]) {
  F32v* x = s.x;
  for (int c = 0; c < d; c += kLanes) {
    for (int l = 0; l < kLanes; ++l) x[c + l] = load_lanes<S>(rows[l] + c);
    transpose_lanes(x + c);
    for (int j = 0; j < kLanes; ++j) {
      const int i = c + j;
      const bool negate = (uint32_t(signs[i / 32]) >> (i % 32)) & 1u;
      x[i] = x[i] * (negate ? -1.0f : 1.0f);
    }
  }
  const int levels = octave_log2(side.rotation_block);
  const float norm = octave_rotation_norm(side.rotation_block);
  for (int level = 0; level < levels; level += 3) {  // three levels per pass over x
    const int stride = 1 << level;
    if (levels - level == 1) {
      butterfly_pass<1, true>(x, d, stride, norm);
    } else if (levels - level == 2) {
      butterfly_pass<2, true>(x, d, stride, norm);
    } else if (levels - level == 3) {
      butterfly_pass<3, true>(x, d, stride, norm);
    } else {
      butterfly_pass<3, false>(x, d, stride, norm);
    }
  }

  const int width = octave_pow2_ceil(side.group);
  for (int g = 0; g < d / side.group; ++g) {
    const F32v* gx = x + g * side.group;
    F32v* t = s.sums;
    for (int i = 0; i < width; ++i) t[i] = i < side.group ? gx[i] * gx[i] : F32v{};
    const F32v ss = tree_sum_lanes(t, width);
    const F32v mean_square = ss / float(side.group);
    F32v rms = mean_square;  // each lane overwritten with its floored square root
    for (int l = 0; l < kLanes; ++l) {
      const float r = std::sqrt(mean_square[l]);
      rms[l] = r < kOctaveRmsFloor ? kOctaveRmsFloor : r;  // NaN stays NaN
    }
    for (int i = side.group; i < width; ++i) t[i] = F32v{};
    if (g < side.wide_groups || side.narrow_bits == 4) {
      octave_code_group<4>(gx, side.group, rms, s.code + g * side.group, t);
    } else {
      octave_code_group<3>(gx, side.group, rms, s.code + g * side.group, t);
    }
    const F32v dot = tree_sum_lanes(t, width);
    for (int l = 0; l < kLanes; ++l) {
      const float floored = dot[l] < kOctaveDotFloor ? kOctaveDotFloor : dot[l];
      const float scale = (dot[l] > 0.0f ? ss[l] / floored : 0.0f) * kOctaveScaleOne;
      scale_bits[g][l] = float_to_fp16_bits(std::fabs(scale));  // NaN: the positive quiet NaN
    }
  }
}

// Lane l of `word` as 4 bytes at dst[l] + offset, for each slot written (dst[l] not null).
inline void store_lane_words(U32v word, uint8_t* const* dst, int offset) {
  for (int l = 0; l < kLanes; ++l) {
    if (dst[l] != nullptr) octave_put_word(dst[l] + offset, word[l]);
  }
}

// octave_pack of n codes (a multiple of 32) of every lane at dst[l] + offset: the same words
// (4-bit: byte q of word w holds dim 8w + q low, 8w + q + 4 high; 3-bit: a 2-bit plane, byte b
// of word w holding dims 16w + 4q + b at bits 2q, then a 1-bit plane, byte b of word w holding
// bit 2 of dims 32w + 4q + b at bit q), built lane by lane.
inline void octave_pack_slots(const I32v* code, int n, int bits, uint8_t* const* dst, int offset) {
  const auto u = [&](int i) { return std::bit_cast<U32v>(code[i]); };
  if (bits == 4) {
    for (int w = 0; w < n / 8; ++w) {
      U32v word{};
      for (int q = 0; q < 4; ++q) word |= (u(8 * w + q) | u(8 * w + q + 4) << 4) << (8 * q);
      store_lane_words(word, dst, offset + 4 * w);
    }
    return;
  }
  for (int w = 0; w < n / 16; ++w) {
    U32v word{};
    for (int q = 0; q < 4; ++q) {
      for (int b = 0; b < 4; ++b) word |= (u(16 * w + 4 * q + b) & 3u) << (8 * b + 2 * q);
    }
    store_lane_words(word, dst, offset + 4 * w);
  }
  for (int w = 0; w < n / 32; ++w) {
    U32v word{};
    for (int q = 0; q < 8; ++q) {
      for (int b = 0; b < 4; ++b) word |= (u(32 * w + 4 * q + b) >> 2 & 1u) << (8 * b + q);
    }
    store_lane_words(word, dst, offset + n / 4 + 4 * w);
  }
}

// Writes slots first .. first + count - 1 of the store's (token, head) order (count <= kLanes;
// unused lanes repeat the last slot's rows and store nothing): both sides, the bytes of
// write_octave_side.
template <SourceType VS>
void write_octave_slots(const OctaveWriteArgs& a, OctaveSlotLanes& s, int64_t first, int count) {
  using T = typename SourceTraits<VS>::Storage;
  uint8_t* dst[kLanes];
  const T* key_rows[kLanes];
  const T* value_rows[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    const int64_t slot = first + (l < count ? l : count - 1);
    const int64_t token = slot / a.num_heads;
    const int head = int(slot % a.num_heads);
    dst[l] = l < count ? packed_slot(a, token, head) : nullptr;
    key_rows[l] =
        static_cast<const T*>(a.key) + token * a.key_token_stride + head * a.key_head_stride;
    value_rows[l] =
        static_cast<const T*>(a.value) + token * a.value_token_stride + head * a.value_head_stride;
  }
  const int d = a.head_dim;
  // The rows of the next run, read while this one is coded: its loads come out of the cache.
  const int64_t slots = a.num_tokens * a.num_heads;
  for (int64_t slot = first + kLanes; slot < first + 2 * kLanes && slot < slots; ++slot) {
    const int64_t token = slot / a.num_heads;
    const int head = int(slot % a.num_heads);
    const T* k =
        static_cast<const T*>(a.key) + token * a.key_token_stride + head * a.key_head_stride;
    const T* v =
        static_cast<const T*>(a.value) + token * a.value_token_stride + head * a.value_head_stride;
    for (int64_t byte = 0; byte < int64_t(d) * int64_t(sizeof(T)); byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k) + byte);
      __builtin_prefetch(reinterpret_cast<const char*>(v) + byte);
    }
  }
  const OctaveOffsets o = octave_offsets(d, a.rope_dim, a.value_bits, a.compact);
  const int k_scales = octave_num_k_scales(d, a.compact);
  uint16_t scale_bits[kOctaveMaxHeadDim / kOctaveBlock + 1][kLanes];
  octave_code_slots<VS>(s, d, octave_key_side(a), a.key_signs, key_rows, scale_bits);
  const int wide = a.compact ? 0 : a.rope_dim;
  octave_pack_slots(s.code, wide, kOctaveRopeBits, dst, 0);
  octave_pack_slots(s.code + wide, d - wide, kOctaveNopeBits, dst, o.k_nope);
  octave_code_slots<VS>(s, d, octave_value_side(a), a.value_signs, value_rows,
                        scale_bits + k_scales);
  octave_pack_slots(s.code, d, a.value_bits, dst, o.v);
  const int used = o.scales + 2 * (k_scales + 1);
  const int end = octave_slot_bytes(d, a.rope_dim, a.value_bits, a.compact);
  for (int l = 0; l < kLanes; ++l) {
    if (dst[l] == nullptr) continue;
    for (int g = 0; g <= k_scales; ++g) {
      dst[l][o.scales + 2 * g] = uint8_t(scale_bits[g][l]);
      dst[l][o.scales + 2 * g + 1] = uint8_t(scale_bits[g][l] >> 8);
    }
    std::memset(dst[l] + used, 0, size_t(end - used));  // the codec's zero padding
  }
}

}  // namespace vllm_kv::cpu
