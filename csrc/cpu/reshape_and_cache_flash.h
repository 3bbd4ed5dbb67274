// CPU reshape_and_cache_flash (docs/design.md §6). Framework-free: the torch glue validates the
// arguments, fills a ReshapeAndCacheParams and passes in the parallel-for (at::parallel_for) that
// splits the tokens among threads. FP8 bytes come from the scalar code of kv_quant_math.h (in
// loops the compiler vectorises); NVFP4 from lane-parallel forms of its encoders (equal on all
// 2^32 fp32 inputs, checked by csrc/cpu/tests/check_reshape_and_cache_flash_cpu.cpp), in GCC/Clang
// vector extensions at the build target's width (AVX-512, AVX2, SSE2 or NEON), plus AVX-512
// intrinsics where those lower badly (packing, bf16 data, whose E2M1 codes come from a table,
// also checked on all 2^32 products); the instruction set is the build's (-march), chosen at
// compile time. Global scales below 2^-128 (whose inverse is Inf) take the scalar
// nvfp4_quantize_group. Every address comes from cache_layout.h, through a per-call plan of
// per-group offsets (Nvfp4SidePlan).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cache_kernels.h"
#include "cache_layout.h"
#include "dispatch_utils.h"
#include "kv_quant_math.h"
#include "per_token_head.h"

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

// Page and row of a slot (slot >= 0).
struct SlotPosition {
  int64_t block;
  int64_t token;
};

inline SlotPosition slot_position(int64_t slot, int block_size) {
  const int64_t block = slot / block_size;
  return {block, slot - block * block_size};
}

template <CacheKind K>
inline uint8_t fp8_encode(float x) {
  if constexpr (K == CacheKind::kFp8E4M3) {
    return float_to_e4m3_satfinite(x);
  } else {
    return float_to_e5m2_satfinite(x);
  }
}

inline float head_scale(const CacheSide& side, int head) {
  return side.scale[side.scale_per_head ? head : 0];
}

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

// What the quantizers of one NVFP4 side need besides the data, computed once per call before the
// tokens are split among threads. Group q = head * num_groups + group of a token has its scale byte
// at layout.scale_offset(block, token, 0, 0, scale_layout) + scale_offsets[q] and its data at
// layout.data_offset(block, token, 0) + data_offsets[q]: both addresses are a per-token base plus
// a per-group offset (cache_layout.h), so the slot loop needs no per-group address arithmetic.
struct Nvfp4SidePlan {
  CacheSide side;
  Nvfp4SideLayout layout;
  int num_heads;
  // kv_fdiv(1, global scale) per group, padded with 1 to whole chunks, and whether one is
  // infinite (a scale below 2^-128).
  std::vector<float> inv_scales;
  bool any_infinite = false;
  std::vector<int64_t> scale_offsets;
  std::vector<int64_t> data_offsets;
  bool scales_contiguous = true;  // scale_offsets[q] == q (linear scales, NHD)
  bool data_contiguous = true;    // data_offsets[q] == 8q (NHD)
#if defined(__AVX512VBMI__)
  // Scattered (interleave4 or HND) scale bytes go out as masked 64-byte stores: window w covers
  // bytes [offset, offset + 64) from the token's scale base, byte i (if mask bit i) taken from
  // entry index[i] of its chunk's scale bytes. Chunk c's windows: [chunk_windows[c],
  // chunk_windows[c + 1]).
  struct ScaleWindow {
    int64_t offset;
    uint64_t mask;
    uint8_t index[64];
  };
  std::vector<ScaleWindow> windows;
  std::vector<int> chunk_windows;
#endif

