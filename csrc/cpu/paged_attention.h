// CPU paged attention over every cache format (decode, prefill, chunked prefill). Framework-free:
// the torch glue validates the arguments, fills a PagedAttentionParams and passes in a
// parallel-for.
//
// Work item = (sequence, KV head, block of query tokens, split of the key range). Its rows are the
// query tokens of the block times the query heads of the KV head's group (GQA), so that each
// decoded page of K / V serves all of them. Pages are decoded one at a time into an fp32 tile of
// page size (L1 / L2 resident; a sequence's K / V is never materialised) with SIMD format decoders,
// and attended with an online softmax in fp32 (on AVX-512 BF16 builds, decode rows of formats
// exact in bf16 go through vdpbf16ps, the softmax weights rounded to bf16 for the values' sums,
// as in flash attention). Per-tensor or per-head scales are constant within
// an item: the K scale is folded into the query, the V scale into the output. Per-token-head rows
// (int8 / e4m3 values + their own inline fp32 scale) are decoded times that scale into the tiles.
// Long key ranges of few items are split (split-K); the splits' (max, sum, accumulator) partials
// are merged after. Keys stored before RoPE (rope_cos_sin / key_offset / sink_keys given) are
// decoded into the tile and rebuilt there (transform_keys), never fused.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attention_kernels.h"
#include "cache_kernels.h"
#include "cache_layout.h"
#include "kv_quant_math.h"
#include "per_token_head.h"

namespace vllm_kv::cpu::attention {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VLLM_KV_HAVE_AVX512 1
#endif
// The bf16 dot path (VBMI spreads the NVFP4 codes).
#if defined(VLLM_KV_HAVE_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define VLLM_KV_HAVE_AVX512_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VLLM_KV_HAVE_AVX2 1
#endif

// Whether the build target has the instructions of `level` (kGeneric always).
constexpr bool simd_level_compiled(SimdLevel level) {
  switch (level) {
    case SimdLevel::kGeneric:
      return true;
    case SimdLevel::kAvx2:
#if defined(VLLM_KV_HAVE_AVX2)
      return true;
#else
      return false;
#endif
    case SimdLevel::kAvx512:
#if defined(VLLM_KV_HAVE_AVX512)
      return true;
#else
      return false;
#endif
    case SimdLevel::kAuto:
      return true;
  }
  return false;
}

constexpr SimdLevel widest_simd_level() {
  if (simd_level_compiled(SimdLevel::kAvx512)) return SimdLevel::kAvx512;
  if (simd_level_compiled(SimdLevel::kAvx2)) return SimdLevel::kAvx2;
  return SimdLevel::kGeneric;
}

// ------------------------------------------------------------------------------ vector math

template <int kBytes>
struct FloatVecOf {
  typedef float type __attribute__((vector_size(kBytes)));
};

template <SimdLevel L>
inline constexpr int kVecBytes = L == SimdLevel::kAvx512 ? 64
                                 : L == SimdLevel::kAvx2 ? 32
                                                         : 16;

template <SimdLevel L>
using VecF = typename FloatVecOf<kVecBytes<L>>::type;

template <SimdLevel L>
inline constexpr int kLanes = kVecBytes<L> / 4;

template <SimdLevel L>
inline VecF<L> load(const float* p) {
  VecF<L> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <SimdLevel L>
inline void store(float* p, VecF<L> v) {
  std::memcpy(p, &v, sizeof(v));
}

// x in every lane. (x - 0 is x for every x, -0 included, so this folds to a broadcast; 0 + x
// would not, as 0 + -0 is +0.)
template <SimdLevel L>
inline VecF<L> splat(float x) {
  return x - VecF<L>{};
}

// a * b + c, fused where the level has FMA (the file is built with -ffp-contract=off for the
// bit-exact quantizers, so fusion is spelled out).
template <SimdLevel L>
inline VecF<L> fmadd(VecF<L> a, VecF<L> b, VecF<L> c) {
#if defined(VLLM_KV_HAVE_AVX512)
  if constexpr (L == SimdLevel::kAvx512) return _mm512_fmadd_ps(a, b, c);
#endif
#if defined(VLLM_KV_HAVE_AVX2)
  if constexpr (L == SimdLevel::kAvx2) return _mm256_fmadd_ps(a, b, c);
#endif
  return a * b + c;
}

template <SimdLevel L>
inline VecF<L> vmax(VecF<L> a, VecF<L> b) {
  return a > b ? a : b;
}

// Sum of the lanes, by halving.
template <int kN, typename V, size_t... kI>
inline auto low_half(V v, std::index_sequence<kI...>) {
  return __builtin_shufflevector(v, v, kI...);
}
template <int kN, typename V, size_t... kI>
inline auto high_half(V v, std::index_sequence<kI...>) {
  return __builtin_shufflevector(v, v, (kI + kN / 2)...);
}

template <int kN, typename V>
inline float reduce_add(V v) {
  if constexpr (kN == 4) {
    return (v[0] + v[2]) + (v[1] + v[3]);
  } else {
    const auto lo = low_half<kN>(v, std::make_index_sequence<kN / 2>{});
    const auto hi = high_half<kN>(v, std::make_index_sequence<kN / 2>{});
    return reduce_add<kN / 2>(lo + hi);
  }
}

template <int kN, typename V>
inline float reduce_max(V v) {
  if constexpr (kN == 4) {
    return std::max(std::max(v[0], v[2]), std::max(v[1], v[3]));
  } else {
    const auto lo = low_half<kN>(v, std::make_index_sequence<kN / 2>{});
    const auto hi = high_half<kN>(v, std::make_index_sequence<kN / 2>{});
    return reduce_max<kN / 2>(lo > hi ? lo : hi);
  }
}

template <SimdLevel L>
using VecI = decltype(VecF<L>{} > VecF<L>{});

// Lane sums of kN vectors at once (a transposing tree): out[t] = sum of the lanes of v[t]. One
// level pairs neighbours a, b holding kN / kS tokens of kS partial sums each into one vector of
// twice the tokens with kS / 2 partials each (lane j: token j / (kS / 2), a's tokens first).
constexpr int fold_source(int lanes, int partials, int j, int second) {
  const int half = partials / 2;
  const int token = j / half;
  const int per_vector = lanes / partials;
  const int from_b = token < per_vector ? 0 : lanes;
  return from_b + (token % per_vector) * partials + j % half + second * half;
}

template <int kN, int kS, typename V, size_t... kI>
inline V fold_pair(V a, V b, std::index_sequence<kI...>) {
  return __builtin_shufflevector(a, b, fold_source(kN, kS, kI, 0)...) +
         __builtin_shufflevector(a, b, fold_source(kN, kS, kI, 1)...);
}

// v holds kS vectors of kN lanes (kS = kN at the top); overwritten.
template <int kN, int kS = kN, typename V>
inline V reduce_add_many(V* v) {
  if constexpr (kS == 1) {
    return v[0];
  } else {
    for (int k = 0; k < kS / 2; ++k) {
      v[k] = fold_pair<kN, kS>(v[2 * k], v[2 * k + 1], std::make_index_sequence<kN>{});
    }
    return reduce_add_many<kN, kS / 2>(v);
  }
}

// exp(x) for x <= 0 (x < -87, -inf included, gives 0): 2^k * p(r) with k = round(x / ln2),
// r = x - k ln2 in [-ln2/2, ln2/2] and p a degree-6 Taylor polynomial (relative error ~2e-7).
template <SimdLevel L>
inline VecF<L> vexp(VecF<L> x) {
  using V = VecF<L>;
  using I = VecI<L>;
  const V clamped = vmax<L>(x, splat<L>(-87.0f));
  const V t = fmadd<L>(clamped, splat<L>(1.44269504088896341f), splat<L>(0.5f));
  V k = __builtin_convertvector(__builtin_convertvector(t, I), V);  // toward zero
  k = k > t ? k - 1.0f : k;                                         // floor
  // r = x - k ln2 in two steps (ln2 = hi + lo, hi exact in 16 bits) to keep r accurate.
  const V r = fmadd<L>(k, splat<L>(-1.428606765330187e-06f),
                       fmadd<L>(k, splat<L>(-0.693145751953125f), clamped));
  V p = splat<L>(1.0f / 720.0f);
  p = fmadd<L>(p, r, splat<L>(1.0f / 120.0f));
  p = fmadd<L>(p, r, splat<L>(1.0f / 24.0f));
  p = fmadd<L>(p, r, splat<L>(1.0f / 6.0f));
  p = fmadd<L>(p, r, splat<L>(0.5f));
  p = fmadd<L>(p, r, splat<L>(1.0f));
  p = fmadd<L>(p, r, splat<L>(1.0f));
  const I bits = (__builtin_convertvector(k, I) + 127) << 23;
  V two_k;
  std::memcpy(&two_k, &bits, sizeof(two_k));
  return x < splat<L>(-87.0f) ? splat<L>(0.0f) : p * two_k;
}

// ---------------------------------------------------------------------------- format decode

// E2M1 code (bit 3 = sign) -> value.
alignas(64) inline constexpr float kE2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,
                                                      4.0f,  6.0f,  -0.0f, -0.5f, -1.0f, -1.5f,
                                                      -2.0f, -3.0f, -4.0f, -6.0f};

using vllm_kv::e5m2_to_float;  // kv_quant_math.h

// FP8 e4m3 byte -> fp32 at compile time (the value e4m3_to_float gives; exact).
constexpr float e4m3_value(int byte) {
  const int exponent = (byte >> 3) & 0xF;
  const int mantissa = byte & 0x7;
  if ((byte & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  float magnitude = exponent == 0 ? float(mantissa) / 8.0f : 1.0f + float(mantissa) / 8.0f;
  for (int e = exponent == 0 ? 1 : exponent; e < 7; ++e) magnitude /= 2.0f;  // 2^(e - 7)
  for (int e = 7; e < exponent; ++e) magnitude *= 2.0f;
  return (byte & 0x80) ? -magnitude : magnitude;
}

// NVFP4 block-scale byte -> fp32, by table (no initialisation guard in the decode loops).
struct E4m3Table {
  float values[256];
  constexpr E4m3Table() : values() {
    for (int b = 0; b < 256; ++b) values[b] = e4m3_value(b);
  }
};
alignas(64) inline constexpr E4m3Table kE4m3Table{};

// bf16 bits of every E2M1 value times every NVFP4 block scale, row = scale byte, 16 codes per row
// (exact: at most 6 significant bits, exponents within range): an NVFP4 group's values in bf16
// are one row looked up by code.
struct ScaledE2M1Table {
  alignas(32) uint8_t bits[256][32];
  constexpr ScaledE2M1Table() : bits() {
    for (int scale = 0; scale < 256; ++scale) {
      for (int code = 0; code < 16; ++code) {
        const float value = kE2M1Values[code] * e4m3_value(scale);
        const uint32_t word = std::bit_cast<uint32_t>(value) >> 16;
        bits[scale][2 * code] = uint8_t(word & 0xFF);
        bits[scale][2 * code + 1] = uint8_t(word >> 8);
      }
    }
  }
};
alignas(64) inline constexpr ScaledE2M1Table kScaledE2M1{};

#if defined(VLLM_KV_HAVE_AVX512_BF16)
// 32 FP8 bytes -> their values as bf16, exactly (FP8 values have at most 4 significant bits and
// exponents within bf16's range), by bit arithmetic: normal codes shift their exponent and
// mantissa into place and rebias; subnormal codes (exponent 0) come from a table; e4m3's NaN
// codes and e5m2's Inf / NaN codes are mapped explicitly.
template <CacheKind K>
inline __m512i fp8_to_bf16_x32(const uint8_t* src) {
  static_assert(K == CacheKind::kFp8E4M3 || K == CacheKind::kFp8E5M2);
  constexpr bool kE4m3 = K == CacheKind::kFp8E4M3;
  // bf16 bits of the subnormal magnitudes m * 2^-9 (e4m3, m < 8) / m * 2^-16 (e5m2, m < 4).
  alignas(64) static constexpr auto kSubnormal = [] {
    std::array<uint16_t, 32> bits{};
    for (int m = 1; m < (kE4m3 ? 8 : 4); ++m) {
      float value = float(m);
      for (int e = 0; e < (kE4m3 ? 9 : 16); ++e) value /= 2.0f;
      bits[m] = uint16_t(std::bit_cast<uint32_t>(value) >> 16);
    }
    return bits;
  }();
  const __m512i bytes =
      _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  const __m512i magnitude = _mm512_and_si512(bytes, _mm512_set1_epi16(0x7F));
  // e4m3 s.eeee.mmm: exponent + 120, mantissa << 4; e5m2 s.eeeee.mm: exponent + 112, mantissa << 5.
  __m512i bits =
      kE4m3 ? _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(120 << 7))
            : _mm512_add_epi16(_mm512_slli_epi16(magnitude, 5), _mm512_set1_epi16(112 << 7));
  const __mmask32 subnormal = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(kE4m3 ? 8 : 4));
  bits = _mm512_mask_permutexvar_epi16(bits, subnormal, magnitude,
                                       _mm512_load_si512(kSubnormal.data()));
  if constexpr (kE4m3) {
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7F));
    bits = _mm512_mask_mov_epi16(bits, nan, _mm512_set1_epi16(0x7FC0));
  } else {
    const __mmask32 inf = _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7C));
    const __mmask32 nan = _mm512_cmpgt_epu16_mask(magnitude, _mm512_set1_epi16(0x7C));
    bits = _mm512_mask_mov_epi16(bits, inf, _mm512_set1_epi16(0x7F80));
    bits = _mm512_mask_mov_epi16(bits, nan, _mm512_set1_epi16(0x7FC0));
  }
  // bits | (bytes << 8 & 0x8000): the sign.
  return _mm512_ternarylogic_epi32(bits, _mm512_slli_epi16(bytes, 8),
                                   _mm512_set1_epi16(int16_t(0x8000)), 0xF8);
}
#endif

