// Octave's side coder (octave_slot.h's octave_code_side) in vector lanes for the CPU op: the same
// operations on every value in the same order (sign flips, Walsh-Hadamard butterflies, the two
// halving-tree sums of each quantization group, codes, scales), with the short butterflies and tree
// levels as lane shuffles instead of a loop per step. Codes go to the scratch for octave_pack, as
// the team steps leave them. Framework-free, host only.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu/writer_lanes.h"
#include "octave_slot.h"

namespace vllm_kv::cpu {

template <int kXor, size_t... kI>
inline F32v lanes_xor_swapped(F32v v, std::index_sequence<kI...>) {
  return __builtin_shufflevector(v, v, int(kI ^ kXor)...);
}

inline I32v lane_index() {
  I32v i;
  for (int l = 0; l < kLanes; ++l) i[l] = l;
  return i;
}

// The in-vector butterflies of strides kStride, kStride / 2, ..., 1 in the order 1, 2, ...: lane i
// with bit s clear becomes a[i] + a[i + s], lane i + s becomes a[i] - a[i + s].
template <int kStride>
inline F32v butterflies_in_vector(F32v v) {
  if constexpr (kStride >= 1) {
    v = butterflies_in_vector<kStride / 2>(v);
    const F32v partner = lanes_xor_swapped<kStride>(v, std::make_index_sequence<kLanes>{});
    return (lane_index() & kStride) != 0 ? partner - v : v + partner;
  } else {
    return v;
  }
}

// The halving-tree sum of `vectors` (a power of two) vectors of values, v destroyed.
inline float tree_sum_lanes(F32v* v, int vectors) {
  for (int n = vectors / 2; n >= 1; n /= 2) {
    for (int j = 0; j < n; ++j) v[j] = v[j] + v[j + n];
  }
  return fold_lanes<kLanes>(v[0], [](F32v a, F32v b) { return a + b; })[0];
}

// The codebook of `bits` bits as a table (levels, then midpoints between adjacent levels).
template <int kBits>
struct OctaveTables {
  float levels[16] = {};
  float midpoints[16] = {};
  constexpr OctaveTables() {
    for (int c = 0; c < (1 << kBits); ++c) levels[c] = float(octave_lut(kBits, c));
    for (int c = 0; c + 1 < (1 << kBits); ++c) midpoints[c] = octave_midpoint(kBits, c);
  }
};

// Codes of the group values x[0 .. vectors) under rms (octave_bucket of x / rms * LUT_MULT, a NaN
// on top) into code[], and the codebook levels of those codes times x into terms[].
template <int kBits>
inline void octave_code_lanes(const F32v* x, int vectors, float rms, uint8_t* code, F32v* terms) {
  static constexpr OctaveTables<kBits> kTables{};
  constexpr float kMult = kBits == 4 ? 46.0f : 59.0f;  // LUT_MULT
  for (int k = 0; k < vectors; ++k) {
    const F32v t = x[k] / rms * kMult;
    const I32v bucket =
        count_above_sorted<Above::kGreaterOrNaN>(t, kTables.midpoints, (1 << kBits) - 1);
    store_lane_bytes(std::bit_cast<U32v>(bucket), code + k * kLanes);
    terms[k] = x[k] * lookup_lanes(bucket, kTables.levels);
  }
}

// octave_code_side's codes and scales for a side whose values are whole vectors (every head size
// the op takes is a multiple of 64), run by one worker.
struct OctaveLaneCoder {
  static constexpr int kMaxVectors = kOctaveMaxHeadDim / kLanes;

  template <typename Team, typename Load, typename PutScale>
  void operator()(const Team&, OctaveScratch& s, int d, const OctaveSide& side,
                  const int32_t* signs, const Load& load, const PutScale& put_scale) const {
    F32v x[kMaxVectors];
    const int vectors = d / kLanes;
    for (int k = 0; k < vectors; ++k) {
      float row[kLanes];
      for (int l = 0; l < kLanes; ++l) row[l] = load(k * kLanes + l);
      const I32v bit = I32v{} + ((k * kLanes) % 32) + lane_index();
      const I32v negate = (I32v{} + signs[k * kLanes / 32]) >> bit & 1;
      std::memcpy(&x[k], row, sizeof(row));
      x[k] = x[k] * (negate != 0 ? F32v{} - 1.0f : F32v{} + 1.0f);
      x[k] = butterflies_in_vector<kLanes / 2>(x[k]);
    }
    for (int stride = kLanes; stride < side.rotation_block; stride *= 2) {
      const int step = stride / kLanes;
      for (int base = 0; base < vectors; base += 2 * step) {
        for (int j = base; j < base + step; ++j) {
          const F32v lo = x[j], hi = x[j + step];
          x[j] = lo + hi;
          x[j + step] = lo - hi;
        }
      }
    }
    const float norm = octave_rotation_norm(side.rotation_block);
    for (int k = 0; k < vectors; ++k) x[k] = x[k] * norm;

    const int groups = d / side.group;
    const int group_vectors = side.group / kLanes;
    const int width_vectors = octave_pow2_ceil(side.group) / kLanes;
    F32v lanes[kMaxVectors];
    for (int g = 0; g < groups; ++g) {
      const F32v* gx = x + g * group_vectors;
      for (int k = 0; k < width_vectors; ++k) lanes[k] = k < group_vectors ? gx[k] * gx[k] : F32v{};
      const float ss = tree_sum_lanes(lanes, width_vectors);
      const float rms = std::sqrt(ss / float(side.group));
      const float floored_rms = rms < kOctaveRmsFloor ? kOctaveRmsFloor : rms;  // NaN stays NaN
      uint8_t* code = s.code + g * side.group;
      for (int k = group_vectors; k < width_vectors; ++k) lanes[k] = F32v{};
      if (g < side.wide_groups || side.narrow_bits == 4) {
        octave_code_lanes<4>(gx, group_vectors, floored_rms, code, lanes);
      } else {
        octave_code_lanes<3>(gx, group_vectors, floored_rms, code, lanes);
      }
      const float dot = tree_sum_lanes(lanes, width_vectors);
      const float floored = dot < kOctaveDotFloor ? kOctaveDotFloor : dot;
      const float scale = (dot > 0.0f ? ss / floored : 0.0f) * kOctaveScaleOne;
      put_scale(g, float_to_fp16_bits(std::fabs(scale)));  // a NaN scale: the positive quiet NaN
    }
  }
};

}  // namespace vllm_kv::cpu