  Nvfp4SidePlan(const CacheSide& cache_side, int block_size, int heads)
      : side(cache_side), layout(cache_side, block_size, heads), num_heads(heads) {
    const int num_groups = layout.num_groups;
    const int total = num_heads * num_groups;
    inv_scales.assign(round_up(total, kNvfp4Chunk), 1.0f);
    scale_offsets.resize(total);
    data_offsets.resize(total);
    const int64_t scale_base = layout.scale_offset(0, 0, 0, 0, side.scale_layout);
    for (int h = 0; h < num_heads; ++h) {
      const float inv = kv_fdiv(1.0f, head_scale(side, h));
      any_infinite |= std::isinf(inv);
      for (int g = 0; g < num_groups; ++g) {
        const int q = h * num_groups + g;
        inv_scales[q] = inv;
        scale_offsets[q] = layout.scale_offset(0, 0, h, g, side.scale_layout) - scale_base;
        data_offsets[q] = layout.data_offset(0, 0, h) + g * (kNvfp4GroupSize / 2);
        scales_contiguous &= scale_offsets[q] == q;
        data_contiguous &= data_offsets[q] == q * (kNvfp4GroupSize / 2);
      }
    }
#if defined(__AVX512VBMI__)
    for (int first = 0; first < total; first += kNvfp4Chunk) {
      chunk_windows.push_back(int(windows.size()));
      std::vector<std::pair<int64_t, int>> entries;  // (offset, index in the chunk), by offset
      for (int k = 0; k < std::min(kNvfp4Chunk, total - first); ++k) {
        entries.emplace_back(scale_offsets[first + k], k);
      }
      std::sort(entries.begin(), entries.end());
      for (const auto& [offset, k] : entries) {
        const bool first_of_chunk = windows.size() == size_t(chunk_windows.back());
        if (first_of_chunk || offset >= windows.back().offset + 64) {
          windows.push_back({offset, 0, {}});
        }
        ScaleWindow& w = windows.back();
        w.mask |= uint64_t{1} << (offset - w.offset);
        w.index[offset - w.offset] = uint8_t(k);
      }
    }
    chunk_windows.push_back(int(windows.size()));
#endif
  }
};

// Stores the scale bytes and packed data of the chunk of groups [first, first + n) of a token
// (first a multiple of kNvfp4Chunk, n the chunk's size, scale_bytes kNvfp4Chunk long).
inline void store_nvfp4_chunk(const Nvfp4SidePlan& plan, int64_t block, int token, int first, int n,
                              const uint8_t* scale_bytes, const uint8_t* packed) {
  constexpr int kPacked = kNvfp4GroupSize / 2;
  uint8_t* cache = static_cast<uint8_t*>(plan.side.data);
  uint8_t* scales = cache + plan.layout.scale_offset(block, token, 0, 0, plan.side.scale_layout);
  uint8_t* data = cache + plan.layout.data_offset(block, token, 0);
  if (plan.scales_contiguous) {
    std::memcpy(scales + first, scale_bytes, n);
  } else {
#if defined(__AVX512VBMI__)
    const __m512i bytes = _mm512_loadu_si512(scale_bytes);
    const int chunk = first / kNvfp4Chunk;
    for (int w = plan.chunk_windows[chunk]; w < plan.chunk_windows[chunk + 1]; ++w) {
      const Nvfp4SidePlan::ScaleWindow& window = plan.windows[w];
      // (maskz with all lanes: the same vpermb; GCC 12 warns about the unmasked form's
      // undefined pass-through.)
      _mm512_mask_storeu_epi8(
          scales + window.offset, window.mask,
          _mm512_maskz_permutexvar_epi8(~__mmask64(0), _mm512_loadu_si512(window.index), bytes));
    }
#else
    const int64_t* offsets = plan.scale_offsets.data() + first;
    for (int k = 0; k < n; ++k) scales[offsets[k]] = scale_bytes[k];
#endif
  }
  if (plan.data_contiguous) {
    std::memcpy(data + first * kPacked, packed, n * kPacked);
  } else {
    const int64_t* offsets = plan.data_offsets.data() + first;
    for (int k = 0; k < n; ++k) std::memcpy(data + offsets[k], packed + k * kPacked, kPacked);
  }
}