// Decodes one cache entry (a token's head) of `dim` elements to fp32 at dst. The formats:
// unquantized fp32 / fp16 / bf16 (C), FP8 e4m3 / e5m2 (K), NVFP4 (data bytes + per-group scale
// bytes at scales + group_offsets[g]), per-token-head int8 / e4m3 rows (values times the row's
// inline scale, one fp32 multiply each, as the reference codec reads them). Per-tensor and
// per-head dequantization scales are applied by the caller.
template <CacheKind K, SourceType C, SimdLevel L>
struct EntryDecoder {
  static void decode(const uint8_t* src, const uint8_t* scales, const int64_t* group_offsets,
                     int dim, float* dst) {
    if constexpr (is_per_token_head(K)) {
      const float row_scale = per_token_head_row_scale(src, dim);
      for (int i = 0; i < dim; ++i) dst[i] = per_token_head_decode<K>(src[i]) * row_scale;
      return;
    }
    int i = 0;
#if defined(VLLM_KV_HAVE_AVX512)
    if constexpr (L == SimdLevel::kAvx512) i = decode_avx512(src, scales, group_offsets, dim, dst);
#endif
#if defined(VLLM_KV_HAVE_AVX2)
    if constexpr (L == SimdLevel::kAvx2) i = decode_avx2(src, scales, group_offsets, dim, dst);
#endif
    decode_scalar(src, scales, group_offsets, i, dim, dst);
  }

  // Elements [begin, dim), one at a time.
  static void decode_scalar(const uint8_t* src, const uint8_t* scales, const int64_t* group_offsets,
                            int begin, int dim, float* dst) {
    for (int i = begin; i < dim; ++i) {
      if constexpr (K == CacheKind::kNvfp4) {
        const uint8_t byte = src[i / 2];
        dst[i] = kE2M1Values[(i % 2 == 0) ? (byte & 0xF) : (byte >> 4)] *
                 block_scale(scales, group_offsets, i);
      } else if constexpr (K == CacheKind::kFp8E4M3) {
        dst[i] = e4m3_to_float(src[i]);
      } else if constexpr (K == CacheKind::kFp8E5M2) {
        dst[i] = e5m2_to_float(src[i]);
      } else if constexpr (C == SourceType::kFloat32) {
        std::memcpy(dst + i, src + 4 * int64_t(i), 4);
      } else {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * int64_t(i), 2);
        dst[i] = C == SourceType::kBFloat16 ? bf16_bits_to_float(bits) : fp16_bits_to_float(bits);
      }
    }
  }

  // Elements [i, i + kLanes<L>) as one vector (i a multiple of kLanes<L>, i + kLanes<L> <= dim);
  // only for the vector levels. The decode lives in registers: both the page-tile path and the
  // fused dot products (PagedAttention) use it.
  static VecF<L> vector(const uint8_t* src, const uint8_t* scales, const int64_t* group_offsets,
                        int i) {
#if defined(VLLM_KV_HAVE_AVX512)
    if constexpr (L == SimdLevel::kAvx512) return vector_avx512(src, scales, group_offsets, i);
#endif
#if defined(VLLM_KV_HAVE_AVX2)
    if constexpr (L == SimdLevel::kAvx2) return vector_avx2(src, scales, group_offsets, i);
#endif
    static_assert(L != SimdLevel::kGeneric, "the generic level decodes element by element");
  }

  static float block_scale(const uint8_t* scales, const int64_t* group_offsets, int i) {
    return kE4m3Table.values[scales[group_offsets[i / kNvfp4GroupSize]]];
  }

#if defined(VLLM_KV_HAVE_AVX512)
  static int decode_avx512(const uint8_t* src, const uint8_t* scales, const int64_t* group_offsets,
                           int dim, float* dst) {
    int i = 0;
    for (; i + 16 <= dim; i += 16) {
      _mm512_storeu_ps(dst + i, vector_avx512(src, scales, group_offsets, i));
    }
    return i;
  }

  static __m512 vector_avx512(const uint8_t* src, const uint8_t* scales,
                              const int64_t* group_offsets, int i) {
    if constexpr (K == CacheKind::kNvfp4) {
      const __m128i low_nibble = _mm_set1_epi8(0x0F);
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i / 2));
      const __m128i lo = _mm_and_si128(bytes, low_nibble);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble);
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
      const __m512 values = _mm512_permutexvar_ps(codes, _mm512_load_ps(kE2M1Values));
      return _mm512_mul_ps(values, _mm512_set1_ps(block_scale(scales, group_offsets, i)));
    } else if constexpr (K == CacheKind::kFp8E4M3 || K == CacheKind::kFp8E5M2) {
      const __m256i bytes =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      if constexpr (K == CacheKind::kFp8E5M2) {
        return _mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8));  // e5m2 is the high byte of fp16
      } else {
        return _mm512_mul_ps(_mm512_cvtph_ps(e4m3_as_fp16_bits(bytes)), _mm512_set1_ps(256.0f));
      }
    } else if constexpr (C == SourceType::kFloat32) {
      return _mm512_loadu_ps(reinterpret_cast<const float*>(src) + i);
    } else {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i));
      if constexpr (C == SourceType::kBFloat16) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
      } else {
        return _mm512_cvtph_ps(bits);
      }
    }
  }

  // e4m3 s.eeee.mmm (zero-extended to 16-bit lanes) -> fp16 s.0eeee.mmm0000000, the value / 256
  // (exact, subnormals included); the NaN bytes 0x7F / 0xFF -> an fp16 NaN.
  static __m256i e4m3_as_fp16_bits(__m256i bytes) {
    const __m256i magnitude = _mm256_and_si256(bytes, _mm256_set1_epi16(0x7F));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8);
    const __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7F)),
                                         _mm256_set1_epi16(0x7E00));
    return _mm256_or_si256(_mm256_or_si256(sign, _mm256_slli_epi16(magnitude, 7)), nan);
  }
#endif

#if defined(VLLM_KV_HAVE_AVX2)
  static int decode_avx2(const uint8_t* src, const uint8_t* scales, const int64_t* group_offsets,
                         int dim, float* dst) {
    int i = 0;
    for (; i + 8 <= dim; i += 8) {
      _mm256_storeu_ps(dst + i, vector_avx2(src, scales, group_offsets, i));
    }
    return i;
  }

  static __m256 vector_avx2(const uint8_t* src, const uint8_t* scales, const int64_t* group_offsets,
                            int i) {
    if constexpr (K == CacheKind::kNvfp4) {
      // 4 bytes = 8 codes (half a group); magnitudes by permute, the sign from bit 3.
      const __m128i low_nibble = _mm_set1_epi8(0x0F);
      int32_t word;
      std::memcpy(&word, src + i / 2, 4);
      const __m128i bytes = _mm_cvtsi32_si128(word);
      const __m128i lo = _mm_and_si128(bytes, low_nibble);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble);
      const __m256i code = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
      const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_load_ps(kE2M1Values), code);
      const __m256 sign = _mm256_castsi256_ps(
          _mm256_and_si256(_mm256_slli_epi32(code, 28), _mm256_set1_epi32(int32_t(0x80000000u))));
      return _mm256_mul_ps(_mm256_or_ps(magnitude, sign),
                           _mm256_set1_ps(block_scale(scales, group_offsets, i)));
    } else if constexpr (K == CacheKind::kFp8E4M3 || K == CacheKind::kFp8E5M2) {
      const __m128i bytes =
          _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
      if constexpr (K == CacheKind::kFp8E5M2) {
        return _mm256_cvtph_ps(_mm_slli_epi16(bytes, 8));
      } else {
        const __m128i magnitude = _mm_and_si128(bytes, _mm_set1_epi16(0x7F));
        const __m128i sign = _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8);
        const __m128i nan =
            _mm_and_si128(_mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7E00));
        const __m128i half_bits =
            _mm_or_si128(_mm_or_si128(sign, _mm_slli_epi16(magnitude, 7)), nan);
        return _mm256_mul_ps(_mm256_cvtph_ps(half_bits), _mm256_set1_ps(256.0f));
      }
    } else if constexpr (C == SourceType::kFloat32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(src) + i);
    } else {
      const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
      if constexpr (C == SourceType::kBFloat16) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
      } else {
        return _mm256_cvtph_ps(bits);
      }
    }
  }
#endif
};

// ------------------------------------------------------------------------------ work planning

// One unit of parallel work: query tokens [q_begin, q_end) of sequence `seq` (indices among its
// q_len query tokens) for the query heads of KV heads [kv_begin, kv_end), over key positions
// [key_begin, key_end). partial >= 0: write (max, sum, accumulator) partials at that float offset
// of the scratch buffer instead of the output. Rows are ordered (KV head, query token, query head
// of the group).
struct WorkItem {
  int seq;
  int kv_begin;
  int kv_end;
  int q_begin;
  int q_end;
  int key_begin;
  int key_end;
  int64_t partial;
};

// The splits of one (sequence, KV head, query block) whose partials are merged afterwards.
struct MergeItem {
  int seq;
  int kv_begin;
  int kv_end;
  int q_begin;
  int q_end;
  int num_splits;
  int64_t partial;
};

struct AttentionPlan {
  std::vector<WorkItem> items;
  std::vector<MergeItem> merges;
  int64_t scratch_floats = 0;
};

// Shape facts of one call, derived from the parameters.
struct AttentionGeometry {
  int group;        // query heads per KV head
  int query_block;  // query tokens per work item
  int head_size;
  int head_size_v;

  explicit AttentionGeometry(const PagedAttentionParams& p)
      : group(p.num_heads / p.num_kv_heads),
        query_block(std::max(1, 64 / (p.num_heads / p.num_kv_heads))),
        head_size(p.key_cache.head_size),
        head_size_v(p.value_cache.head_size) {}

  // Floats per row of a split's partial: max, sum, accumulator.
  int partial_row_floats() const { return head_size_v + 2; }
};

inline int query_len(const PagedAttentionParams& p, int seq) {
  return p.query_start_loc[seq + 1] - p.query_start_loc[seq];
}

// Key positions [begin, end) that query token j (of q_len) of a sequence of seq_len tokens sees.
inline std::pair<int, int> key_range(const PagedAttentionParams& p, int seq_len, int q_len, int j) {
  const int pos = seq_len - q_len + j;
  int begin = 0;
  int end = seq_len;
  if (p.sliding_window > 0) {
    begin = std::max(0, pos - p.sliding_window + 1);
    if (!p.causal) end = std::min(seq_len, pos + p.sliding_window);
  }
  if (p.causal) end = pos + 1;
  return {begin, end};
}

