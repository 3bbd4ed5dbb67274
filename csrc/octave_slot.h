// Octave's packed K+V slot (docs/formats.md §6.5): the layout and the writer shared by the CPU and
// CUDA ops, operation for operation the reference codec vllm/kv_quant/octave_codec.py, so every
// writer produces its bytes. Framework-free; host and device.
//
// A side (K or V) is coded in steps that a team of workers runs index by index (run(n, fn): fn(i)
// for i < n; run2(outer, log2_inner, fn): fn(o, i) for a 2-D range) with a barrier after each: sign
// flips, the Walsh-Hadamard butterflies (one step per stride), the two sums of each quantization
// group as fixed halving trees (the codec's tree_sum), the codes, the scales, the packed bytes.
// Within a step no index reads what another writes, so any split of the indices over workers (a
// CUDA warp's 32 lanes, one host loop) yields the same bits. The CPU op runs the same operations
// on kLanes slots at once (cpu/octave_slot_lanes.h).
#pragma once

#include <cstdint>

#include "dispatch_utils.h"
#include "kv_quant_math.h"
#include "packed_slot.h"

namespace vllm_kv {

constexpr int kOctaveBlock = 64;             // dims per K Hadamard block (octave.HADAMARD_BLOCK)
constexpr int kOctaveRopeBits = 4;           // K codes of the RoPE dims of block K
constexpr int kOctaveNopeBits = 3;           // the other K codes, all of compact K
constexpr float kOctaveScaleOne = 64.0f;     // fixed point of the fp16 scales (LUT_ONE)
constexpr int kOctaveCodebookSize = 8 + 16;  // the 3-bit codebook, then the 4-bit one
constexpr int kOctaveCompactFlag = 16;       // added to the V bits in the format id
constexpr int kOctaveMaxHeadDim = 512;       // the compiled writer's scratch
constexpr float kOctaveRmsFloor = 1e-12f;
constexpr float kOctaveDotFloor = 1e-30f;

// Byte offsets within a slot of K's 3-bit codes, V's codes and the fp16 scales.
struct OctaveOffsets {
  int k_nope;
  int v;
  int scales;
};

KV_HOST_DEVICE OctaveOffsets octave_offsets(int head_dim, int rope_dim, int value_bits,
                                            bool compact) {
  const int wide = compact ? 0 : rope_dim;
  OctaveOffsets o{};
  o.k_nope = wide * kOctaveRopeBits / 8;
  o.v = o.k_nope + (head_dim - wide) * kOctaveNopeBits / 8;
  o.scales = o.v + head_dim * value_bits / 8;
  return o;
}

KV_HOST_DEVICE int octave_num_k_scales(int head_dim, bool compact) {
  return compact ? 1 : head_dim / kOctaveBlock;
}

// Bytes of one slot: codes, K's scales and V's, padded to 8 (4 for compact K).
KV_HOST_DEVICE int octave_slot_bytes(int head_dim, int rope_dim, int value_bits, bool compact) {
  const int end = octave_offsets(head_dim, rope_dim, value_bits, compact).scales +
                  2 * (octave_num_k_scales(head_dim, compact) + 1);
  const int align = compact ? 4 : 8;
  return (end + align - 1) / align * align;
}

// One Octave store (the shared geometry in PackedStoreArgs; the key in the value's type).
struct OctaveWriteArgs : PackedStoreArgs {
  const void* key;             // [N, H, D]
  const int32_t* key_signs;    // [D / 32]: bit i of word w set where dim 32 w + i is negated
  const int32_t* value_signs;  // [D / 32]
  int rope_dim;                // block K's 4-bit dims (a multiple of 64; 0 for compact K)
  int value_bits;              // 3 or 4
  bool compact;                // K rotated and coded over all dims
};

// log2 of the run of values whose short butterflies and last sum levels one index does.
constexpr int kOctaveRun = 3;

// Units of work of a slot: its K side, then its V side.
constexpr int kOctaveSides = 2;

// One worker's share of a side: the rotated values, the sum trees' lanes, the codes, and per
// quantization group the sum of squares, rms and scale.
struct OctaveScratch {
  float x[kOctaveMaxHeadDim];
  float lanes[kOctaveMaxHeadDim];
  uint8_t code[kOctaveMaxHeadDim];
  float group_ss[kOctaveMaxHeadDim / kOctaveBlock];
  float group_rms[kOctaveMaxHeadDim / kOctaveBlock];
};

// How a side is rotated and grouped.
struct OctaveSide {
  int rotation_block;  // Walsh-Hadamard block (a power of two)
  int group;           // values per scale
  int wide_groups;     // leading groups with 4-bit codes (block K's RoPE dims)
  int narrow_bits;     // code bits of the other groups
};

KV_HOST_DEVICE int octave_pow2_ceil(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

KV_HOST_DEVICE int octave_log2(int power_of_two) {
  int log2 = 0;
  while ((1 << log2) < power_of_two) ++log2;
  return log2;
}

// 1 / sqrt(block) for a power-of-two block as fp32: the codec's constant (a double rounded to
// fp32), built exactly from 2^-k and fp32 1/sqrt(2) so that no double arithmetic runs.
KV_HOST_DEVICE float octave_rotation_norm(int block) {
  const int log2 = octave_log2(block);
  float v = (log2 & 1) ? 0.70710677f : 1.0f;
  for (int k = 0; k < log2 / 2; ++k) v = kv_fmul(v, 0.5f);
  return v;
}

// Level `code` of the Lloyd-Max codebook of `bits` bits (octave_codec.LUT, int8 units). The levels
// are bytes of 64-bit words, not an array a thread would index in local memory.
KV_HOST_DEVICE constexpr int octave_lut(int bits, int code) {
  // 3 bits: -127, -79, -45, -14, 14, 45, 79, 127.
  constexpr uint64_t kLut3 = 0x7F4F2D0EF2D3B181ull;
  // 4 bits: -126, -95, -74, -58, -43, -30, -18, -6, then 6 .. 126 as their negatives.
  constexpr uint64_t kLut4Low = 0xFAEEE2D5C6B6A182ull;
  constexpr uint64_t kLut4High = 0x7E5F4A3A2B1E1206ull;
  const uint64_t word = bits == 3 ? kLut3 : (code < 8 ? kLut4Low : kLut4High);
  return int(int8_t(uint8_t(word >> (8 * (code % 8)))));
}

// Midpoint c of the codebook of `bits` bits: between levels c and c + 1 (exact in fp32).
KV_HOST_DEVICE constexpr float octave_midpoint(int bits, int c) {
  return float(octave_lut(bits, c) + octave_lut(bits, c + 1)) * 0.5f;
}

// The Lloyd-Max bucket of t: how many midpoints of adjacent levels are below it (a tie takes the
// lower code; NaN, below none, the top code, as torch.bucketize). Branch-free compares with
// constant midpoints (the loop unrolled), so the loop over values vectorizes.
template <int kBits>
KV_HOST_DEVICE uint8_t octave_bucket(float t) {
  int code = 0;
  KV_UNROLL
  for (int c = 0; c + 1 < (1 << kBits); ++c) code += !(t <= octave_midpoint(kBits, c));
  return uint8_t(code);
}

// lanes[g * width + i] becomes the sum of lanes[g * width .. + width) at i = 0, halving as the
// codec's tree_sum (width a power of two).
template <typename Team>
KV_HOST_DEVICE void octave_tree_sums(const Team& team, float* lanes, int groups, int width) {
  const int log2_width = octave_log2(width);
  for (int level = log2_width - 1; level >= kOctaveRun; --level) {
    const int w = 1 << level;
    team.run2(groups, level, [&](int g, int i) {
      float* row = lanes + (g << log2_width) + i;
      row[0] = kv_fadd(row[0], row[w]);
    });
  }
  // The last levels (8 values to 1) in one step, one index per group: short levels as steps of
  // their own would run a few adds per barrier (and would not vectorize on the CPU).
  team.run(groups, [&](int g) {
    float* row = lanes + (g << log2_width);
    KV_UNROLL
    for (int w = (1 << kOctaveRun) / 2; w >= 1; w /= 2) {
      KV_UNROLL
      for (int i = 0; i < w; ++i) row[i] = kv_fadd(row[i], row[i + w]);
    }
  });
}

// Four code bytes as one little-endian word (byte b: code b), and a word stored as four bytes.
KV_HOST_DEVICE uint32_t octave_code_word(const uint8_t* c) {
  return uint32_t(c[0]) | uint32_t(c[1]) << 8 | uint32_t(c[2]) << 16 | uint32_t(c[3]) << 24;
}

KV_HOST_DEVICE void octave_put_word(uint8_t* out, uint32_t word) {
  KV_UNROLL
  for (int b = 0; b < 4; ++b) out[b] = uint8_t(word >> (8 * b));
}

// n codes (a multiple of 32) from `code` packed at `out` (octave_codec._pack), one 4-byte word
// per index: 4-bit words of 8 dims (byte q: dim q low, dim q + 4 high), or a 2-bit plane (words
// of 16 dims, byte b: dims 4q + b at bits 2q) then a 1-bit plane (words of 32 dims, byte b: bit 2
// of dims 4q + b at bit q). Codes are bytes, so each word is a few whole-word operations.
template <typename Team>
KV_HOST_DEVICE void octave_pack(const Team& team, const uint8_t* code, int n, int bits,
                                uint8_t* out) {
  if (bits == 4) {
    team.run(n / 8, [&](int w) {
      const uint8_t* c = code + 8 * w;
      octave_put_word(out + 4 * w, octave_code_word(c) | octave_code_word(c + 4) << 4);
    });
    return;
  }
  team.run(n / 16, [&](int w) {
    uint32_t word = 0;
    KV_UNROLL
    for (int q = 0; q < 4; ++q) {
      word |= (octave_code_word(code + 16 * w + 4 * q) & 0x03030303u) << (2 * q);
    }
    octave_put_word(out + 4 * w, word);
  });
  team.run(n / 32, [&](int w) {
    uint32_t word = 0;
    KV_UNROLL
    for (int q = 0; q < 8; ++q) {
      word |= (octave_code_word(code + 32 * w + 4 * q) >> 2 & 0x01010101u) << q;
    }
    octave_put_word(out + n / 4 + 4 * w, word);
  });
}

// Rotates and codes one side of d values (load(i): element i as fp32): codes in s.code, and per
// group g the fp16 bits of its scale passed to put_scale(g, bits).
template <typename Team, typename Load, typename PutScale>
KV_HOST_DEVICE void octave_code_side(const Team& team, OctaveScratch& s, int d,
                                     const OctaveSide& side, const int32_t* signs, const Load& load,
                                     const PutScale& put_scale) {
  team.run(d, [&](int i) {
    const bool negate = (uint32_t(signs[i / 32]) >> (i % 32)) & 1u;
    s.x[i] = kv_fmul(load(i), negate ? -1.0f : 1.0f);
  });
  // Butterflies of stride 2^level: each run of 2 * stride values (the blocks are made of whole
  // runs) pairs value i with value i + stride. Strides 1, 2, 4 in one step, one index per run of
  // 8 values (the same adds in the same order per value).
  team.run(d >> kOctaveRun, [&](int run) {
    float* a = s.x + (run << kOctaveRun);
    KV_UNROLL
    for (int stride = 1; stride < (1 << kOctaveRun); stride *= 2) {
      KV_UNROLL
      for (int i = 0; i < (1 << kOctaveRun); ++i) {
        if (i & stride) continue;
        const float lo = a[i], hi = a[i + stride];
        a[i] = kv_fadd(lo, hi);
        a[i + stride] = kv_fsub(lo, hi);
      }
    }
  });
  for (int level = kOctaveRun; (2 << level) <= side.rotation_block; ++level) {
    const int stride = 1 << level;
    team.run2(d >> (level + 1), level, [&](int run, int i) {
      float* a = s.x + (run << (level + 1)) + i;
      const float lo = a[0], hi = a[stride];
      a[0] = kv_fadd(lo, hi);
      a[stride] = kv_fsub(lo, hi);
    });
  }
  const float norm = octave_rotation_norm(side.rotation_block);
  team.run(d, [&](int i) { s.x[i] = kv_fmul(s.x[i], norm); });

  const int groups = d / side.group;
  const int width = octave_pow2_ceil(side.group);
  const int log2_width = octave_log2(width);
  // A side of several groups has groups of kOctaveBlock; one group may be any size.
  const int log2_group = groups == 1 ? 30 : octave_log2(side.group);
  const auto bits_of = [&](int g) {
    return g < side.wide_groups ? kOctaveRopeBits : side.narrow_bits;
  };
  team.run2(groups, log2_width, [&](int g, int i) {
    const float x = i < side.group ? s.x[g * side.group + i] : 0.0f;
    s.lanes[(g << log2_width) + i] = kv_fmul(x, x);
  });
  octave_tree_sums(team, s.lanes, groups, width);
  team.run(groups, [&](int g) {
    const float ss = s.lanes[g * width];
#if defined(__CUDA_ARCH__)
    const float rms = __fsqrt_rn(kv_fdiv(ss, float(side.group)));
#else
    const float rms = sqrtf(kv_fdiv(ss, float(side.group)));
#endif
    s.group_ss[g] = ss;
    s.group_rms[g] = rms < kOctaveRmsFloor ? kOctaveRmsFloor : rms;  // NaN stays NaN
  });
  team.run(d, [&](int i) {
    const int g = i >> log2_group;
    const bool four = bits_of(g) == 4;
    const float t = kv_fmul(kv_fdiv(s.x[i], s.group_rms[g]), four ? 46.0f : 59.0f);  // LUT_MULT
    s.code[i] = four ? octave_bucket<4>(t) : octave_bucket<3>(t);
  });
  team.run2(groups, log2_width, [&](int g, int i) {
    const int k = g * side.group + i;
    const float term =
        i < side.group ? kv_fmul(s.x[k], float(octave_lut(bits_of(g), s.code[k]))) : 0.0f;
    s.lanes[(g << log2_width) + i] = term;
  });
  octave_tree_sums(team, s.lanes, groups, width);
  team.run(groups, [&](int g) {
    const float dot = s.lanes[g * width];
    const float floored = dot < kOctaveDotFloor ? kOctaveDotFloor : dot;
    const float scale =
        kv_fmul(dot > 0.0f ? kv_fdiv(s.group_ss[g], floored) : 0.0f, kOctaveScaleOne);
    put_scale(g, float_to_fp16_bits(fabsf(scale)));  // a NaN scale: the positive quiet NaN
  });
}

// How each side of a slot of store `a` is rotated and grouped: K in 64-dim blocks with 4-bit codes
// on the RoPE dims (compact: one block and group over all dims, 3-bit), V over the whole head
// (blocks of 64 where the head size is no power of two: octave_codec.v_block) with one scale.
KV_HOST_DEVICE OctaveSide octave_key_side(const OctaveWriteArgs& a) {
  if (a.compact) return OctaveSide{a.head_dim, a.head_dim, 0, kOctaveNopeBits};
  return OctaveSide{kOctaveBlock, kOctaveBlock, a.rope_dim / kOctaveBlock, kOctaveNopeBits};
}

KV_HOST_DEVICE OctaveSide octave_value_side(const OctaveWriteArgs& a) {
  const int d = a.head_dim;
  const int block = (d & (d - 1)) == 0 ? d : kOctaveBlock;
  return OctaveSide{block, d, 0, a.value_bits};
}

// Writes side `side` (0: K, 1: V) of (token, head)'s slot with `team` (all its workers call it
// with the same arguments): the CUDA kernel's writer (the CPU op codes kLanes slots at once with
// the same operations, cpu/octave_slot_lanes.h). VS: the key's and value's element type.
template <SourceType VS, typename Team>
KV_HOST_DEVICE void write_octave_side(const Team& team, OctaveScratch& s, const OctaveWriteArgs& a,
                                      int64_t token, int head, int side) {
  using T = typename SourceTraits<VS>::Storage;
  uint8_t* dst = packed_slot(a, token, head);
  if (dst == nullptr) return;
  const int d = a.head_dim;
  const OctaveOffsets o = octave_offsets(d, a.rope_dim, a.value_bits, a.compact);
  uint8_t* scales = dst + o.scales;
  const auto put = [&](uint8_t* p, uint16_t bits) {
    p[0] = uint8_t(bits);
    p[1] = uint8_t(bits >> 8);
  };
  if (side == 0) {
    const T* row =
        static_cast<const T*>(a.key) + token * a.key_token_stride + head * a.key_head_stride;
    octave_code_side(
        team, s, d, octave_key_side(a), a.key_signs,
        [&](int i) { return SourceTraits<VS>::to_float(row[i]); },
        [&](int g, uint16_t bits) { put(scales + 2 * g, bits); });
    const int wide = a.compact ? 0 : a.rope_dim;
    octave_pack(team, s.code, wide, kOctaveRopeBits, dst);
    octave_pack(team, s.code + wide, d - wide, kOctaveNopeBits, dst + o.k_nope);
    return;
  }
  const T* row =
      static_cast<const T*>(a.value) + token * a.value_token_stride + head * a.value_head_stride;
  const int k_scales = octave_num_k_scales(d, a.compact);
  octave_code_side(
      team, s, d, octave_value_side(a), a.value_signs,
      [&](int i) { return SourceTraits<VS>::to_float(row[i]); },
      [&](int, uint16_t bits) { put(scales + 2 * k_scales, bits); });
  octave_pack(team, s.code, d, a.value_bits, dst + o.v);
  const int used = o.scales + 2 * (k_scales + 1);
  const int end = octave_slot_bytes(d, a.rope_dim, a.value_bits, a.compact);
  team.run(end - used, [&](int i) { dst[used + i] = 0; });  // the codec's zero padding
}

// A team of one, host only: every step is a plain loop, its body inlined (the host checks'
// reference writer).
struct SerialTeam {
  template <typename Fn>
  KV_FLATTEN void run(int n, const Fn& fn) const {
    KV_INDEPENDENT_ITERATIONS
    for (int i = 0; i < n; ++i) fn(i);
  }
  // fn(o, i) for o < outer, i < 2^log2_inner.
  template <typename Fn>
  KV_FLATTEN void run2(int outer, int log2_inner, const Fn& fn) const {
    for (int o = 0; o < outer; ++o) {
      KV_INDEPENDENT_ITERATIONS
      for (int i = 0; i < (1 << log2_inner); ++i) fn(o, i);
    }
  }
};

}  // namespace vllm_kv