// Quantizes the chunk of groups [first, first + n) of one token (docs/design.md §5, the steps of
// nvfp4_quantize_group) into a packed NVFP4 side, with the vector encoders (finite inverse global
// scales only). One pass per step: the vector max of each group, then the scale arithmetic of the
// whole chunk, then the E2M1 encoding. kFullChunk: n == kNvfp4Chunk, loops of constant length.
template <SourceType S, bool kFullChunk>
inline void quantize_nvfp4_chunk(const typename SourceTraits<S>::Storage* row,
                                 const Nvfp4SidePlan& plan, int64_t block, int token, int first,
                                 int chunk_groups) {
  constexpr int kChunk = kNvfp4Chunk;
  constexpr int kPacked = kNvfp4GroupSize / 2;
  const int n = kFullChunk ? kChunk : chunk_groups;
  const float* inv_scales = plan.inv_scales.data();
  const auto* x = row + int64_t(first) * kNvfp4GroupSize;  // a token's [H, D] is contiguous
  alignas(64) uint8_t scale_bytes[kChunk];
  alignas(64) uint8_t packed[kChunk * kPacked];
#if defined(__AVX512BW__)
  if constexpr (S == SourceType::kBFloat16) {
    // Zeroed only for GCC 12's flow analysis: every lane read below is written first.
    alignas(64) uint32_t max_bits[kChunk] = {};
    alignas(64) float multipliers[kChunk];
    for (int q = 0; q < n; q += kBf16Groups) {
      if (kFullChunk || n - q >= kBf16Groups) {
        bf16_group_maxima<true>(x + q * kNvfp4GroupSize, n - q, max_bits + q);
      } else {
        bf16_group_maxima<false>(x + q * kNvfp4GroupSize, n - q, max_bits + q);
      }
    }
    static_assert(kBf16Groups % kLanes == 0);
    nvfp4_chunk_scales(max_bits, inv_scales + first, round_up(n, kBf16Groups), scale_bytes,
                       multipliers);
    for (int q = 0; q < n; q += kBf16Groups) {
      if (kFullChunk || n - q >= kBf16Groups) {
        bf16_encode_groups<true>(x + q * kNvfp4GroupSize, n - q, multipliers + q,
                                 packed + q * kPacked);
      } else {
        bf16_encode_groups<false>(x + q * kNvfp4GroupSize, n - q, multipliers + q,
                                  packed + q * kPacked);
      }
    }
    zero_nan_groups(scale_bytes, n, packed);
  } else
#endif
  {
    Group groups[kChunk];
    uint32_t max_bits[kChunk];
    for (int q0 = 0; q0 < n; q0 += kLanes) {
      U32v partial[kLanes];
      for (int q = q0; q < q0 + kLanes; ++q) {
        if (q < n) {
          groups[q] = widen_group<S>(x + q * kNvfp4GroupSize);
          partial[q - q0] = partial_max_abs_bits(groups[q]);
        } else {
          partial[q - q0] = U32v{};
        }
      }
      reduce_max<kLanes>(partial);
      std::memcpy(max_bits + q0, &partial[0], sizeof(U32v));
    }
    float multipliers[kChunk];
    nvfp4_chunk_scales(max_bits, inv_scales + first, round_up(n, kLanes), scale_bytes, multipliers);
    encode_chunk(groups, multipliers, scale_bytes, n, packed);
  }
  store_nvfp4_chunk(plan, block, token, first, n, scale_bytes, packed);
}

// Quantizes the num_heads * num_groups groups of one token with quantize_nvfp4_chunk.
template <SourceType S>
inline void quantize_nvfp4_token(const typename SourceTraits<S>::Storage* row,
                                 const Nvfp4SidePlan& plan, int64_t block, int token) {
  const int total = plan.num_heads * plan.layout.num_groups;
  for (int first = 0; first < total; first += kNvfp4Chunk) {
    if (total - first >= kNvfp4Chunk) {
      quantize_nvfp4_chunk<S, true>(row, plan, block, token, first, kNvfp4Chunk);
    } else {
      quantize_nvfp4_chunk<S, false>(row, plan, block, token, first, total - first);
    }
  }
}