// Key positions per split at least; shorter ranges are not worth a merge.
inline constexpr int kMinSplitKeys = 512;

// Items with at most this many rows per KV head (decode) take all KV heads: a page is then read
// whole (NHD: one dense region), which the hardware prefetchers stream, instead of one head's
// scattered rows per item. Their parallelism comes from split-K.
inline constexpr int kMaxRowsForAllHeads = 16;

inline int kv_heads_per_item(const PagedAttentionParams& p, const AttentionGeometry& geo,
                             int q_tokens) {
  return q_tokens * geo.group <= kMaxRowsForAllHeads ? p.num_kv_heads : 1;
}

// Items for `num_threads` threads: (sequence x KV head x query block), each split into as many
// page-aligned key ranges as it takes to give every thread about four items.
inline AttentionPlan plan_attention(const PagedAttentionParams& p, int num_threads) {
  const AttentionGeometry geo(p);
  AttentionPlan plan;
  int64_t base_items = 0;
  for (int seq = 0; seq < p.num_seqs; ++seq) {
    const int q_len = query_len(p, seq);
    for (int q_begin = 0; q_begin < q_len; q_begin += geo.query_block) {
      const int q_tokens = std::min(q_len, q_begin + geo.query_block) - q_begin;
      base_items += p.num_kv_heads / kv_heads_per_item(p, geo, q_tokens);
    }
  }
  const int64_t wanted = 4 * int64_t(std::max(1, num_threads));
  const int64_t splits_wanted = base_items == 0 ? 1 : (wanted + base_items - 1) / base_items;
  for (int seq = 0; seq < p.num_seqs; ++seq) {
    const int seq_len = p.seq_lens[seq];
    const int q_len = query_len(p, seq);
    for (int q_begin = 0; q_begin < q_len; q_begin += geo.query_block) {
      const int q_end = std::min(q_len, q_begin + geo.query_block);
      const int key_begin = key_range(p, seq_len, q_len, q_begin).first;
      const int key_end = key_range(p, seq_len, q_len, q_end - 1).second;
      const int span = key_end - key_begin;
      const int splits = int(std::max<int64_t>(
          1, std::min<int64_t>(splits_wanted, span / std::max(kMinSplitKeys, p.block_size))));
      const int heads = kv_heads_per_item(p, geo, q_end - q_begin);
      for (int kv_begin = 0; kv_begin < p.num_kv_heads; kv_begin += heads) {
        const int kv_end = kv_begin + heads;
        if (splits == 1) {
          plan.items.push_back({seq, kv_begin, kv_end, q_begin, q_end, key_begin, key_end, -1});
          continue;
        }
        const int64_t rows = int64_t(heads) * (q_end - q_begin) * geo.group;
        const int64_t stride = rows * geo.partial_row_floats();
        plan.merges.push_back({seq, kv_begin, kv_end, q_begin, q_end, splits, plan.scratch_floats});
        // Page-aligned boundaries, as even as the pages allow.
        const int first_page = key_begin / p.block_size;
        const int pages = (key_end - 1) / p.block_size - first_page + 1;
        for (int s = 0; s < splits; ++s) {
          const int b =
              s == 0 ? key_begin : (first_page + int(int64_t(pages) * s / splits)) * p.block_size;
          const int e = s == splits - 1
                            ? key_end
                            : (first_page + int(int64_t(pages) * (s + 1) / splits)) * p.block_size;
          plan.items.push_back({seq, kv_begin, kv_end, q_begin, q_end, b, e, plan.scratch_floats});
          plan.scratch_floats += stride;
        }
      }
    }
  }
  return plan;
}

// -------------------------------------------------------------------------------- the kernel

// out[index + d] = src[d] * factor for d < n, in the output type (bf16: round to nearest even).
// One type switch per row, not per element.
inline void store_output_row(void* out, int64_t index, SourceType type, const float* src,
                             float factor, int n) {
  switch (type) {
    case SourceType::kFloat32:
      for (int d = 0; d < n; ++d) static_cast<float*>(out)[index + d] = src[d] * factor;
      return;
    case SourceType::kBFloat16:
      for (int d = 0; d < n; ++d) {
        static_cast<uint16_t*>(out)[index + d] = float_to_bf16_bits(src[d] * factor);
      }
      return;
    case SourceType::kFloat16:
      for (int d = 0; d < n; ++d) {
        const _Float16 h = static_cast<_Float16>(src[d] * factor);
        std::memcpy(static_cast<uint16_t*>(out) + index + d, &h, 2);
      }
      return;
  }
}

// dst[d] = query[index + d] * factor for d < n (one type switch per row).
inline void load_query_row(const void* query, int64_t index, SourceType type, float factor, int n,
                           float* dst) {
  switch (type) {
    case SourceType::kFloat32:
      for (int d = 0; d < n; ++d) dst[d] = static_cast<const float*>(query)[index + d] * factor;
      return;
    case SourceType::kBFloat16:
    case SourceType::kFloat16:
      for (int d = 0; d < n; ++d) {
        const uint16_t bits = static_cast<const uint16_t*>(query)[index + d];
        dst[d] =
            (type == SourceType::kBFloat16 ? bf16_bits_to_float(bits) : fp16_bits_to_float(bits)) *
            factor;
      }
      return;
  }
}

// The per-tensor / per-head scale of a side; 1 without one (unquantized caches, and per-token-head
// rows, whose scales the decoder applies).
inline float side_scale(const CacheSide& side, int head, CacheKind kind) {
  if (kind == CacheKind::kUnquantized || is_per_token_head(kind)) return 1.0f;
  return side.scale[side.scale_per_head ? head : 0];
}

// Writes the finished rows of one item: out = acc / l (softmax with the sink logit of each query
// head in the denominator) times the V scale.
inline void finish_rows(const PagedAttentionParams& p, const AttentionGeometry& geo, int seq,
                        int kv_begin, int kv_end, int q_begin, int q_end, const float* m,
                        const float* l, const float* acc, int64_t acc_stride) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int r = 0;
  for (int kv_head = kv_begin; kv_head < kv_end; ++kv_head) {
    const float v_scale = side_scale(p.value_cache, kv_head, p.cache_kind);
    for (int j = q_begin; j < q_end; ++j) {
      for (int g = 0; g < geo.group; ++g, ++r) {
        const int head = kv_head * geo.group + g;
        float sum = l[r];
        float factor = 1.0f;  // weight of the accumulator
        if (p.sinks != nullptr) {
          const float sink = p.sinks[head];
          const float top = std::max(m[r], sink);
          factor = m[r] == neg_inf ? 0.0f : std::exp(m[r] - top);
          sum = sum * factor + std::exp(sink - top);
        }
        const float weight = sum > 0.0f ? factor / sum * v_scale : 0.0f;
        const int64_t out_base = int64_t(p.query_start_loc[seq] + j) * p.out_token_stride +
                                 int64_t(head) * p.out_head_stride;
        const float* a = acc + r * acc_stride;
        store_output_row(p.out, out_base, p.io_type, a, weight, geo.head_size_v);
      }
    }
  }
}

// Merges the partials of split items (log-sum-exp weights) and writes the rows.
inline void merge_partials(const PagedAttentionParams& p, const MergeItem& item,
                           const float* scratch) {
  const AttentionGeometry geo(p);
  const int rows = (item.kv_end - item.kv_begin) * (item.q_end - item.q_begin) * geo.group;
  const int row_floats = geo.partial_row_floats();
  const int64_t split_stride = int64_t(rows) * row_floats;
  std::vector<float> m(rows), l(rows), acc(int64_t(rows) * geo.head_size_v);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < rows; ++r) {
    float top = neg_inf;
    for (int s = 0; s < item.num_splits; ++s) {
      top = std::max(top, scratch[item.partial + s * split_stride + r * row_floats]);
    }
    float sum = 0.0f;
    float* a = acc.data() + int64_t(r) * geo.head_size_v;
    std::fill(a, a + geo.head_size_v, 0.0f);
    for (int s = 0; s < item.num_splits; ++s) {
      const float* part = scratch + item.partial + s * split_stride + r * row_floats;
      if (part[0] == neg_inf) continue;
      const float w = std::exp(part[0] - top);
      sum += part[1] * w;
      for (int d = 0; d < geo.head_size_v; ++d) a[d] += part[2 + d] * w;
    }
    m[r] = top;
    l[r] = sum;
  }
  finish_rows(p, geo, item.seq, item.kv_begin, item.kv_end, item.q_begin, item.q_end, m.data(),
              l.data(), acc.data(), geo.head_size_v);
}

template <CacheKind K, SourceType C, SimdLevel L>
class PagedAttention {
 public:
  static constexpr int kLanes = attention::kLanes<L>;
  using V = VecF<L>;
  using Decoder = EntryDecoder<K, C, L>;

  explicit PagedAttention(const PagedAttentionParams& p)
      : p_(p),
        geo_(p),
        dim_k_(round_up(geo_.head_size)),
        dim_v_(round_up(geo_.head_size_v)),
        tokens_(round_up(p.block_size)),
        key_transform_(p.rope_cos_sin != nullptr || p.key_offset != nullptr ||
                       p.sink_keys != nullptr || p.key_hadamard),
        // Per-token-head rows are decoded (times their inline scales) into the tiles only, and
        // so are keys rebuilt from pre-RoPE ones (transform_keys).
        fused_(L != SimdLevel::kGeneric && !is_per_token_head(K) && !key_transform_ &&
               geo_.head_size % kLanes == 0 && geo_.head_size_v % kLanes == 0),
        bf16_dot_(kBf16Dot && fused_ && p.io_type == SourceType::kBFloat16 &&
                  geo_.head_size % 32 == 0),
        bf16_v_(kBf16Dot && fused_ && geo_.head_size_v % 32 == 0),
        nvfp4_chunks_(K == CacheKind::kNvfp4 && bf16_dot_ && bf16_v_ &&
                      geo_.head_size == kChunkHeadSize && geo_.head_size_v == kChunkHeadSize &&
                      p.block_size % kChunkKeys == 0),
        k_page_bytes_(page_bytes(geo_.head_size)),
        v_page_bytes_(page_bytes(geo_.head_size_v)) {
    if constexpr (K == CacheKind::kNvfp4) {
      k_layout_ = Nvfp4SideLayout(p.key_cache, p.block_size, p.num_kv_heads);
      v_layout_ = Nvfp4SideLayout(p.value_cache, p.block_size, p.num_kv_heads);
      for (int g = 0; g < k_layout_.num_groups; ++g) {
        k_groups_.push_back(k_layout_.scale_group_offset(g, p.key_cache.scale_layout));
      }
      for (int g = 0; g < v_layout_.num_groups; ++g) {
        v_groups_.push_back(v_layout_.scale_group_offset(g, p.value_cache.scale_layout));
      }
      if (nvfp4_chunks_) {
        k_scale_select_ = chunk_scale_select(p.key_cache.scale_layout);
        v_scale_select_ = chunk_scale_select(p.value_cache.scale_layout);
        k_scale_rows_ = chunk_scale_rows(k_layout_);
        v_scale_rows_ = chunk_scale_rows(v_layout_);
      }
    }
  }

