// Lane-parallel NVFP4 encoders of the CPU reshape_and_cache_flash (reshape_and_cache_flash.h):
// the encoders of kv_quant_math.h (equal on all 2^32 fp32 inputs, checked by
// csrc/cpu/tests/check_reshape_and_cache_flash_cpu.cpp) in GCC/Clang vector extensions at the
// build target's width (AVX-512, AVX2, SSE2 or NEON), plus AVX-512 intrinsics where those lower
// badly (packing, bf16 data, whose E2M1 codes come from a table, also checked on all 2^32
// products); the instruction set is the build's (-march), chosen at compile time. Framework-free.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cache_kernels.h"
#include "dispatch_utils.h"
#include "kv_quant_math.h"

#if defined(__AVX2__)
// GCC 12 reports the deliberately undefined pass-through operands inside its AVX-512 intrinsics
// as uninitialized (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace vllm_kv::cpu {

// Lane-parallel NVFP4 with GCC/Clang vector extensions at the native vector width (wider generic
// vectors lower badly).
#if defined(__AVX512F__)
inline constexpr int kVecBytes = 64;
#elif defined(__AVX__)
inline constexpr int kVecBytes = 32;
#else
inline constexpr int kVecBytes = 16;
#endif

template <typename T, int kBytes>
struct VecOf {
  typedef T type __attribute__((vector_size(kBytes)));
};
template <typename T, int kBytes = kVecBytes>
using Vec = typename VecOf<T, kBytes>::type;
using F32v = Vec<float>;
using U32v = Vec<uint32_t>;
using U64v = Vec<uint64_t>;
inline constexpr int kLanes = kVecBytes / 4;
inline constexpr int kVecsPerGroup = kNvfp4GroupSize / kLanes;

// Transposing max-reduction of kLanes vectors: v[g] holds partial maxima of group g, and after
// reduce_max<kLanes>(v) lane g of v[0] is the maximum of group g. Each level pairs vectors and
// keeps, per kSeg-lane segment (one group), the max of its two halves: a segment halves while
// the groups per vector double, two shuffles and one max per pair.
template <size_t kSeg>
constexpr int half_segment_lane(size_t i, bool high) {
  constexpr size_t kHalf = kLanes / 2;
  return int((i >= kHalf ? kLanes : 0) + (i % kHalf) / (kSeg / 2) * kSeg + i % (kSeg / 2) +
             (high ? kSeg / 2 : 0));
}

template <size_t kSeg, size_t... kI>
inline U32v max_of_half_segments(U32v a, U32v b, std::index_sequence<kI...>) {
  const U32v lo = __builtin_shufflevector(a, b, half_segment_lane<kSeg>(kI, false)...);
  const U32v hi = __builtin_shufflevector(a, b, half_segment_lane<kSeg>(kI, true)...);
  return lo > hi ? lo : hi;
}

template <size_t kSeg>
inline void reduce_max(U32v* v) {  // v[0 .. kSeg): segments of kSeg lanes
  if constexpr (kSeg > 1) {
    for (size_t j = 0; j < kSeg / 2; ++j) {
      v[j] = max_of_half_segments<kSeg>(v[2 * j], v[2 * j + 1], std::make_index_sequence<kLanes>{});
    }
    reduce_max<kSeg / 2>(v);
  }
}

// Lane-wise unsigned minimum in one instruction (GCC spells `a < b ? a : b` on vectors as a
// compare and a blend).
inline U32v umin(U32v a, U32v b) {
#if defined(__AVX512F__)
  return std::bit_cast<U32v>(
      _mm512_maskz_min_epu32(0xFFFF, std::bit_cast<__m512i>(a), std::bit_cast<__m512i>(b)));
#elif defined(__AVX2__)
  return std::bit_cast<U32v>(
      _mm256_min_epu32(std::bit_cast<__m256i>(a), std::bit_cast<__m256i>(b)));
#else
  return a < b ? a : b;
#endif
}