// quantize_nvfp4_token with the scalar nvfp4_quantize_group, for any global scales (kSearch: with
// nvfp4_mse_quantize_group, the block-scale search of kv_cache_dtype nvfp4_mse).
template <SourceType S, bool kSearch = false>
inline void quantize_nvfp4_token_scalar(const typename SourceTraits<S>::Storage* row,
                                        const Nvfp4SidePlan& plan, int64_t block, int token) {
  constexpr int kPacked = kNvfp4GroupSize / 2;
  const int total = plan.num_heads * plan.layout.num_groups;
  for (int first = 0; first < total; first += kNvfp4Chunk) {
    const int n = std::min(kNvfp4Chunk, total - first);
    alignas(64) uint8_t scale_bytes[kNvfp4Chunk] = {};
    uint8_t packed[kNvfp4Chunk][kPacked];
    for (int k = 0; k < n; ++k) {
      const int q = first + k;
      float x[kNvfp4GroupSize];
      for (int i = 0; i < kNvfp4GroupSize; ++i) {
        x[i] = SourceTraits<S>::to_float(row[q * kNvfp4GroupSize + i]);
      }
      scale_bytes[k] = kSearch ? nvfp4_mse_quantize_group(x, plan.inv_scales[q], packed[k])
                               : nvfp4_quantize_group(x, plan.inv_scales[q], packed[k]);
    }
    store_nvfp4_chunk(plan, block, token, first, n, scale_bytes, packed[0]);
  }
}

// Asks for a coming token's source row ahead of time: the quantizing loops consume a row faster
// than the hardware prefetcher, which sees only one short run per token, brings it in.
template <typename T>
inline void prefetch_row(const T* row, int64_t elements) {
  constexpr int64_t kLineBytes = 64;
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < elements * int64_t(sizeof(T)); offset += kLineBytes) {
    __builtin_prefetch(bytes + offset, /*rw=*/0, /*locality=*/3);
  }
}

// The per-call state of a side of kind K: an Nvfp4SidePlan for NVFP4, nothing otherwise (head_size
// need not be a multiple of 16 there).
template <CacheKind K>
auto side_plan(const CacheSide& side, const ReshapeAndCacheParams& p) {
  if constexpr (K == CacheKind::kNvfp4) {
    return Nvfp4SidePlan(side, p.block_size, p.num_heads);
  } else {
    return nullptr;
  }
}

// n elements of float type S as float type C (cast_element: the exact widening, one rounding to
// nearest even), in a loop the compiler vectorises.
template <SourceType S, SourceType C>
inline void cast_run(const typename SourceTraits<S>::Storage* x,
                     typename SourceTraits<C>::Storage* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = cast_element<S, C>(x[j]);
}

// Writes tokens [begin, end) of one side (K or V). `src` points at token 0 of the source, rows
// `src_token_stride` elements apart, each row one token's [num_heads, head_size] values. C is the
// element type of an unquantized cache (S for the other kinds): C == S copies the bytes, any
// other C casts each element on the way (cast_run).
template <SourceType S, CacheKind K, SourceType C, typename Plan>
void write_side(const typename SourceTraits<S>::Storage* src, int64_t src_token_stride,
                const CacheSide& side, const Plan& plan, const ReshapeAndCacheParams& p,
                int64_t begin, int64_t end) {
  using Storage = typename SourceTraits<S>::Storage;
  const int head_size = side.head_size;
  const int num_heads = p.num_heads;
  constexpr int64_t kAhead = 2;  // rows prefetched this many tokens ahead (best of 1-4, cold)
  // FP8's per-element division leaves the hardware prefetcher enough time on long rows, where
  // software prefetches measured slower (H=32, D=128: 10%).
  const bool prefetch = K == CacheKind::kNvfp4 || num_heads * head_size * sizeof(Storage) <= 4096;
  for (int64_t i = begin; i < end; ++i) {
    if constexpr (K != CacheKind::kUnquantized) {
      // Past `end` too: the next task (this thread's or another's, through the shared cache)
      // starts with those rows; a task is a few tokens only.
      if (prefetch && i + kAhead < p.num_tokens) {
        prefetch_row(src + (i + kAhead) * src_token_stride, num_heads * head_size);
      }
    }
    const int64_t slot = p.slot_mapping[i];
    if (slot < 0) continue;
    const SlotPosition pos = slot_position(slot, p.block_size);
    const Storage* row = src + i * src_token_stride;

    if constexpr (K == CacheKind::kUnquantized) {
      using CacheStorage = typename SourceTraits<C>::Storage;
      static_assert(sizeof(Storage) == 2 || sizeof(Storage) == 4);
      CacheStorage* dst =
          static_cast<CacheStorage*>(side.data) + entry_offset(side, pos.block, pos.token, 0);
      if constexpr (C == S) {                 // the same dtype: a byte copy
        if (side.head_stride == head_size) {  // NHD: the token's heads are one run
          std::memcpy(dst, row, sizeof(Storage) * head_size * num_heads);
        } else {
          for (int h = 0; h < num_heads; ++h) {
            std::memcpy(dst + h * side.head_stride, row + h * head_size,
                        sizeof(Storage) * head_size);
          }
        }
      } else if (side.head_stride == head_size) {
        cast_run<S, C>(row, dst, int64_t(head_size) * num_heads);
      } else {
        for (int h = 0; h < num_heads; ++h) {
          cast_run<S, C>(row + h * head_size, dst + h * side.head_stride, head_size);
        }
      }
    } else if constexpr (K == CacheKind::kNvfp4) {
      if (p.nvfp4_scale_search) {
        quantize_nvfp4_token_scalar<S, true>(row, plan, pos.block, int(pos.token));
      } else if (plan.any_infinite) {
        quantize_nvfp4_token_scalar<S>(row, plan, pos.block, int(pos.token));
      } else {
        quantize_nvfp4_token<S>(row, plan, pos.block, int(pos.token));
      }
    } else if constexpr (is_per_token_head(K)) {  // each row computes and stores its own scale
      uint8_t* cache = static_cast<uint8_t*>(side.data);
      for (int h = 0; h < num_heads; ++h) {
        const Storage* x = row + h * head_size;
        quantize_per_token_head_row<K>([x](int j) { return SourceTraits<S>::to_float(x[j]); },
                                       head_size,
                                       cache + entry_offset(side, pos.block, pos.token, h));
      }
    } else {  // FP8: q = fp8(clamp(x / scale)), one IEEE division per element
      uint8_t* cache = static_cast<uint8_t*>(side.data);
      for (int h = 0; h < num_heads; ++h) {
        const float scale = head_scale(side, h);
        const Storage* x = row + h * head_size;
        uint8_t* dst = cache + entry_offset(side, pos.block, pos.token, h);
        for (int j = 0; j < head_size; ++j) {
          dst[j] = fp8_encode<K>(kv_fdiv(SourceTraits<S>::to_float(x[j]), scale));
        }
      }
    }
  }
}