  void run(const WorkItem& item, float* scratch) const {
    const int q_len = query_len(p_, item.seq);
    const int seq_len = p_.seq_lens[item.seq];
    const int tokens = item.q_end - item.q_begin;
    const int heads = item.kv_end - item.kv_begin;
    const int head_rows = tokens * geo_.group;  // rows per KV head
    const int rows = heads * head_rows;
    // Decode in registers when each K / V vector serves one pass over few rows (decode); with
    // many query rows (prefill) a page decoded once into the tiles serves them all.
    const bool fused = fused_ && head_rows <= kMaxFusedRows;
    const bool bf16_dot = fused && bf16_dot_;
    const bool bf16_v = fused && bf16_v_;
    // Per-thread buffers, reused across items.
    thread_local std::vector<float> buffer;
    // (The bf16 query rows of the bf16 dot path take rows * dim_k_ / 2 floats; counted whole.)
    const int64_t need = int64_t(rows) * (2 * dim_k_ + dim_v_ + tokens_ + 2) +
                         int64_t(p_.block_size) * (dim_k_ + dim_v_);
    if (int64_t(buffer.size()) < need) buffer.assign(need, 0.0f);
    float* q = buffer.data();
    float* acc = q + int64_t(rows) * dim_k_;
    float* scores = acc + int64_t(rows) * dim_v_;
    float* m = scores + int64_t(rows) * tokens_;
    float* l = m + rows;
    float* k_tile = l + rows;
    float* v_tile = k_tile + int64_t(p_.block_size) * dim_k_;
    auto* q_bf16 = reinterpret_cast<uint16_t*>(v_tile + int64_t(p_.block_size) * dim_v_);
    const float neg_inf = -std::numeric_limits<float>::infinity();

    // Key range of each query token, within the item's.
    std::vector<std::pair<int, int>> ranges(tokens);
    for (int jt = 0; jt < tokens; ++jt) {
      const auto [begin, end] = key_range(p_, seq_len, q_len, item.q_begin + jt);
      ranges[jt] = {std::max(begin, item.key_begin), std::min(end, item.key_end)};
    }
    // Query rows, pre-multiplied by the softmax scale and the K dequantization scale (unless
    // the keys are rebuilt: query_key_scale).
    for (int hh = 0; hh < heads; ++hh) {
      const int kv_head = item.kv_begin + hh;
      const float q_scale = p_.scale * query_key_scale(kv_head);
      for (int jt = 0; jt < tokens; ++jt) {
        const int64_t token = p_.query_start_loc[item.seq] + item.q_begin + jt;
        for (int g = 0; g < geo_.group; ++g) {
          const int r = hh * head_rows + jt * geo_.group + g;
          const int64_t base = token * p_.query_token_stride +
                               int64_t(kv_head * geo_.group + g) * p_.query_head_stride;
          float* row = q + int64_t(r) * dim_k_;
          load_query_row(p_.query, base, p_.io_type, q_scale, geo_.head_size, row);
          if (bf16_dot) {
            // The query as given (bf16); its scale is applied to the scores.
            std::memcpy(q_bf16 + int64_t(r) * dim_k_, static_cast<const uint16_t*>(p_.query) + base,
                        sizeof(uint16_t) * geo_.head_size);
          }
          std::fill(row + geo_.head_size, row + dim_k_, 0.0f);
          std::fill(acc + int64_t(r) * dim_v_, acc + int64_t(r + 1) * dim_v_, 0.0f);
          m[r] = neg_inf;
          l[r] = 0.0f;
        }
      }
    }
    // Zero tile padding so that padded lanes contribute nothing.
    for (int t = 0; t < p_.block_size; ++t) {
      std::fill(k_tile + int64_t(t) * dim_k_ + geo_.head_size, k_tile + int64_t(t + 1) * dim_k_,
                0.0f);
      std::fill(v_tile + int64_t(t) * dim_v_ + geo_.head_size_v, v_tile + int64_t(t + 1) * dim_v_,
                0.0f);
    }

    // Fused path: addresses of the page's rows (data, NVFP4 scales) of the current head.
    thread_local std::vector<const uint8_t*> row_refs;
    if (int64_t(row_refs.size()) < 4 * int64_t(p_.block_size)) row_refs.resize(4 * p_.block_size);
    const uint8_t** k_rows = row_refs.data();
    const uint8_t** k_scales = k_rows + p_.block_size;
    const uint8_t** v_rows = k_scales + p_.block_size;
    const uint8_t** v_scales = v_rows + p_.block_size;

    const int32_t* pages = p_.block_table + int64_t(item.seq) * p_.block_table_stride;
    for (int page_start = item.key_begin - item.key_begin % p_.block_size;
         page_start < item.key_end; page_start += p_.block_size) {
      const int lo = std::max(page_start, item.key_begin);
      const int hi = std::min(page_start + p_.block_size, item.key_end);
      const int64_t block = pages[page_start / p_.block_size];
      // Pages come in block-table order, not address order, and a head's rows of a page are
      // too few for the hardware prefetchers: request a later page's rows now so that their
      // misses overlap this page's work. Whole pages (all heads) are requested one page ahead,
      // a slice per head (below): the whole page at once would be a burst of misses that fills
      // the miss queues and stalls this page's own loads.
      const bool whole_pages = heads == p_.num_kv_heads;
      const int ahead = page_start + (whole_pages ? 1 : kPrefetchPages) * p_.block_size;
      const int64_t next = ahead < item.key_end ? pages[ahead / p_.block_size] : -1;
      if (next >= 0 && !whole_pages) {
        for (int h = item.kv_begin; h < item.kv_end; ++h) {
          prefetch_page(p_.key_cache, k_layout_, next, h, geo_.head_size);
          prefetch_page(p_.value_cache, v_layout_, next, h, geo_.head_size_v);
        }
      }
      // Whether any query token sees a key of this page (causal prefill skips the future).
      bool any = false;
      for (const auto& [b, e] : ranges) any |= std::max(b, lo) < std::min(e, hi);
      if (!any) continue;
      for (int hh = 0; hh < heads; ++hh) {
        const int kv_head = item.kv_begin + hh;
        const int h0 = hh * head_rows;
        if (next >= 0 && whole_pages) {
          prefetch_slice(p_.key_cache, next, k_page_bytes_, hh, heads);
          prefetch_slice(p_.value_cache, next, v_page_bytes_, hh, heads);
        }
#if defined(VLLM_KV_HAVE_AVX512_BF16)
        if constexpr (K == CacheKind::kNvfp4 && kBf16Dot) {
          if (bf16_dot && nvfp4_chunks_) {
            const float q_scale = p_.scale * side_scale(p_.key_cache, kv_head, K);
            for (int t0 = 0; t0 < p_.block_size; t0 += kChunkKeys) {
              if (std::max(page_start + t0, lo) >= std::min(page_start + t0 + kChunkKeys, hi)) {
                continue;
              }
              attend_nvfp4_chunk(block, page_start, t0, kv_head, ranges, lo, hi,
                                 q_bf16 + int64_t(h0) * dim_k_, q_scale,
                                 scores + int64_t(h0) * tokens_, m + h0, l + h0,
                                 acc + int64_t(h0) * dim_v_);
            }
            continue;
          }
        }
#endif
        if (fused) {
          locate_page(p_.key_cache, k_layout_, block, lo - page_start, hi - page_start, kv_head,
                      k_rows, k_scales);
        } else {
          decode_page(p_.key_cache, k_layout_, k_groups_, block, lo - page_start, hi - page_start,
                      kv_head, geo_.head_size, dim_k_, k_tile);
          if (key_transform_) {
            transform_keys(item.seq, kv_head, page_start, lo - page_start, hi - page_start, k_tile);
          }
        }
        for (int jt = 0; jt < tokens; ++jt) {
          const int b = std::max(ranges[jt].first, lo) - page_start;
          const int e = std::min(ranges[jt].second, hi) - page_start;
          const int r0 = h0 + jt * geo_.group;
          if (b >= e) continue;
          score_rows(q + int64_t(r0) * dim_k_, fused ? nullptr : k_tile, k_rows, k_scales, b, e,
                     scores + int64_t(r0) * tokens_,
                     bf16_dot ? q_bf16 + int64_t(r0) * dim_k_ : nullptr,
                     p_.scale * query_key_scale(kv_head));
          for (int g = 0; g < geo_.group; ++g) {
            softmax_step(scores + int64_t(r0 + g) * tokens_, b, e, m[r0 + g], l[r0 + g],
                         acc + int64_t(r0 + g) * dim_v_);
          }
        }
        if (fused) {
          locate_page(p_.value_cache, v_layout_, block, lo - page_start, hi - page_start, kv_head,
                      v_rows, v_scales);
        } else {
          decode_page(p_.value_cache, v_layout_, v_groups_, block, lo - page_start, hi - page_start,
                      kv_head, geo_.head_size_v, dim_v_, v_tile);
        }
        for (int jt = 0; jt < tokens; ++jt) {
          const int b = std::max(ranges[jt].first, lo) - page_start;
          const int e = std::min(ranges[jt].second, hi) - page_start;
          if (b >= e) continue;
          const int r0 = h0 + jt * geo_.group;
          accumulate_rows(scores + int64_t(r0) * tokens_, fused ? nullptr : v_tile, v_rows,
                          v_scales, b, e, acc + int64_t(r0) * dim_v_, bf16_v);
        }
      }
    }

    if (item.partial < 0) {
      finish_rows(p_, geo_, item.seq, item.kv_begin, item.kv_end, item.q_begin, item.q_end, m, l,
                  acc, dim_v_);
      return;
    }
    float* out = scratch + item.partial;
    const int row_floats = geo_.partial_row_floats();
    for (int r = 0; r < rows; ++r) {
      out[int64_t(r) * row_floats] = m[r];
      out[int64_t(r) * row_floats + 1] = l[r];
      std::memcpy(out + int64_t(r) * row_floats + 2, acc + int64_t(r) * dim_v_,
                  sizeof(float) * geo_.head_size_v);
    }
  }

 private:
  static int round_up(int n) { return (n + kLanes - 1) / kLanes * kLanes; }

  static constexpr int64_t kElementBytes =
      K == CacheKind::kUnquantized ? (C == SourceType::kFloat32 ? 4 : 2) : 1;

  // Cache rows whose values are exact in bf16 (bf16, FP8, NVFP4) go through vdpbf16ps (AVX-512
  // BF16 builds): keys dotted with a bf16 query (rounding differs from the fp32 path only in the
  // order of the fp32 sums), values weighted by the softmax weights rounded to bf16.
#if defined(VLLM_KV_HAVE_AVX512_BF16)
  static constexpr bool kBf16Dot = L == SimdLevel::kAvx512 && !is_per_token_head(K) &&
                                   (K != CacheKind::kUnquantized || C == SourceType::kBFloat16);
#else
  static constexpr bool kBf16Dot = false;
#endif

  // Rows per KV head up to which an item decodes in registers (fused).
  static constexpr int kMaxFusedRows = 8;

  // The NVFP4 chunk path (attend_nvfp4_chunk): keys per chunk, the head size it takes (one
  // 64-byte row of codes per key) and its block-scale groups.
  static constexpr int kChunkKeys = 16;
  static constexpr int kChunkHeadSize = 128;
  static constexpr int kChunkGroups = kChunkHeadSize / kNvfp4GroupSize;
  // Byte offsets of the first eight scale-plane rows of a chunk, from its first.
  using ChunkScaleRows = std::array<int64_t, 8>;
  // Byte g * kChunkKeys + t: where the scale of (key t, group g) is among a chunk's scale-plane
  // rows (kChunkGroups bytes each, concatenated).
  using ChunkScaleSelect = std::array<uint8_t, kChunkGroups * kChunkKeys>;

  static ChunkScaleSelect chunk_scale_select(ScaleLayout layout) {
    ChunkScaleSelect select{};
    for (int g = 0; g < kChunkGroups; ++g) {
      for (int t = 0; t < kChunkKeys; ++t) {
        int row = t;
        int col = g;
        if (layout == ScaleLayout::kInterleave4) interleave4_position(t, g, kChunkGroups, row, col);
        select[g * kChunkKeys + t] = uint8_t(row * kChunkGroups + col);
      }
    }
    return select;
  }

  static ChunkScaleRows chunk_scale_rows(const Nvfp4SideLayout& layout) {
    ChunkScaleRows rows{};
    for (int r = 0; r < 8; ++r) rows[r] = r * layout.token_step * layout.num_groups;
    return rows;
  }

  // Pages prefetched ahead of the one being attended when items take some heads of a page.
  static constexpr int kPrefetchPages = 2;

  // Bytes of one page of a side (all heads; pages are dense in NHD and HND alike).
  int64_t page_bytes(int head_size) const {
    const int64_t last_dim = K == CacheKind::kNvfp4 ? head_size / 2 + head_size / kNvfp4GroupSize
                             : is_per_token_head(K) ? int64_t(head_size) + kPerTokenHeadScaleBytes
                                                    : int64_t(head_size);
    return int64_t(p_.block_size) * p_.num_kv_heads * last_dim * kElementBytes;
  }

