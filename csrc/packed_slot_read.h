// Readers of the packed K+V slots (TurboQuant, ultraquant_4bit, Octave; docs/formats.md §6): one
// slot's key and value decoded to fp32 in the frame the attention kernels work in, operation for
// operation the reference codecs' decode (vllm/kv_quant/turboquant/codec.py, ultraquant_codec.py,
// octave_codec.py; TurboQuant's Lloyd-Max keys up to one rounding), except that no rotation is
// undone: a rotated key is read in its rotated frame (the caller rotates the query the same way),
// an Octave value in its frame (the caller rotates the output back). Framework-free; host and
// device.
#pragma once

#include <cmath>
#include <cstdint>

#include "cache_kernels.h"
#include "kv_quant_math.h"
#include "octave_slot.h"
#include "turboquant_slot.h"
#include "ultraquant_slot.h"

namespace vllm_kv {

enum class PackedFamily { kTurboQuant = 0, kUltraQuant = 1, kOctave = 2 };

// One packed format at one head size, as a reader needs it.
struct PackedSlotFormat {
  PackedFamily family;
  int head_dim;
  // TurboQuant: key bits 3 / 4 (Lloyd-Max codes of the rotated unit key, then its fp16 norm) or
  // kTurboQuantFp8KeyBits (e4m3 keys), value bits 3 / 4, norm_correction. Octave: value bits 3 / 4,
  // rope_dim (K dims with 4-bit codes; 0 for compact K), compact (one K rotation over all dims).
  int key_bits;
  int value_bits;
  bool norm_correction;
  int rope_dim;
  bool compact;
  // TurboQuant with Lloyd-Max keys: the 2^key_bits centroids. Octave: the 3-bit then the 4-bit
  // codebook (kOctaveCodebookSize values). ultraquant_4bit: none (E2M1 levels).
  const float* codebook;
};

// Bytes of one packed-slot side within a slot, and the slot's size.
struct PackedSlotGeometry {
  int value_offset;  // first byte of the value's data
  int slot_bytes;
};

KV_HOST_DEVICE OctaveOffsets octave_offsets(const PackedSlotFormat& f) {
  return octave_offsets(f.head_dim, f.rope_dim, f.value_bits, f.compact);
}

KV_HOST_DEVICE PackedSlotGeometry packed_slot_geometry(const PackedSlotFormat& f) {
  const int d = f.head_dim;
  switch (f.family) {
    case PackedFamily::kTurboQuant: {
      const int key = turboquant_key_bytes(d, f.key_bits);
      const int bytes = key + d * f.value_bits / 8 + 4;  // codes, fp16 scale, fp16 minimum
      return {key, bytes + bytes % 2};
    }
    case PackedFamily::kUltraQuant: {
      const int side = d / 2 + d / kUltraQuantGroup;
      return {side, 2 * side};
    }
    case PackedFamily::kOctave:
      return {octave_offsets(f).v, octave_slot_bytes(d, f.rope_dim, f.value_bits, f.compact)};
  }
  return {0, 0};
}

KV_HOST_DEVICE float packed_fp16_at(const uint8_t* p) {
  return fp16_bits_to_float(uint16_t(p[0] | (p[1] << 8)));
}

// fn(i, code) for the d codes of a little-endian bit stream of `bits`-bit codes (code i in bits
// [bits * i, bits * i + bits)): a group of 8 codes is `bits` whole bytes, read as one word.
template <typename Fn>
KV_HOST_DEVICE void turboquant_codes(const uint8_t* codes, int d, int bits, const Fn& fn) {
  const uint32_t mask = (1u << bits) - 1u;
  for (int g = 0; g < d / kTurboQuantCodeGroup; ++g) {
    uint32_t word = 0;
    for (int b = 0; b < bits; ++b) word |= uint32_t(codes[g * bits + b]) << (8 * b);
    for (int j = 0; j < kTurboQuantCodeGroup; ++j) {
      fn(g * kTurboQuantCodeGroup + j, (word >> (bits * j)) & mask);
    }
  }
}

// fn(i, code) for n Octave codes packed from p: 4-bit codes as words of 8 dims (byte j: dim j
// low, j + 4 high); 3-bit codes as a 2-bit plane (a word per 16 dims: dims 4k..4k+3 in bits 2k of
// bytes 0..3) of n / 4 bytes, then a 1-bit plane (a word per 32 dims: dims 4k..4k+3 in bit k).
template <typename Fn>
KV_HOST_DEVICE void octave_codes(const uint8_t* p, int n, int bits, const Fn& fn) {
  if (bits == 4) {
    for (int i = 0; i < n; i += 8) {
      for (int j = 0; j < 4; ++j) {
        const uint8_t byte = p[i / 2 + j];
        fn(i + j, byte & 15);
        fn(i + j + 4, byte >> 4);
      }
    }
    return;
  }
  const uint8_t* high = p + n / 4;
  for (int i = 0; i < n; ++i) {
    const int low2 = (p[i / 16 * 4 + i % 4] >> (2 * ((i % 16) / 4))) & 3;
    const int high1 = (high[i / 32 * 4 + i % 4] >> ((i % 32) / 4)) & 1;
    fn(i, low2 + 4 * high1);
  }
}

KV_HOST_DEVICE const float* octave_codebook(const PackedSlotFormat& f, int bits) {
  return bits == 3 ? f.codebook : f.codebook + 8;
}

// An Octave scale: the fp16 at p over the fixed point, as the codec reads it.
KV_HOST_DEVICE float octave_scale_at(const uint8_t* p) {
  return kv_fdiv(packed_fp16_at(p), kOctaveScaleOne);
}

// One ultraquant_4bit side (codes, then the UE8M0 scale bytes): E2M1 level * 2^(byte - 127), 0
// for byte 0 (the float whose exponent field is the byte: exact, and +0 for byte 0).
KV_HOST_DEVICE void read_ultraquant_side(const uint8_t* side, int d, float* out) {
  constexpr float kLevels[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int g = 0; g < d / kUltraQuantGroup; ++g) {
    const float scale = bits_as_float(uint32_t(side[d / 2 + g]) << 23);
    for (int i = g * kUltraQuantGroup; i < (g + 1) * kUltraQuantGroup; i += 2) {
      const uint8_t byte = side[i / 2];
      out[i] = kv_fmul(kLevels[byte & 15], scale);
      out[i + 1] = kv_fmul(kLevels[byte >> 4], scale);
    }
  }
}

// The key of `slot` (head_dim fp32 at out): TurboQuant in the rotated frame (e4m3 keys as
// stored), ultraquant_4bit rotated, Octave rotated.
KV_HOST_DEVICE void read_packed_key(const PackedSlotFormat& f, const uint8_t* slot, float* out) {
  const int d = f.head_dim;
  switch (f.family) {
    case PackedFamily::kTurboQuant: {
      if (f.key_bits == kTurboQuantFp8KeyBits) {
        for (int i = 0; i < d; ++i) out[i] = e4m3_to_float(slot[i]);
        return;
      }
      const float* centroids = f.codebook;
      turboquant_codes(slot, d, f.key_bits,
                       [&](int i, uint32_t code) { out[i] = centroids[code]; });
      // norm * c (over c's length under norm correction) as one factor per key: the codec
      // rounds c / length, then norm times it; one rounding fewer here, which attention's fp32
      // sums cannot tell from theirs, and one division per key instead of one per element.
      float factor = packed_fp16_at(slot + d * f.key_bits / 8);
      if (f.norm_correction) {
        float ss = 0.0f;
        for (int i = 0; i < d; ++i) ss = kv_fadd(ss, kv_fmul(out[i], out[i]));
        factor = kv_fdiv(factor, sqrtf(kv_fadd(ss, 1e-16f)));
      }
      for (int i = 0; i < d; ++i) out[i] = kv_fmul(factor, out[i]);
      return;
    }
    case PackedFamily::kUltraQuant:
      read_ultraquant_side(slot, d, out);
      return;
    case PackedFamily::kOctave: {
      const OctaveOffsets o = octave_offsets(f);
      const uint8_t* scales = slot + o.scales;
      if (f.compact) {
        const float scale = octave_scale_at(scales);
        const float* lut = octave_codebook(f, kOctaveNopeBits);
        octave_codes(slot, d, kOctaveNopeBits,
                     [&](int i, int code) { out[i] = kv_fmul(lut[code], scale); });
        return;
      }
      const float* rope_lut = octave_codebook(f, kOctaveRopeBits);
      const float* nope_lut = octave_codebook(f, kOctaveNopeBits);
      octave_codes(slot, f.rope_dim, kOctaveRopeBits,
                   [&](int i, int code) { out[i] = rope_lut[code]; });
      octave_codes(slot + o.k_nope, d - f.rope_dim, kOctaveNopeBits,
                   [&](int i, int code) { out[f.rope_dim + i] = nope_lut[code]; });
      for (int b = 0; b < d / kOctaveBlock; ++b) {
        const float scale = octave_scale_at(scales + 2 * b);
        for (int i = b * kOctaveBlock; i < (b + 1) * kOctaveBlock; ++i)
          out[i] = kv_fmul(out[i], scale);
      }
      return;
    }
  }
}

// The value of `slot` (head_dim fp32 at out): TurboQuant and ultraquant_4bit as written, Octave
// in its rotated frame.
KV_HOST_DEVICE void read_packed_value(const PackedSlotFormat& f, const uint8_t* slot, float* out) {
  const int d = f.head_dim;
  const uint8_t* side = slot + packed_slot_geometry(f).value_offset;
  switch (f.family) {
    case PackedFamily::kTurboQuant: {
      const float scale = packed_fp16_at(side + d * f.value_bits / 8);
      const float lo = packed_fp16_at(side + d * f.value_bits / 8 + 2);
      turboquant_codes(side, d, f.value_bits, [&](int i, uint32_t code) {
        out[i] = kv_fadd(kv_fmul(float(code), scale), lo);
      });
      return;
    }
    case PackedFamily::kUltraQuant:
      read_ultraquant_side(side, d, out);
      return;
    case PackedFamily::kOctave: {
      const int k_scales = octave_num_k_scales(d, f.compact);
      const float scale = octave_scale_at(slot + octave_offsets(f).scales + 2 * k_scales);
      const float* lut = octave_codebook(f, f.value_bits);
      octave_codes(side, d, f.value_bits,
                   [&](int i, int code) { out[i] = kv_fmul(lut[code], scale); });
      return;
    }
  }
}

}  // namespace vllm_kv