// float_to_e2m1 (kv_quant_math.h) lane by lane for lanes that are not NaN, as round-half-to-even
// to a float with one mantissa bit (which is what its thresholds spell out) in a few integer
// operations: |v| < 1 is a multiple of 0.5, code RNE(2|v|) in {0, 1, 2}, rounded by adding 2^22
// (whose ulp is 0.5); |v| >= 1 keeps one mantissa bit (ties to even; a carry bumps the exponent),
// code 2 * (exponent - 127) + mantissa + 2, saturated at 7 (6.0). A product x * multiplier is
// NaN only for a NaN x (the group is then written as zeros) or an infinite multiplier (a global
// scale below 2^-128, quantized by the scalar path instead): see quantize_nvfp4_token.
inline U32v float_to_e2m1_not_nan(F32v v) {
  const U32v bits = std::bit_cast<U32v>(v);
  const U32v abs_bits = bits & 0x7FFFFFFFu;
  const F32v a = std::bit_cast<F32v>(abs_bits);
  const U32v small = std::bit_cast<U32v>(a + 4194304.0f) - 0x4A800000u;
  const U32v large = (abs_bits + (0x1FFFFFu - (252u << 22)) + ((abs_bits >> 22) & 1u)) >> 22;
  const U32v magnitude = a < 1.0f ? small : umin(large, U32v{} + 7u);
  return ((bits >> 28) & 0x8u) | magnitude;
}

// float_to_e4m3_satfinite (kv_quant_math.h) lane by lane, the same operations.
inline U32v float_to_e4m3_satfinite(F32v x) {
  const U32v bits = std::bit_cast<U32v>(x);
  const U32v abs_bits = bits & 0x7FFFFFFFu;
  const F32v magnitude = std::bit_cast<F32v>(abs_bits);
  constexpr float kMinNormal = 0.015625f;  // 2^-6
  const F32v clamped = magnitude < kMinNormal ? magnitude : kMinNormal;
  // Multiples of the subnormal step 2^-9, rounded to an integer by adding 2^23.
  const U32v subnormal = std::bit_cast<U32v>(clamped * 512.0f + 8388608.0f) - 0x4B000000u;
  const U32v rounded = abs_bits + 0x7FFFFu + ((abs_bits >> 20) & 1u);
  const U32v normal = (((rounded >> 23) - 120u) << 3) | ((rounded >> 20) & 0x7u);
  U32v code = magnitude < kMinNormal ? subnormal : normal;
  code = magnitude >= kFp8E4M3Max ? 0x7Eu : code;
  return abs_bits > 0x7F800000u ? U32v{} + kFp8NanByte : (((bits >> 24) & 0x80u) | code);
}

// e4m3_to_float (kv_quant_math.h) lane by lane for bytes 0..255, the same operations.
inline F32v e4m3_to_float(U32v byte) {
  const U32v exponent = (byte >> 3) & 0xFu;
  const U32v mantissa = byte & 0x7u;
  const U32v subnormal =
      std::bit_cast<U32v>(__builtin_convertvector(mantissa, F32v) * 0.001953125f);
  const U32v normal = ((exponent + 120u) << 23) | (mantissa << 20);
  U32v magnitude = exponent == 0u ? subnormal : normal;
  magnitude = (byte & 0x7Fu) == 0x7Fu ? 0x7FC00000u : magnitude;
  return std::bit_cast<F32v>(((byte & 0x80u) << 24) | magnitude);
}

// One group of 16 values widened to fp32, kVecsPerGroup vectors.
struct Group {
  F32v v[kVecsPerGroup];
};

template <SourceType S>
inline Group widen_group(const typename SourceTraits<S>::Storage* x) {
  float widened[kNvfp4GroupSize];
  for (int i = 0; i < kNvfp4GroupSize; ++i) widened[i] = SourceTraits<S>::to_float(x[i]);
  Group group;
  std::memcpy(group.v, widened, sizeof(group.v));
  return group;
}