  // Requests slice `slice` of `slices` of the first `bytes` bytes of page `block` of a side (a
  // side's page is dense, NHD and HND alike), one request per line.
  void prefetch_slice(const CacheSide& side, int64_t block, int64_t bytes, int slice,
                      int slices) const {
    const char* page =
        static_cast<const char*>(side.data) + block * side.block_stride * kElementBytes;
    const int64_t lines = (bytes + 63) / 64;
    for (int64_t line = lines * slice / slices; line < lines * (slice + 1) / slices; ++line) {
      __builtin_prefetch(page + 64 * line);
    }
  }

  // Start loading the rows of head `head` of page `block` (and NVFP4 scales) into the cache.
  void prefetch_page(const CacheSide& side, const Nvfp4SideLayout& layout, int64_t block, int head,
                     int dim) const {
    const auto* base = static_cast<const char*>(side.data);
    for (int t = 0; t < p_.block_size; ++t) {
      const char* row;
      int64_t bytes;
      if constexpr (K == CacheKind::kNvfp4) {
        row = base + layout.data_offset(block, t, head);
        bytes = dim / 2;
        __builtin_prefetch(base + layout.scale_base(block, t, head, side.scale_layout));
      } else {
        row = base + entry_offset(side, block, t, head) * kElementBytes;
        bytes = dim * kElementBytes;
      }
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
    }
  }

  // The K scale folded into the query rows: 1 when the key tile holds rebuilt keys (they are
  // in real units, as the sink keys and the offset are given).
  float query_key_scale(int kv_head) const {
    return key_transform_ ? 1.0f : side_scale(p_.key_cache, kv_head, K);
  }

  // Rebuilds the keys of tile rows [t0, t1) (positions page_start + t of sequence `seq`, KV head
  // `head`, decoded by decode_page) from pre-RoPE keys: the sink key or the decoded key times the
  // K scale (the reference codec's value), plus the head's offset, then the forward RoPE rotation
  // of row `position` of rope_cos_sin. Scalar: this path is for correctness, not speed.
  // x <- c * H x in place (H the Sylvester Hadamard matrix, c = fp32(1 / sqrt(dim))): the
  // butterflies and the one multiply of kv_quant/hadamard.py, in its order, so that the result
  // is the reference rotation's to the bit.
  static void hadamard_row(float* x, int dim) {
    for (int h = 1; h < dim; h *= 2) {
      for (int i = 0; i < dim; i += 2 * h) {
        for (int j = i; j < i + h; ++j) {
          const float a = x[j];
          const float b = x[j + h];
          x[j] = a + b;
          x[j + h] = a - b;
        }
      }
    }
    const float c = float(1.0 / std::sqrt(double(dim)));  // fp32(1 / sqrt(D)), as torch rounds it
    for (int d = 0; d < dim; ++d) x[d] *= c;
  }

  void transform_keys(int seq, int head, int page_start, int t0, int t1, float* tile) const {
    const int dim = geo_.head_size;
    const float k_scale = side_scale(p_.key_cache, head, K);
    const float* offset = p_.key_offset != nullptr ? p_.key_offset + int64_t(head) * dim : nullptr;
    const int half = p_.rotary_dim / 2;
    for (int t = t0; t < t1; ++t) {
      const int position = page_start + t;
      float* x = tile + int64_t(t) * dim_k_;
      if (position < p_.num_sink_keys) {
        const int64_t row = (int64_t(seq) * p_.num_sink_keys + position) * p_.num_kv_heads + head;
        std::memcpy(x, p_.sink_keys + row * dim, sizeof(float) * dim);
      } else {
        for (int d = 0; d < dim; ++d) x[d] *= k_scale;
      }
      if (p_.key_hadamard) hadamard_row(x, dim);
      if (offset != nullptr) {
        for (int d = 0; d < dim; ++d) x[d] += offset[d];
      }
      if (p_.rope_cos_sin == nullptr) continue;
      const float* cos = p_.rope_cos_sin + int64_t(position) * p_.rotary_dim;
      const float* sin = cos + half;
      for (int i = 0; i < half; ++i) {
        float& a = x[p_.rope_is_neox ? i : 2 * i];
        float& b = x[p_.rope_is_neox ? i + half : 2 * i + 1];
        const float a0 = a;
        const float b0 = b;
        a = a0 * cos[i] - b0 * sin[i];
        b = b0 * cos[i] + a0 * sin[i];
      }
    }
  }

  // Decodes tokens [t0, t1) of page `block`, head `head` into tile rows t0..t1-1.
  void decode_page(const CacheSide& side, const Nvfp4SideLayout& layout,
                   const std::vector<int64_t>& groups, int64_t block, int t0, int t1, int head,
                   int dim, int row_stride, float* tile) const {
    const auto* base = static_cast<const uint8_t*>(side.data);
    for (int t = t0; t < t1; ++t) {
      float* dst = tile + int64_t(t) * row_stride;
      if constexpr (K == CacheKind::kNvfp4) {
        Decoder::decode(base + layout.data_offset(block, t, head),
                        base + layout.scale_base(block, t, head, side.scale_layout), groups.data(),
                        dim, dst);
      } else {
        Decoder::decode(base + entry_offset(side, block, t, head) * kElementBytes, nullptr, nullptr,
                        dim, dst);
      }
    }
  }

  // Addresses of rows [t0, t1) of head `head` of page `block` (data; NVFP4 scale base).
  void locate_page(const CacheSide& side, const Nvfp4SideLayout& layout, int64_t block, int t0,
                   int t1, int head, const uint8_t** rows, const uint8_t** scales) const {
    const auto* base = static_cast<const uint8_t*>(side.data);
    for (int t = t0; t < t1; ++t) {
      if constexpr (K == CacheKind::kNvfp4) {
        rows[t] = base + layout.data_offset(block, t, head);
        scales[t] = base + layout.scale_base(block, t, head, side.scale_layout);
      } else {
        rows[t] = base + entry_offset(side, block, t, head) * kElementBytes;
      }
    }
  }

  // scores[g][t] = q_g . k_t for the group's rows g and tokens [b, e), then the soft cap. K rows
  // come from the decoded tile, or (fused_) are decoded in registers from the cache.
  // q_bf16 (non-null only on the bf16 dot path): the group's query rows in bf16, unscaled;
  // q_scale: what q holds them multiplied by.
  void score_rows(const float* q, const float* k_tile, const uint8_t* const* k_rows,
                  const uint8_t* const* k_scales, int b, int e, float* scores,
                  [[maybe_unused]] const uint16_t* q_bf16, [[maybe_unused]] float q_scale) const {
    int g = 0;
#if defined(VLLM_KV_HAVE_AVX512_BF16)
    if constexpr (kBf16Dot) {
      if (q_bf16 != nullptr) {
        for (; g + 4 <= geo_.group; g += 4) {
          score_chunk_bf16<4>(q_bf16, k_rows, k_scales, b, e, scores, g, q_scale);
        }
        for (; g < geo_.group; ++g) {
          score_chunk_bf16<1>(q_bf16, k_rows, k_scales, b, e, scores, g, q_scale);
        }
      }
    }
#endif
    for (; g + 8 <= geo_.group; g += 8)
      score_chunk<8>(q, k_tile, k_rows, k_scales, b, e, scores, g);
    for (; g + 4 <= geo_.group; g += 4)
      score_chunk<4>(q, k_tile, k_rows, k_scales, b, e, scores, g);
    for (; g < geo_.group; ++g) score_chunk<1>(q, k_tile, k_rows, k_scales, b, e, scores, g);
    soft_cap(scores, geo_.group, b, e);
  }

  // The logits soft cap (if any) on scores [b, e) of `rows` rows.
  void soft_cap(float* scores, int rows, int b, int e) const {
    if (p_.logits_soft_cap <= 0.0f) return;
    const float cap = p_.logits_soft_cap;
    for (int r = 0; r < rows; ++r) {
      float* s = scores + int64_t(r) * tokens_;
      for (int t = b; t < e; ++t) s[t] = cap * std::tanh(s[t] / cap);
    }
  }

  // Vector d of key t: from the tile, or decoded from the cache when there is no tile (fused).
  V key_vector(const float* k_tile, const uint8_t* const* k_rows, const uint8_t* const* k_scales,
               int t, int d) const {
    if constexpr (L != SimdLevel::kGeneric) {
      if (k_tile == nullptr) return Decoder::vector(k_rows[t], k_scales[t], k_groups_.data(), d);
    }
    return load<L>(k_tile + int64_t(t) * dim_k_ + d);
  }