// Tokens per parallel task, sized so that a task's work outweighs waking a thread.
inline int64_t grain_size(const ReshapeAndCacheParams& p) {
  const int64_t elements_per_token =
      int64_t(p.num_heads) * (p.key_cache.head_size + p.value_cache.head_size);
  const int64_t elements_per_task = p.cache_kind == CacheKind::kUnquantized ? 1 << 16 : 1 << 13;
  return std::max<int64_t>(1, elements_per_task / std::max<int64_t>(1, elements_per_token));
}

// Writes all p.num_tokens tokens. parallel_for(begin, end, grain, fn) must call fn(b, e) on
// disjoint sub-ranges covering [begin, end), e.g. at::parallel_for.
template <typename ParallelFor>
void reshape_and_cache_flash(const ReshapeAndCacheParams& p, ParallelFor&& parallel_for) {
  dispatch_source_and_kind(p.source_type, p.cache_kind, [&](auto source_tag, auto kind_tag) {
    constexpr SourceType S = decltype(source_tag)::value;
    constexpr CacheKind K = decltype(kind_tag)::value;
    using Storage = typename SourceTraits<S>::Storage;
    const auto* key = static_cast<const Storage*>(p.key);
    const auto* value = static_cast<const Storage*>(p.value);
    const auto key_plan = side_plan<K>(p.key_cache, p);
    const auto value_plan = side_plan<K>(p.value_cache, p);
    const auto write = [&](auto cache_tag) {
      constexpr SourceType C = decltype(cache_tag)::value;
      parallel_for(int64_t{0}, p.num_tokens, grain_size(p), [&](int64_t begin, int64_t end) {
        write_side<S, K, C>(key, p.key_token_stride, p.key_cache, key_plan, p, begin, end);
        write_side<S, K, C>(value, p.value_token_stride, p.value_cache, value_plan, p, begin, end);
      });
    };
    if constexpr (K == CacheKind::kUnquantized) {
      dispatch_source_type(p.cache_type, write);  // any float cache: copy or cast
    } else {
      write(SourceTag<S>{});
    }
  });
}

}  // namespace vllm_kv::cpu