// Lane-wise max of |x_i| as bits over a group's vectors: |x| orders like its bits, and bits
// above +Inf's mean a NaN.
inline U32v partial_max_abs_bits(const Group& group) {
  U32v m = std::bit_cast<U32v>(group.v[0]) & 0x7FFFFFFFu;
  for (int k = 1; k < kVecsPerGroup; ++k) {
    const U32v b = std::bit_cast<U32v>(group.v[k]) & 0x7FFFFFFFu;
    m = m > b ? m : b;
  }
  return m;
}

// The 8 packed E2M1 bytes of x_i * multiplier (even element in the low nibble), for a group
// without NaN and a finite multiplier.
inline void pack_e2m1(const Group& group, float multiplier, uint8_t* data) {
  for (int k = 0; k < kVecsPerGroup; ++k) {
    // Element pairs (2j, 2j+1) share a 64-bit lane, odd element high: byte j is the low code
    // with the high one shifted from bit 32 to bit 4.
    const U64v pairs = std::bit_cast<U64v>(float_to_e2m1_not_nan(group.v[k] * multiplier));
    const auto packed = __builtin_convertvector(pairs | (pairs >> 28), Vec<uint8_t, kLanes / 2>);
    std::memcpy(data + k * (kLanes / 2), &packed, kLanes / 2);
  }
}

#if defined(__AVX512BW__)
// The 64 packed bytes of 8 groups from their E2M1 codes (16 lanes of 0..15 each): group g's
// 8 bytes at 8g, even element in the low nibble.
inline __m512i pack_e2m1_x8(const __m512i (&codes)[8]) {
  // Per 128-bit lane l, bytes: elements 4l..4l+3 of groups 0, 1, 2, 3 (and of 4, 5, 6, 7).
  const __m512i low = _mm512_packus_epi16(_mm512_packus_epi32(codes[0], codes[1]),
                                          _mm512_packus_epi32(codes[2], codes[3]));
  const __m512i high = _mm512_packus_epi16(_mm512_packus_epi32(codes[4], codes[5]),
                                           _mm512_packus_epi32(codes[6], codes[7]));
  // The low byte of each 16-bit word (an element pair): low code | high code << 4.
  const __m512i byte_mask = _mm512_set1_epi16(0xFF);
  constexpr int kOrAnd = 0xA8;  // (a | b) & c
  const __m512i low_pairs =
      _mm512_ternarylogic_epi32(_mm512_srli_epi16(low, 4), low, byte_mask, kOrAnd);
  const __m512i high_pairs =
      _mm512_ternarylogic_epi32(_mm512_srli_epi16(high, 4), high, byte_mask, kOrAnd);
  // Word g of lane l: bytes 2l, 2l+1 of group g. Gather each group's four words.
  const __m512i words = _mm512_packus_epi16(low_pairs, high_pairs);
  const __m512i order = _mm512_set_epi16(31, 23, 15, 7, 30, 22, 14, 6, 29, 21, 13, 5, 28, 20, 12, 4,
                                         27, 19, 11, 3, 26, 18, 10, 2, 25, 17, 9, 1, 24, 16, 8, 0);
  return _mm512_permutexvar_epi16(order, words);
}
#endif

// Groups per chunk of quantize_nvfp4_token.
inline constexpr int kNvfp4Chunk = 64;