  V value_vector(const float* v_tile, const uint8_t* const* v_rows, const uint8_t* const* v_scales,
                 int t, int d) const {
    if constexpr (L != SimdLevel::kGeneric) {
      if (v_tile == nullptr) return Decoder::vector(v_rows[t], v_scales[t], v_groups_.data(), d);
    }
    return load<L>(v_tile + int64_t(t) * dim_v_ + d);
  }

#if defined(VLLM_KV_HAVE_AVX512_BF16)
  // Elements [d, d + 32) of a cache row as bf16, exactly: bf16 rows as they are; FP8 by
  // fp8_to_bf16_x32; NVFP4 codes looked up in the kScaledE2M1 rows of the two groups' block
  // scales. groups: the side's group offsets.
  static __m512i row_bf16(const uint8_t* row, const uint8_t* scales, const int64_t* groups, int d) {
    if constexpr (K == CacheKind::kNvfp4) {
      // Word j: source byte j / 2 in both halves, shifted right by 4 for odd j, so that its low
      // nibble is code j; bit 4 picks the table half of the element's group.
      alignas(64) static constexpr auto kDuplicate = [] {
        std::array<uint8_t, 64> index{};
        for (int k = 0; k < 64; ++k) index[k] = uint8_t(k / 4);
        return index;
      }();
      alignas(64) static constexpr auto kShift = [] {
        std::array<uint16_t, 32> shift{};
        for (int j = 0; j < 32; ++j) shift[j] = uint16_t(j % 2 == 0 ? 0 : 4);
        return shift;
      }();
      const __m512i bytes =
          _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d / 2)));
      const __m512i words = _mm512_permutexvar_epi8(_mm512_load_si512(kDuplicate.data()), bytes);
      const __m512i shifted = _mm512_srlv_epi16(words, _mm512_load_si512(kShift.data()));
      const __m512i index = _mm512_ternarylogic_epi32(  // (shifted & 0xF) | half
          shifted, _mm512_set1_epi16(0x0F), _mm512_maskz_set1_epi16(0xFFFF0000u, 16), 0xEA);
      const uint8_t* first = kScaledE2M1.bits[scales[groups[d / kNvfp4GroupSize]]];
      const uint8_t* second = kScaledE2M1.bits[scales[groups[d / kNvfp4GroupSize + 1]]];
      const __m512i table = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(first))),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(second)), 1);
      return _mm512_permutexvar_epi16(index, table);
    } else if constexpr (K == CacheKind::kFp8E4M3 || K == CacheKind::kFp8E5M2) {
      return fp8_to_bf16_x32<K>(row + d);
    } else {
      return _mm512_loadu_si512(row + 2 * d);
    }
  }

  // score_chunk for bf16 keys and a bf16 query: pairs of bf16 products summed in fp32
  // (vdpbf16ps) straight from the cache, then times q_scale. Keys come kKeys per pass; each
  // pass's partial sums are folded right away (the first two levels of the transposing
  // reduction, see reduce_add_many), the last two levels once per kLanes keys.
  template <int kRows>
  void score_chunk_bf16(const uint16_t* q, const uint8_t* const* k_rows,
                        const uint8_t* const* k_scales, int b, int e, float* scores, int g0,
                        float q_scale) const {
    constexpr int kKeys = 4;
    constexpr int kPasses = kLanes / kKeys;
    static_assert(kLanes == 16, "folds below assume 16 lanes");
    const V scale = splat<L>(q_scale);
    for (int t0 = b - b % kLanes; t0 < e; t0 += kLanes) {
      V folded[kRows][kPasses];  // per pass: kKeys keys x 4 partial sums
      for (int pass = 0; pass < kPasses; ++pass) {
        const int first = t0 + kKeys * pass;
        const int lo = std::max(b, first);
        const int hi = std::min(e, first + kKeys);
        if (lo >= hi) {
          for (int i = 0; i < kRows; ++i) folded[i][pass] = V{};
          continue;
        }
        __m512 sum[kKeys][kRows];
        for (int x = 0; x < kKeys; ++x) {
          for (int i = 0; i < kRows; ++i) sum[x][i] = _mm512_setzero_ps();
        }
        for (int d = 0; d < geo_.head_size; d += 32) {
          __m512bh kv[kKeys];
          for (int x = 0; x < kKeys; ++x) {
            // Keys outside [lo, hi) read a valid row; their sums are dropped below.
            const int t = std::clamp(first + x, lo, hi - 1);
            kv[x] = (__m512bh)row_bf16(k_rows[t], k_scales[t], k_groups_.data(), d);
          }
          for (int i = 0; i < kRows; ++i) {
            const auto qv = (__m512bh)_mm512_loadu_si512(q + int64_t(g0 + i) * dim_k_ + d);
            for (int x = 0; x < kKeys; ++x) sum[x][i] = _mm512_dpbf16_ps(sum[x][i], qv, kv[x]);
          }
        }
        for (int x = 0; x < kKeys; ++x) {
          if (first + x >= lo && first + x < hi) continue;
          for (int i = 0; i < kRows; ++i) sum[x][i] = _mm512_setzero_ps();
        }
        for (int i = 0; i < kRows; ++i) {
          folded[i][pass] =
              fold<8>(fold<16>(V(sum[0][i]), V(sum[1][i])), fold<16>(V(sum[2][i]), V(sum[3][i])));
        }
      }
      const int tb = std::max(b, t0);
      const int te = std::min(e, t0 + kLanes);
      for (int i = 0; i < kRows; ++i) {
        float* row = scores + int64_t(g0 + i) * tokens_;
        const V s =
            fold<2>(fold<4>(folded[i][0], folded[i][1]), fold<4>(folded[i][2], folded[i][3])) *
            scale;
        if (tb == t0 && te == t0 + kLanes) {
          store<L>(row + t0, s);
        } else {
          for (int t = tb; t < te; ++t) row[t] = s[t - t0];
        }
      }
    }
  }

  // One level of the transposing reduction (fold_pair) over kLanes lanes: a and b hold
  // kLanes / kPartials keys of kPartials partial sums each.
  template <int kPartials>
  static V fold(V a, V b) {
    return fold_pair<kLanes, kPartials>(a, b, std::make_index_sequence<kLanes>{});
  }

  // accumulate_chunk by vdpbf16ps, keys in pairs: the V rows of keys t and t + 1, interleaved
  // element by element, meet the pair (w[g][t], w[g][t + 1]) rounded to bf16 (as flash attention
  // rounds its probabilities for the PV product); sums in fp32. A lone last key pairs with zeros.
  template <int kRows>
  void accumulate_chunk_bf16(const float* weights, const uint8_t* const* v_rows,
                             const uint8_t* const* v_scales, int b, int e, float* acc,
                             int g0) const {
    for (int tb = b; tb < e; tb += 16) {
      const int te = std::min(e, tb + 16);
      // Row i's weights of keys [tb, te) in bf16, zero past te: pair j is pairs[i][j].
      alignas(32) uint32_t pairs[kRows][8];
      const __mmask16 valid = __mmask16((1u << (te - tb)) - 1);
      for (int i = 0; i < kRows; ++i) {
        const __m512 w = _mm512_maskz_loadu_ps(valid, weights + int64_t(g0 + i) * tokens_ + tb);
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[i]), (__m256i)_mm512_cvtneps_pbh(w));
      }
      int d = 0;
      if constexpr (kRows <= 4) {  // two slices of 32 per pass: enough chains in flight
        for (; d + 64 <= geo_.head_size_v; d += 64) {
          accumulate_slices_bf16<kRows, 2>(pairs, v_rows, v_scales, tb, te, acc, g0, d);
        }
      }
      for (; d < geo_.head_size_v; d += 32) {
        accumulate_slices_bf16<kRows, 1>(pairs, v_rows, v_scales, tb, te, acc, g0, d);
      }
    }
  }

  // Elements [d, d + 32 kSlices) of the rows' accumulators over keys [tb, te) (see above).
  template <int kRows, int kSlices>
  void accumulate_slices_bf16(const uint32_t (*pairs)[8], const uint8_t* const* v_rows,
                              const uint8_t* const* v_scales, int tb, int te, float* acc, int g0,
                              int d) const {
    // Lane 2j of the interleave: element j (of the half) of key t; lane 2j + 1: of key t + 1.
    alignas(64) static constexpr uint16_t kFirst[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                        37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                        11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i first_half = _mm512_load_si512(kFirst);
    const __m512i second_half = _mm512_add_epi16(first_half, _mm512_set1_epi16(16));
    __m512 a[kSlices][2][kRows];
    for (int c = 0; c < kSlices; ++c) {
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < kRows; ++i) {
          a[c][h][i] = _mm512_loadu_ps(acc + int64_t(g0 + i) * dim_v_ + d + 32 * c + 16 * h);
        }
      }
    }
    for (int t = tb; t < te; t += 2) {
      const bool partner = t + 1 < te;
      __m512bh w[kRows];
      for (int i = 0; i < kRows; ++i)
        w[i] = (__m512bh)_mm512_set1_epi32(int(pairs[i][(t - tb) / 2]));
      for (int c = 0; c < kSlices; ++c) {
        const __m512i x = row_bf16(v_rows[t], v_scales[t], v_groups_.data(), d + 32 * c);
        const __m512i y =
            partner ? row_bf16(v_rows[t + 1], v_scales[t + 1], v_groups_.data(), d + 32 * c)
                    : _mm512_setzero_si512();
        const auto lo = (__m512bh)_mm512_permutex2var_epi16(x, first_half, y);
        const auto hi = (__m512bh)_mm512_permutex2var_epi16(x, second_half, y);
        for (int i = 0; i < kRows; ++i) {
          a[c][0][i] = _mm512_dpbf16_ps(a[c][0][i], lo, w[i]);
          a[c][1][i] = _mm512_dpbf16_ps(a[c][1][i], hi, w[i]);
        }
      }
    }
    for (int c = 0; c < kSlices; ++c) {
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < kRows; ++i) {
          _mm512_storeu_ps(acc + int64_t(g0 + i) * dim_v_ + d + 32 * c + 16 * h, a[c][h][i]);
        }
      }
    }
  }

  // acc + the vdpbf16ps of `values` with the bf16 pair at `pair` in every lane.
  static __m512 dot_pair(__m512 acc, __m512bh values, const void* pair) {
    int32_t bits;
    std::memcpy(&bits, pair, sizeof(bits));
    return _mm512_dpbf16_ps(acc, values, (__m512bh)_mm512_set1_epi32(bits));
  }

  // NVFP4 in chunks of kChunkKeys keys (head size kChunkHeadSize on both sides). E2M1 codes become
  // bf16 unscaled (exact) by one vpermw from a register, and the block scales are applied in fp32:
  // no per-group table is loaded and no lane sums are folded. Keys: the chunk's rows transposed
  // so that lanes are keys, each group's dot products multiplied by the keys' block scales.
  // Values: keys in pairs, interleaved element by element, against the softmax weight times the
  // key's block scale, rounded to bf16 (as the weights alone are on the other formats' path).

  // Where a side's key rows and scale-plane rows of one chunk of one head are.
  struct Nvfp4Chunk {
    const uint8_t* data;    // the chunk's first key row
    int64_t data_step;      // bytes between key rows
    const uint8_t* scales;  // the chunk's first scale-plane row (kChunkGroups bytes per row)
  };

  Nvfp4Chunk chunk_at(const CacheSide& side, const Nvfp4SideLayout& layout, int64_t block, int t0,
                      int head) const {
    const auto* base = static_cast<const uint8_t*>(side.data);
    // The scale plane's rows are the linear layout's entries, whatever the layout puts in them.
    return {base + layout.data_offset(block, t0, head), layout.token_step * layout.data_bytes,
            base + layout.scale_base(block, t0, head, ScaleLayout::kLinear)};
  }

  // scale[g] lane t: block scale of group g of key t, fp32 (exact). The chunk's kChunkKeys
  // scale-plane rows are gathered and permuted by `select` (chunk_scale_select).
  static void chunk_scales(const Nvfp4Chunk& chunk, const ChunkScaleRows& rows,
                           const ChunkScaleSelect& select, __m512 (&scale)[kChunkGroups]) {
    // (The masked and maskz forms of the intrinsics below: GCC 12 warns about the undefined
    // vectors of the plain ones.)
    const __m512i index = _mm512_load_si512(rows.data());
    const __m512i first =
        _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), 0xFF, index, chunk.scales, 1);
    const __m512i second = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), 0xFF, index,
                                                       chunk.scales + 8 * rows[1], 1);
    const __m512i low = _mm512_permutex2var_epi8(first, _mm512_load_si512(select.data()), second);
    const __m512i high =
        _mm512_permutex2var_epi8(first, _mm512_load_si512(select.data() + 64), second);
    const auto to_fp32 = [](__m128i bytes) {
      const __m256i half = Decoder::e4m3_as_fp16_bits(_mm256_cvtepu8_epi16(bytes));
      return _mm512_mul_ps(_mm512_maskz_cvtph_ps(0xFFFF, half), _mm512_set1_ps(256.0f));
    };
    scale[0] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, low, 0));
    scale[1] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, low, 1));
    scale[2] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, low, 2));
    scale[3] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, low, 3));
    scale[4] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, high, 0));
    scale[5] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, high, 1));
    scale[6] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, high, 2));
    scale[7] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, high, 3));
  }

  // bf16 bits of the E2M1 values, twice: vpermw reads an index's low five bits, so bit 4 (left
  // over from the neighbouring nibble) may be anything.
  static __m512i e2m1_bf16_table() {
    alignas(64) static constexpr auto kTable = [] {
      std::array<uint16_t, 32> bits{};
      for (int i = 0; i < 32; ++i)
        bits[i] = uint16_t(std::bit_cast<uint32_t>(kE2M1Values[i % 16]) >> 16);
      return bits;
    }();
    return _mm512_load_si512(kTable.data());
  }

  // In place: r[j] lane t becomes r[t] lane j (a 16 x 16 transpose of 32-bit elements).
  static void transpose_16x16(__m512i (&r)[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    // r[4i + c], 128-bit lane b: column 4b + c of rows 4i .. 4i + 3.
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      const __m512i u = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
      const __m512i v = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
      const __m512i w = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
      const __m512i x = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
      t[c] = _mm512_shuffle_i32x4(u, v, 0x88);
      t[4 + c] = _mm512_shuffle_i32x4(u, v, 0xDD);
      t[8 + c] = _mm512_shuffle_i32x4(w, x, 0x88);
      t[12 + c] = _mm512_shuffle_i32x4(w, x, 0xDD);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
  }

  // scores[i][t] = q_i . k_t (times q_scale) for the chunk's keys t, kRows query rows (bf16, row
  // stride dim_k_). Byte p of every key row holds elements 2p, 2p + 1: after the transpose a
  // vpmultishiftqb puts both nibbles of byte p of each key where vpermw reads its index.
  template <int kRows>
  void score_nvfp4_chunk(const Nvfp4Chunk& chunk, const __m512 (&scale)[kChunkGroups],
                         const uint16_t* q, float q_scale, float* scores) const {
    // Per 64-bit lane (two keys): the bit offsets of byte k's low and high nibble of each key.
    alignas(64) static constexpr auto kNibbles = [] {
      std::array<std::array<uint8_t, 64>, 4> control{};
      for (int k = 0; k < 4; ++k) {
        for (int b = 0; b < 64; ++b) {
          const int key = (b / 4) % 2;
          const int high = (b / 2) % 2;
          control[k][b] = uint8_t(32 * key + 8 * k + 4 * high);
        }
      }
      return control;
    }();
    __m512i column[kChunkKeys];
    for (int t = 0; t < kChunkKeys; ++t) {
      column[t] = _mm512_loadu_si512(chunk.data + t * chunk.data_step);
    }
    transpose_16x16(column);  // column[j] lane t: bytes [4j, 4j + 4) of key t
    const __m512i table = e2m1_bf16_table();
    __m512 score[kRows];
    for (int i = 0; i < kRows; ++i) score[i] = _mm512_setzero_ps();
    // Unrolled whole: column[] stays in registers.
#pragma GCC unroll 8
    for (int g = 0; g < kChunkGroups; ++g) {
      __m512 sum[kRows];
      for (int i = 0; i < kRows; ++i) sum[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int p = g * kNvfp4GroupSize / 2; p < (g + 1) * kNvfp4GroupSize / 2; ++p) {
        const __m512i index =
            _mm512_multishift_epi64_epi8(_mm512_load_si512(kNibbles[p % 4].data()), column[p / 4]);
        const auto codes = (__m512bh)_mm512_permutexvar_epi16(index, table);
        for (int i = 0; i < kRows; ++i) sum[i] = dot_pair(sum[i], codes, q + i * dim_k_ + 2 * p);
      }
      for (int i = 0; i < kRows; ++i) score[i] = _mm512_fmadd_ps(sum[i], scale[g], score[i]);
    }
    for (int i = 0; i < kRows; ++i) {
      _mm512_storeu_ps(scores + int64_t(i) * tokens_,
                       _mm512_mul_ps(score[i], _mm512_set1_ps(q_scale)));
    }
  }

  // acc_i += sum_t w[i][t] v_t over the chunk's keys for kRows rows (weights: row stride tokens_;
  // valid[i]: the keys row i attends).
  template <int kRows>
  void accumulate_nvfp4_chunk(const Nvfp4Chunk& chunk, const __m512 (&scale)[kChunkGroups],
                              const __m512 (&weights)[kRows], const __mmask16* valid,
                              float* acc) const {
    // A key pair's values, element by element (dword j of a group: element j of the first key,
    // then of the second), in two steps. kGather: 64-bit lane q of a quad of groups holds byte q
    // of each of the four groups of the first key (bytes 0-3), then of the second (4-7), which
    // are elements 2q and 2q + 1 of each. kNibbles[k]: each word of lane q takes the nibble of
    // group k of the quad that it decodes (vpermw reads an index's low five bits; the fifth,
    // from the neighbouring nibble, is ignored by the doubled table).
    constexpr int kQuads = kChunkGroups / 4;
    alignas(64) static constexpr auto kGather = [] {
      std::array<std::array<uint8_t, 64>, kQuads> index{};
      for (int quad = 0; quad < kQuads; ++quad) {
        for (int b = 0; b < 64; ++b) {
          const int lane = b / 8;
          const int second = (b % 8) / 4;
          const int group = 4 * quad + b % 4;
          index[quad][b] = uint8_t(64 * second + 8 * group + lane);
        }
      }
      return index;
    }();
    alignas(64) static constexpr auto kNibbles = [] {
      std::array<std::array<uint8_t, 64>, 4> control{};
      for (int k = 0; k < 4; ++k) {
        for (int b = 0; b < 64; ++b) {
          const int word = (b / 2) % 4;  // element 2q (words 0, 1) or 2q + 1 (2, 3); key word % 2
          control[k][b] = uint8_t(8 * (4 * (word % 2) + k) + 4 * (word / 2));
        }
      }
      return control;
    }();
    // pairs[g][i][m]: row i's weights of keys 2m, 2m + 1 times their group-g scales, in bf16.
    alignas(32) uint32_t pairs[kChunkGroups][kRows][kChunkKeys / 2];
    __mmask16 keys = 0;
    for (int i = 0; i < kRows; ++i) {
      keys |= valid[i];
      // (Masked: a key outside valid[i] may have any scale byte, NaN included.)
      for (int g = 0; g < kChunkGroups; ++g) {
        _mm256_store_si256(
            reinterpret_cast<__m256i*>(pairs[g][i]),
            (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mul_ps(valid[i], weights[i], scale[g])));
      }
    }
    const __m512i table = e2m1_bf16_table();
    // kGroups groups (whole quads) per pass: each pair of key rows is loaded once for all of
    // them, and the kGroups * kRows accumulators are enough independent vdpbf16ps chains to hide
    // its latency.
    constexpr int kGroups = kRows >= 4 ? 4 : kChunkGroups;
    for (int g0 = 0; g0 < kChunkGroups; g0 += kGroups) {
      __m512 a[kGroups][kRows];
      for (int h = 0; h < kGroups; ++h) {
        for (int i = 0; i < kRows; ++i) {
          a[h][i] = _mm512_loadu_ps(acc + int64_t(i) * dim_v_ + (g0 + h) * kNvfp4GroupSize);
        }
      }
      for (int pair = 0; pair < kChunkKeys / 2; ++pair) {
        if (((keys >> (2 * pair)) & 3) == 0) continue;
        const __m512i x = _mm512_loadu_si512(chunk.data + 2 * pair * chunk.data_step);
        const __m512i y = _mm512_loadu_si512(chunk.data + (2 * pair + 1) * chunk.data_step);
        __m512i quads[kGroups / 4];
        for (int u = 0; u < kGroups / 4; ++u) {
          quads[u] = _mm512_permutex2var_epi8(x, _mm512_load_si512(kGather[g0 / 4 + u].data()), y);
        }
        for (int h = 0; h < kGroups; ++h) {
          const __m512i index =
              _mm512_multishift_epi64_epi8(_mm512_load_si512(kNibbles[h % 4].data()), quads[h / 4]);
          const auto values = (__m512bh)_mm512_permutexvar_epi16(index, table);
          for (int i = 0; i < kRows; ++i)
            a[h][i] = dot_pair(a[h][i], values, &pairs[g0 + h][i][pair]);
        }
      }
      for (int h = 0; h < kGroups; ++h) {
        for (int i = 0; i < kRows; ++i) {
          _mm512_storeu_ps(acc + int64_t(i) * dim_v_ + (g0 + h) * kNvfp4GroupSize, a[h][i]);
        }
      }
    }
  }

  // exp(x) for x <= 0 (-inf gives 0): 2^k * 2^f with t = x log2(e), k = round(t), f = t - k in
  // [-1/2, 1/2], 2^f by its degree-6 Taylor polynomial (relative error ~1e-7 plus t's rounding),
  // the product by vscalefps (t clamped at -200: 0 exactly).
  static __m512 exp_scalef(__m512 x) {
    const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _mm512_set1_ps(-200.0f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, k);
    // ln(2)^n / n!
    __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
  }

  // out[i] = op-reduction of the 16 lanes of v[i]. Four rows share one transposing tree.
  template <int kRows, typename Op>
  static void reduce_rows(const __m512 (&v)[kRows], Op op, float (&out)[kRows]) {
    if constexpr (kRows == 4) {
      // a: lanes 0-7 v[0]'s halves combined, 8-15 v[1]'s; b likewise for v[2], v[3]; c: 128-bit
      // lane r holds row r's four partials; then within each 128-bit lane.
      const __m512 a =
          op(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
      const __m512 b =
          op(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
      const __m512 c = op(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
      const __m512 d = op(c, _mm512_permute_ps(c, 0x4E));
      const __m512 e = op(d, _mm512_permute_ps(d, 0xB1));
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, e);
      for (int i = 0; i < 4; ++i) out[i] = lanes[4 * i];
    } else {
      for (int i = 0; i < kRows; ++i) {
        __m512 x = v[i];
        x = op(x, _mm512_shuffle_f32x4(x, x, 0x4E));
        x = op(x, _mm512_shuffle_f32x4(x, x, 0xB1));
        x = op(x, _mm512_permute_ps(x, 0x4E));
        x = op(x, _mm512_permute_ps(x, 0xB1));
        out[i] = _mm512_cvtss_f32(x);
      }
    }
  }

  // Online-softmax update of kRows rows with a chunk's scores (row stride tokens_; keys outside
  // valid[i] ignored): new maxima, sums, accumulators rescaled; weights[i] = exp(s - max) on
  // valid[i], 0 elsewhere. A row without a finite score keeps its state (weights 0), as
  // softmax_step does.
  template <int kRows>
  void softmax_chunk(const float* scores, const __mmask16* valid, float* m, float* l, float* acc,
                     __m512 (&weights)[kRows]) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    __m512 s[kRows];
    float top[kRows];
    for (int i = 0; i < kRows; ++i) {
      s[i] = _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), valid[i], scores + int64_t(i) * tokens_);
    }
    reduce_rows<kRows>(s, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }, top);
    for (int i = 0; i < kRows; ++i) {
      if (top[i] == neg_inf) {
        weights[i] = _mm512_setzero_ps();
        continue;
      }
      const float new_max = std::max(m[i], top[i]);
      weights[i] =
          _mm512_maskz_mov_ps(valid[i], exp_scalef(_mm512_sub_ps(s[i], _mm512_set1_ps(new_max))));
      if (new_max != m[i]) {
        const float correction = std::exp(m[i] - new_max);  // 0 for the first keys
        l[i] *= correction;
        float* a = acc + int64_t(i) * dim_v_;
        for (int d = 0; d < kChunkHeadSize; d += 16) {
          _mm512_storeu_ps(a + d,
                           _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_set1_ps(correction)));
        }
        m[i] = new_max;
      }
    }
    float sums[kRows];
    reduce_rows<kRows>(weights, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }, sums);
    for (int i = 0; i < kRows; ++i) l[i] += sums[i];
  }

  // One chunk (page tokens [t0, t0 + kChunkKeys)) of one KV head for the item's rows of that head:
  // scores, online softmax, values. q / scores / m / l / acc: the head's first row.
  void attend_nvfp4_chunk(int64_t block, int page_start, int t0, int kv_head,
                          const std::vector<std::pair<int, int>>& ranges, int lo, int hi,
                          const uint16_t* q, float q_scale, float* scores, float* m, float* l,
                          float* acc) const {
    const int rows = int(ranges.size()) * geo_.group;
    __m512 scale[kChunkGroups];
    const Nvfp4Chunk keys = chunk_at(p_.key_cache, k_layout_, block, t0, kv_head);
    chunk_scales(keys, k_scale_rows_, k_scale_select_, scale);
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      score_nvfp4_chunk<4>(keys, scale, q + int64_t(r) * dim_k_, q_scale,
                           scores + int64_t(r) * tokens_ + t0);
    }
    for (; r < rows; ++r) {
      score_nvfp4_chunk<1>(keys, scale, q + int64_t(r) * dim_k_, q_scale,
                           scores + int64_t(r) * tokens_ + t0);
    }
    __mmask16 valid[kMaxFusedRows];
    const int chunk_lo = std::max(lo, page_start + t0);
    const int chunk_hi = std::min(hi, page_start + t0 + kChunkKeys);
    for (int jt = 0; jt < int(ranges.size()); ++jt) {
      const int b = std::max(ranges[jt].first, chunk_lo) - page_start;
      const int e = std::min(ranges[jt].second, chunk_hi) - page_start;
      const int r0 = jt * geo_.group;
      const __mmask16 mask =
          b < e ? __mmask16(((1u << (e - t0)) - 1) & ~((1u << (b - t0)) - 1)) : __mmask16(0);
      for (int g = 0; g < geo_.group; ++g) valid[r0 + g] = mask;
      if (b < e) soft_cap(scores + int64_t(r0) * tokens_, geo_.group, b, e);
    }
    const Nvfp4Chunk values = chunk_at(p_.value_cache, v_layout_, block, t0, kv_head);
    chunk_scales(values, v_scale_rows_, v_scale_select_, scale);
    for (r = 0; r + 4 <= rows; r += 4) {
      __m512 weights[4];
      softmax_chunk<4>(scores + int64_t(r) * tokens_ + t0, valid + r, m + r, l + r,
                       acc + int64_t(r) * dim_v_, weights);
      accumulate_nvfp4_chunk<4>(values, scale, weights, valid + r, acc + int64_t(r) * dim_v_);
    }
    for (; r < rows; ++r) {
      __m512 weights[1];
      softmax_chunk<1>(scores + int64_t(r) * tokens_ + t0, valid + r, m + r, l + r,
                       acc + int64_t(r) * dim_v_, weights);
      accumulate_nvfp4_chunk<1>(values, scale, weights, valid + r, acc + int64_t(r) * dim_v_);
    }
  }
#endif

  // Tokens are taken kLanes at a time: per token, a vector of partial dot products per row,
  // then one transposing reduction per row gives the kLanes scores (instead of a horizontal sum
  // per token and row). Two tokens per pass when the rows are few, so that enough independent
  // FMA chains are in flight.
  template <int kRows>
  void score_chunk(const float* q, const float* k_tile, const uint8_t* const* k_rows,
                   const uint8_t* const* k_scales, int b, int e, float* scores, int g0) const {
    constexpr int kTokens = kRows <= 4 ? 2 : 1;
    V part[kRows][kLanes];
    for (int t0 = b - b % kLanes; t0 < e; t0 += kLanes) {
      const int tb = std::max(b, t0);
      const int te = std::min(e, t0 + kLanes);
      const bool whole = tb == t0 && te == t0 + kLanes;
      if (!whole) {
        for (int i = 0; i < kRows; ++i) std::fill(part[i], part[i] + kLanes, V{});
      }
      int t = tb;
      for (; t + kTokens <= te; t += kTokens) {
        V sum[kTokens][kRows] = {};
        for (int d = 0; d < dim_k_; d += kLanes) {
          V kv[kTokens];
          for (int x = 0; x < kTokens; ++x) kv[x] = key_vector(k_tile, k_rows, k_scales, t + x, d);
          for (int i = 0; i < kRows; ++i) {
            const V qv = load<L>(q + int64_t(g0 + i) * dim_k_ + d);
            for (int x = 0; x < kTokens; ++x) sum[x][i] = fmadd<L>(qv, kv[x], sum[x][i]);
          }
        }
        for (int x = 0; x < kTokens; ++x) {
          for (int i = 0; i < kRows; ++i) part[i][t + x - t0] = sum[x][i];
        }
      }
      for (; t < te; ++t) {
        V sum[kRows] = {};
        for (int d = 0; d < dim_k_; d += kLanes) {
          const V kv = key_vector(k_tile, k_rows, k_scales, t, d);
          for (int i = 0; i < kRows; ++i) {
            sum[i] = fmadd<L>(load<L>(q + int64_t(g0 + i) * dim_k_ + d), kv, sum[i]);
          }
        }
        for (int i = 0; i < kRows; ++i) part[i][t - t0] = sum[i];
      }
      for (int i = 0; i < kRows; ++i) {
        // t0 + kLanes <= tokens_ (t0 < block_size, a multiple of kLanes): within the row.
        float* row = scores + int64_t(g0 + i) * tokens_;
        const V s = reduce_add_many<kLanes>(part[i]);
        if (whole) {
          store<L>(row + t0, s);
        } else {
          for (int tt = tb; tt < te; ++tt) row[tt] = s[tt - t0];
        }
      }
    }
  }

  // Online-softmax update of one row with the scores of keys [b, e) of a page: new max, rescale
  // of the running sum and accumulator, scores replaced by their weights exp(s - max). The
  // lanes outside [b, e) of the vectors touched are set to -inf first (weight 0).
  void softmax_step(float* s, int b, int e, float& m, float& l, float* acc) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int vb = b - b % kLanes;
    const int ve = (e + kLanes - 1) / kLanes * kLanes;
    std::fill(s + vb, s + b, neg_inf);
    std::fill(s + e, s + ve, neg_inf);
    V top = splat<L>(neg_inf);
    for (int t = vb; t < ve; t += kLanes) top = vmax<L>(top, load<L>(s + t));
    const float page_max = reduce_max<kLanes>(top);
    if (page_max == neg_inf) return;
    const float new_max = std::max(m, page_max);
    V sum = V{};
    for (int t = vb; t < ve; t += kLanes) {
      const V w = vexp<L>(load<L>(s + t) - new_max);
      store<L>(s + t, w);
      sum += w;
    }
    if (new_max != m) {
      const float correction = std::exp(m - new_max);  // 0 for the first keys
      l *= correction;
      const V c = splat<L>(correction);
      for (int d = 0; d < dim_v_; d += kLanes) store<L>(acc + d, load<L>(acc + d) * c);
      m = new_max;
    }
    l += reduce_add<kLanes>(sum);
  }

  // acc_g += sum_t w[g][t] * v_t for the group's rows; bf16: by the bf16 dot (fused V rows).
  void accumulate_rows(const float* weights, const float* v_tile, const uint8_t* const* v_rows,
                       const uint8_t* const* v_scales, int b, int e, float* acc,
                       [[maybe_unused]] bool bf16) const {
    int g = 0;
#if defined(VLLM_KV_HAVE_AVX512_BF16)
    if constexpr (kBf16Dot) {
      if (bf16) {
        for (; g + 4 <= geo_.group; g += 4) {
          accumulate_chunk_bf16<4>(weights, v_rows, v_scales, b, e, acc, g);
        }
        for (; g < geo_.group; ++g) {
          accumulate_chunk_bf16<1>(weights, v_rows, v_scales, b, e, acc, g);
        }
      }
    }
#endif
    for (; g + 8 <= geo_.group; g += 8) {
      accumulate_chunk<8>(weights, v_tile, v_rows, v_scales, b, e, acc, g);
    }
    for (; g + 4 <= geo_.group; g += 4) {
      accumulate_chunk<4>(weights, v_tile, v_rows, v_scales, b, e, acc, g);
    }
    for (; g < geo_.group; ++g)
      accumulate_chunk<1>(weights, v_tile, v_rows, v_scales, b, e, acc, g);
  }

  // Two vectors of the head dimension per pass when the rows are few: enough independent FMA
  // chains in flight.
  template <int kRows>
  void accumulate_chunk(const float* weights, const float* v_tile, const uint8_t* const* v_rows,
                        const uint8_t* const* v_scales, int b, int e, float* acc, int g0) const {
    constexpr int kVecs = kRows <= 4 ? 2 : 1;
    int d = 0;
    for (; d + kVecs * kLanes <= dim_v_; d += kVecs * kLanes) {
      V a[kVecs][kRows];
      for (int x = 0; x < kVecs; ++x) {
        for (int i = 0; i < kRows; ++i) {
          a[x][i] = load<L>(acc + int64_t(g0 + i) * dim_v_ + d + x * kLanes);
        }
      }
      for (int t = b; t < e; ++t) {
        V v[kVecs];
        for (int x = 0; x < kVecs; ++x) {
          v[x] = value_vector(v_tile, v_rows, v_scales, t, d + x * kLanes);
        }
        for (int i = 0; i < kRows; ++i) {
          const V w = splat<L>(weights[int64_t(g0 + i) * tokens_ + t]);
          for (int x = 0; x < kVecs; ++x) a[x][i] = fmadd<L>(w, v[x], a[x][i]);
        }
      }
      for (int x = 0; x < kVecs; ++x) {
        for (int i = 0; i < kRows; ++i) {
          store<L>(acc + int64_t(g0 + i) * dim_v_ + d + x * kLanes, a[x][i]);
        }
      }
    }
    for (; d < dim_v_; d += kLanes) {
      V a[kRows];
      for (int i = 0; i < kRows; ++i) a[i] = load<L>(acc + int64_t(g0 + i) * dim_v_ + d);
      for (int t = b; t < e; ++t) {
        const V v = value_vector(v_tile, v_rows, v_scales, t, d);
        for (int i = 0; i < kRows; ++i) {
          a[i] = fmadd<L>(splat<L>(weights[int64_t(g0 + i) * tokens_ + t]), v, a[i]);
        }
      }
      for (int i = 0; i < kRows; ++i) store<L>(acc + int64_t(g0 + i) * dim_v_ + d, a[i]);
    }
  }

  const PagedAttentionParams& p_;
  AttentionGeometry geo_;
  int dim_k_;   // head_size rounded up to whole vectors (tile and query row stride)
  int dim_v_;   // head_size_v rounded up (tile and accumulator row stride)
  int tokens_;  // block_size rounded up (score row stride)
  // rope_cos_sin, key_offset or sink_keys given: keys are rebuilt by transform_keys.
  bool key_transform_;
  // Decode in registers inside the dot products is possible (vector levels, head sizes of whole
  // vectors, keys as stored); otherwise pages are always decoded into the fp32 tiles first.
  bool fused_;
  // The bf16 dot path applies (kBf16Dot, a bf16 query, head size of whole 32-element vectors).
  bool bf16_dot_;
  // V rows are accumulated by the bf16 dot (kBf16Dot, head size of whole 32-element vectors).
  bool bf16_v_;
  // NVFP4 pages go through attend_nvfp4_chunk (bf16 dot on both sides, head size
  // kChunkHeadSize, pages of whole chunks).
  bool nvfp4_chunks_;
  alignas(64) ChunkScaleSelect k_scale_select_{};
  alignas(64) ChunkScaleSelect v_scale_select_{};
  alignas(64) ChunkScaleRows k_scale_rows_{};
  alignas(64) ChunkScaleRows v_scale_rows_{};
  int64_t k_page_bytes_;
  int64_t v_page_bytes_;
  Nvfp4SideLayout k_layout_{};
  Nvfp4SideLayout v_layout_{};
  std::vector<int64_t> k_groups_;
  std::vector<int64_t> v_groups_;
};