inline constexpr int round_up(int n, int multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

// Zeroes the packed data of groups [0, n) whose scale byte is the NaN byte (groups holding a NaN).
inline void zero_nan_groups(const uint8_t* scale_bytes, int n, uint8_t* packed) {
  constexpr int kPacked = kNvfp4GroupSize / 2;
  if (std::memchr(scale_bytes, kFp8NanByte, n) != nullptr) {  // rare
    for (int q = 0; q < n; ++q) {
      if (scale_bytes[q] == kFp8NanByte) std::memset(packed + q * kPacked, 0, kPacked);
    }
  }
}

// The packed E2M1 bytes of groups [0, n) of a chunk (8 per group, even element in the low
// nibble) into packed[0, 8 * round_up(n, 8)); a group whose scale byte is the NaN byte is zeros.
inline void encode_chunk(const Group* groups, const float* multipliers, const uint8_t* scale_bytes,
                         int n, uint8_t* packed) {
  constexpr int kPacked = kNvfp4GroupSize / 2;
#if defined(__AVX512BW__)
  static_assert(kVecsPerGroup == 1);
  for (int q = 0; q < n; q += 8) {
    __m512i codes[8];
    for (int k = 0; k < 8; ++k) {
      codes[k] = q + k < n ? std::bit_cast<__m512i>(
                                 float_to_e2m1_not_nan(groups[q + k].v[0] * multipliers[q + k]))
                           : _mm512_setzero_si512();
    }
    _mm512_storeu_si512(packed + q * kPacked, pack_e2m1_x8(codes));
  }
#else
  for (int q = 0; q < n; ++q) pack_e2m1(groups[q], multipliers[q], packed + q * kPacked);
#endif
  zero_nan_groups(scale_bytes, n, packed);
}

// Block-scale bytes and multipliers of groups [0, count) (count a multiple of kLanes) from their
// max |x| bits and inverse global scales: nvfp4_scale_byte and nvfp4_multiplier (kv_quant_math.h)
// lane by lane.
inline void nvfp4_chunk_scales(const uint32_t* max_abs_bits, const float* inv_global_scale,
                               int count, uint8_t* scale_bytes, float* multipliers) {
  for (int q = 0; q < count; q += kLanes) {
    U32v amax_bits;
    F32v inv;
    std::memcpy(&amax_bits, max_abs_bits + q, sizeof(amax_bits));
    std::memcpy(&inv, inv_global_scale + q, sizeof(inv));
    const F32v nan = std::bit_cast<F32v>(U32v{} + 0x7FC00000u);
    const F32v block_scale =
        amax_bits > 0x7F800000u ? nan : std::bit_cast<F32v>(amax_bits) * inv / kE2M1Max;
    const U32v bytes = float_to_e4m3_satfinite(block_scale);
    const F32v scale_f = e4m3_to_float(bytes);
    const F32v multiplier = scale_f == 0.0f ? F32v{} : inv / scale_f;
    const auto narrow = __builtin_convertvector(bytes, Vec<uint8_t, kLanes>);
    std::memcpy(scale_bytes + q, &narrow, kLanes);
    std::memcpy(multipliers + q, &multiplier, sizeof(multiplier));
  }
}

#if defined(__AVX512BW__)
// Groups that bf16_group_maxima and bf16_encode_groups take at a time.
inline constexpr int kBf16Groups = 16;

// All-lane masks: GCC 12 warns that the unmasked forms of several intrinsics use an
// uninitialized pass-through operand (GCC bug 105593), the zero-masked forms compile the same.
inline constexpr __mmask16 kAll16 = 0xFFFF;
inline constexpr __mmask8 kAll8 = 0xFF;

// NVFP4 of bf16 groups with AVX-512, 16 consecutive groups of a token at a time, keeping the data
// in bf16 until it is multiplied: a 512-bit vector holds two groups.
//  - Max |x| on the bf16 bits (they order like |x|, NaN above +Inf), a transposing reduction of
//    16-bit lanes; the fp32 bits of the max are its bf16 bits << 16.
//  - E2M1 codes by table (bf16_pair_e2m1): dword i of a vector holds elements 2i and 2i + 1, so
//    dwords 0-7 are group 2j and 8-15 group 2j + 1, multiplied by [m_2j x 8, m_2j+1 x 8].
// Loads bf16 groups 2j and 2j + 1 of x, zeros past group n (kFull: n >= 16, no masking).
template <bool kFull>
inline __m512i load_bf16_pair(const uint16_t* x, int n, int j) {
  if constexpr (kFull) return _mm512_loadu_si512(x + j * 2 * kNvfp4GroupSize);
  const int words = std::clamp(n - 2 * j, 0, 2) * kNvfp4GroupSize;
  const __mmask32 valid = words == 32 ? ~__mmask32{0} : (__mmask32{1} << words) - 1;
  return _mm512_maskz_loadu_epi16(valid, x + j * 2 * kNvfp4GroupSize);
}

// The fp32 bits of max |x_i| of groups [0, 16) of x (0 past group n) into max_bits[0, 16).
template <bool kFull>
inline void bf16_group_maxima(const uint16_t* x, int n, uint32_t* max_bits) {
  // Halves of the same group meet, pair by pair of vectors.
  const __m512i abs_mask = _mm512_set1_epi16(0x7FFF);
  __m512i quarter[4];  // 128-bit lane k of quarter[i]: 8 partial maxima of group 4i + k
  for (int i = 0; i < 4; ++i) {
    const __m512i a = _mm512_and_si512(load_bf16_pair<kFull>(x, n, 2 * i), abs_mask);
    const __m512i b = _mm512_and_si512(load_bf16_pair<kFull>(x, n, 2 * i + 1), abs_mask);
    quarter[i] = _mm512_max_epu16(_mm512_maskz_shuffle_i32x4(kAll16, a, b, 0x88),
                                  _mm512_maskz_shuffle_i32x4(kAll16, a, b, 0xDD));
  }
  __m512i half[2];  // lane k of half[i]: 4 partial maxima of group 8i + k, then of 8i + 4 + k
  for (int i = 0; i < 2; ++i) {
    half[i] =
        _mm512_max_epu16(_mm512_maskz_unpacklo_epi64(kAll8, quarter[2 * i], quarter[2 * i + 1]),
                         _mm512_maskz_unpackhi_epi64(kAll8, quarter[2 * i], quarter[2 * i + 1]));
  }
  // Dword j of lane k: 2 partial maxima of group 4j + k.
  const __m512i even = _mm512_set_epi32(30, 28, 14, 12, 26, 24, 10, 8, 22, 20, 6, 4, 18, 16, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 15, 13, 27, 25, 11, 9, 23, 21, 7, 5, 19, 17, 3, 1);
  const __m512i pairs = _mm512_max_epu16(_mm512_permutex2var_epi32(half[0], even, half[1]),
                                         _mm512_permutex2var_epi32(half[0], odd, half[1]));
  const __m512i maxima =
      _mm512_max_epu16(pairs, std::bit_cast<__m512i>(std::bit_cast<U32v>(pairs) >> 16));
  const __m512i group_order =
      _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  // bf16 bits << 16: fp32 bits.
  const U32v ordered =
      std::bit_cast<U32v>(_mm512_maskz_permutexvar_epi32(kAll16, group_order, maxima)) << 16;
  std::memcpy(max_bits, &ordered, sizeof(ordered));
}

// float_to_e2m1 (kv_quant_math.h) counts the thresholds 0.25, 1.25, 2.5, 5 that |v| exceeds and
// 0.75, 1.75, 3.5 that it reaches. Each has at most 3 significant bits: its fp32 bits are a
// multiple of 2^21, and with b = bits(|v|) (bits order like magnitudes), f = floor(b / 2^21) and
// c = ceil(b / 2^21): |v| >= t iff f >= bits(t) / 2^21, |v| > t iff c > bits(t) / 2^21. The code
// of |v| is thus a function of f + c = 2f + (b % 2^21 != 0), kE2M1ByIndex[f + c - 1000] (1000:
// 0.25, code 0 and below; 1036: 6.0, code 7 and above).
inline constexpr int kE2M1IndexBase = 1000;
inline constexpr int kE2M1IndexMax = 36;
inline constexpr uint16_t kE2M1ByIndex[64] = {0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2,
                                              2, 2, 2, 2, 2, 2, 3, 3, 3, 4, 4, 4, 4,
                                              4, 5, 5, 5, 6, 6, 6, 6, 6, 7, 7};

// The E2M1 codes of x_i * m for the 32 bf16 values of raw (no NaN) as 16-bit words in element
// order, m[l] the multiplier of dword l's elements. The sign of x_i * m is that of x_i (m >= 0):
// the products are of |x_i|, their indices f + c side by side as 16-bit words.
inline __m512i bf16_pair_e2m1(__m512i raw, __m512 m, const __m512i (&table)[2]) {
  const U32v magnitude = std::bit_cast<U32v>(raw) & 0x7FFF7FFFu;
  const U32v even = std::bit_cast<U32v>(std::bit_cast<F32v>(magnitude << 16) * m);
  const U32v odd = std::bit_cast<U32v>(std::bit_cast<F32v>(magnitude & 0xFFFF0000u) * m);
  constexpr uint32_t kCeil = (1u << 21) - 1;
  const U32v even_index = ((even + kCeil) >> 21) + (even >> 21);
  const Vec<uint16_t> odd_index =  // in the high words
      std::bit_cast<Vec<uint16_t>>((odd + kCeil) >> 5) + std::bit_cast<Vec<uint16_t>>(odd >> 5);
  const U32v index = (std::bit_cast<U32v>(odd_index) & 0xFFFF0000u) | even_index;
  const __m512i clamped = _mm512_min_epu16(
      _mm512_subs_epu16(std::bit_cast<__m512i>(index), _mm512_set1_epi16(kE2M1IndexBase)),
      _mm512_set1_epi16(kE2M1IndexMax));
  const U32v magnitudes =
      std::bit_cast<U32v>(_mm512_permutex2var_epi16(table[0], clamped, table[1]));
  return std::bit_cast<__m512i>(magnitudes | ((std::bit_cast<U32v>(raw) >> 12) & 0x80008u));
}

// The packed data of groups [0, 16) of x (past group n: zero codes) into packed[0, 128).
template <bool kFull>
inline void bf16_encode_groups(const uint16_t* x, int n, const float* multipliers,
                               uint8_t* packed) {
  const __m512 multiplier = _mm512_loadu_ps(multipliers);
  const __m512i table[2] = {_mm512_loadu_si512(kE2M1ByIndex),
                            _mm512_loadu_si512(kE2M1ByIndex + 32)};
  const __m512i nibble_weights = _mm512_set1_epi16(0x1001);  // bytes 1, 16: even + 16 * odd
  // Dword 4l + d of the final packus: bytes 4l to 4l + 3 of pair d (groups 2d, 2d + 1).
  const __m512i dword_order =
      _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  // Fully unrolled, so that the lane indices below are constants.
  KV_UNROLL
  for (int j0 = 0; j0 < kBf16Groups / 2; j0 += 4) {  // 8 groups
    __m512i codes[4];                                // pair j's 32 codes as words
    KV_UNROLL
    for (int j = j0; j < j0 + 4; ++j) {
      const __m512i pair_index = _mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                                  2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j,
                                                  2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j);
      codes[j - j0] =
          bf16_pair_e2m1(load_bf16_pair<kFull>(x, n, j),
                         _mm512_maskz_permutexvar_ps(kAll16, pair_index, multiplier), table);
    }
    // Per 128-bit lane l: codes 8l to 8l + 7 of two pairs as bytes, then element pairs merged
    // into bytes 4l to 4l + 3 of each pair as words.
    const __m512i low =
        _mm512_maddubs_epi16(_mm512_packus_epi16(codes[0], codes[1]), nibble_weights);
    const __m512i high =
        _mm512_maddubs_epi16(_mm512_packus_epi16(codes[2], codes[3]), nibble_weights);
    const __m512i out =
        _mm512_maskz_permutexvar_epi32(kAll16, dword_order, _mm512_packus_epi16(low, high));
    _mm512_storeu_si512(packed + j0 * kNvfp4GroupSize, out);
  }
}
#endif

}  // namespace vllm_kv::cpu