// Runs the attention of `p` with instruction set `level` (kAuto: the widest compiled) over the
// items of `plan`. parallel_for(begin, end, grain, fn) runs fn on sub-ranges of [begin, end) in
// parallel. scratch holds plan.scratch_floats floats.
template <typename ParallelFor>
void paged_attention(const PagedAttentionParams& p, const AttentionPlan& plan, float* scratch,
                     SimdLevel level, const ParallelFor& parallel_for) {
  if (level == SimdLevel::kAuto) level = widest_simd_level();
  const auto run = [&](auto kind_tag, auto type_tag, auto level_tag) {
    const PagedAttention<decltype(kind_tag)::value, decltype(type_tag)::value,
                         decltype(level_tag)::value>
        kernel(p);
    parallel_for(0, int64_t(plan.items.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) kernel.run(plan.items[i], scratch);
    });
  };
  const auto with_level = [&](auto kind_tag, auto type_tag) {
    switch (level) {
#if defined(VLLM_KV_HAVE_AVX512)
      case SimdLevel::kAvx512:
        return run(kind_tag, type_tag, std::integral_constant<SimdLevel, SimdLevel::kAvx512>{});
#endif
#if defined(VLLM_KV_HAVE_AVX2)
      case SimdLevel::kAvx2:
        return run(kind_tag, type_tag, std::integral_constant<SimdLevel, SimdLevel::kAvx2>{});
#endif
      default:
        return run(kind_tag, type_tag, std::integral_constant<SimdLevel, SimdLevel::kGeneric>{});
    }
  };
  using F32 = std::integral_constant<SourceType, SourceType::kFloat32>;
  switch (p.cache_kind) {
    case CacheKind::kFp8E4M3:
      with_level(std::integral_constant<CacheKind, CacheKind::kFp8E4M3>{}, F32{});
      break;
    case CacheKind::kFp8E5M2:
      with_level(std::integral_constant<CacheKind, CacheKind::kFp8E5M2>{}, F32{});
      break;
    case CacheKind::kNvfp4:
      with_level(std::integral_constant<CacheKind, CacheKind::kNvfp4>{}, F32{});
      break;
    case CacheKind::kInt8PerTokenHead:
      with_level(std::integral_constant<CacheKind, CacheKind::kInt8PerTokenHead>{}, F32{});
      break;
    case CacheKind::kFp8PerTokenHead:
      with_level(std::integral_constant<CacheKind, CacheKind::kFp8PerTokenHead>{}, F32{});
      break;
    case CacheKind::kUnquantized: {
      using U = std::integral_constant<CacheKind, CacheKind::kUnquantized>;
      switch (p.cache_type) {
        case SourceType::kFloat32:
          with_level(U{}, F32{});
          break;
        case SourceType::kFloat16:
          with_level(U{}, std::integral_constant<SourceType, SourceType::kFloat16>{});
          break;
        case SourceType::kBFloat16:
          with_level(U{}, std::integral_constant<SourceType, SourceType::kBFloat16>{});
          break;
      }
      break;
    }
  }
  parallel_for(0, int64_t(plan.merges.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) merge_partials(p, plan.merges[i], scratch);
  });
}

}  // namespace vllm_kv::cpu::attention
