// Format decode of the CPU attention kernels: cache entries of every format to fp32 (scalar and
// per SIMD level), and the FP8 / NVFP4 tables and conversions of the bf16 dot path.
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cache_kernels.h"
#include "cpu/attention_simd.h"
#include "int4_per_token_head.h"
#include "kv_quant_math.h"
#include "per_token_head.h"

namespace vllm_kv::cpu::attention {

// ---------------------------------------------------------------------------- format decode

// Bytes per stored element of a cache of format K holding source type C (unquantized caches
// store C; every other format is addressed in bytes).
template <CacheKind K, SourceType C>
inline constexpr int64_t kCacheElementBytes =
    K == CacheKind::kUnquantized ? (C == SourceType::kFloat32 ? 4 : 2) : 1;

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

// FP8 byte of format K (e4m3 or e5m2) -> fp32 at compile time (exact; Inf and NaN codes too).
template <CacheKind K>
constexpr float fp8_value(int byte) {
  static_assert(K == CacheKind::kFp8E4M3 || K == CacheKind::kFp8E5M2);
  if constexpr (K == CacheKind::kFp8E4M3) {
    return e4m3_value(byte);
  } else {
    const int exponent = (byte >> 2) & 0x1F;
    const int mantissa = byte & 0x3;
    float magnitude = std::numeric_limits<float>::infinity();
    if (exponent == 0x1F && mantissa != 0) {
      magnitude = std::numeric_limits<float>::quiet_NaN();
    } else if (exponent != 0x1F) {
      magnitude = exponent == 0 ? float(mantissa) / 4.0f : 1.0f + float(mantissa) / 4.0f;
      for (int e = exponent == 0 ? 1 : exponent; e < 15; ++e) magnitude /= 2.0f;  // 2^(e - 15)
      for (int e = 15; e < exponent; ++e) magnitude *= 2.0f;
    }
    return (byte & 0x80) ? -magnitude : magnitude;
  }
}

#if defined(VLLM_KV_HAVE_AVX512_BF16)
// The bf16 bits of the 128 FP8 magnitudes of format K (exact: FP8 values have at most 4
// significant bits and exponents within bf16's range), low and high bytes apart: each a
// two-register vpermi2b table. vpermi2b reads seven index bits, so a code's sign bit is ignored by
// the lookup and ORed into the high byte after it.
template <CacheKind K>
struct Fp8Bf16Bytes {
  alignas(64) uint8_t low[128];
  alignas(64) uint8_t high[128];
  constexpr Fp8Bf16Bytes() : low(), high() {
    for (int m = 0; m < 128; ++m) {
      const uint32_t word = std::bit_cast<uint32_t>(fp8_value<K>(m)) >> 16;
      low[m] = uint8_t(word & 0xFF);
      high[m] = uint8_t(word >> 8);
    }
  }
};
template <CacheKind K>
alignas(64) inline constexpr Fp8Bf16Bytes<K> kFp8Bf16Bytes{};

// 64 FP8 codes -> the bf16 words of their values, by two byte lookups (low and high bytes, the
// sign ORed in) and unpacklo / unpackhi_epi8, which interleave within 128-bit lanes: out[v] word
// w comes from the code at byte 16 (w / 8) + 8 v + w % 8 of `codes`. Callers place their codes
// there with one vpermb / vpermt2b (fp8_code_order).
template <CacheKind K>
inline void fp8_codes_to_bf16(__m512i codes, __m512i (&out)[2]) {
  const auto* low_table = reinterpret_cast<const __m512i*>(kFp8Bf16Bytes<K>.low);
  const auto* high_table = reinterpret_cast<const __m512i*>(kFp8Bf16Bytes<K>.high);
  const __m512i low = _mm512_permutex2var_epi8(_mm512_load_si512(low_table), codes,
                                               _mm512_load_si512(low_table + 1));
  __m512i high = _mm512_permutex2var_epi8(_mm512_load_si512(high_table), codes,
                                          _mm512_load_si512(high_table + 1));
  high = _mm512_ternarylogic_epi32(high, codes, _mm512_set1_epi8(int8_t(0x80)), 0xF8);  // | sign
  out[0] = _mm512_unpacklo_epi8(low, high);
  out[1] = _mm512_unpackhi_epi8(low, high);
}

// The vpermb / vpermt2b index that puts code source(v, w) where fp8_codes_to_bf16 takes word w of
// out[v] from.
template <typename Source>
constexpr std::array<uint8_t, 64> fp8_code_order(Source source) {
  std::array<uint8_t, 64> index{};
  for (int p = 0; p < 64; ++p) index[p] = uint8_t(source((p % 16) / 8, 8 * (p / 16) + p % 8));
  return index;
}

// The first 32 bytes of a 64-byte load.
inline constexpr __mmask64 kLow32 = 0xFFFFFFFFu;

// codes placed by a fp8_code_order index.
inline __m512i fp8_placed(const std::array<uint8_t, 64>& order, __m512i codes) {
  return _mm512_maskz_permutexvar_epi8(~__mmask64(0), _mm512_load_si512(order.data()), codes);
}

// 32 FP8 bytes at src -> their values as bf16, in order (exact; NaN codes give a bf16 NaN).
template <CacheKind K>
inline __m512i fp8_to_bf16_x32(const uint8_t* src) {
  alignas(64) static constexpr auto kOrder = fp8_code_order([](int, int w) { return w; });
  __m512i out[2];
  fp8_codes_to_bf16<K>(fp8_placed(kOrder, _mm512_maskz_loadu_epi8(kLow32, src)), out);
  return out[0];
}

// 64 FP8 bytes at src -> out[0] (elements 0-31) and out[1] (32-63) as bf16.
template <CacheKind K>
inline void fp8_to_bf16_x64(const uint8_t* src, __m512i (&out)[2]) {
  alignas(64) static constexpr auto kOrder =
      fp8_code_order([](int v, int w) { return 32 * v + w; });
  fp8_codes_to_bf16<K>(fp8_placed(kOrder, _mm512_loadu_si512(src)), out);
}

// Elements [0, 32) of two FP8 rows x and y (y nullptr: zeros) as bf16 interleaved element by
// element, out[h] lane 2j / 2j + 1 holding element 16 h + j of x / y: the operands of a vdpbf16ps
// against a pair of weights of two keys (interleave_pairs of the rows' fp8_to_bf16_x32).
template <CacheKind K>
inline void fp8_pairs_to_bf16(const uint8_t* x, const uint8_t* y, __m512i (&out)[2]) {
  alignas(64) static constexpr auto kOrder =
      fp8_code_order([](int v, int w) { return (w % 2 == 0 ? 0 : 64) + 16 * v + w / 2; });
  const __m512i y_bytes =
      y == nullptr ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi8(kLow32, y);
  fp8_codes_to_bf16<K>(_mm512_permutex2var_epi8(_mm512_maskz_loadu_epi8(kLow32, x),
                                                _mm512_load_si512(kOrder.data()), y_bytes),
                       out);
}
#endif

// Decodes one cache entry (a token's head) of `dim` elements to fp32 at dst. The formats:
// unquantized fp32 / fp16 / bf16 (C), FP8 e4m3 / e5m2 (K), NVFP4 (data bytes + per-group scale
// bytes at scales + group_offsets[g]), per-token-head int8 / e4m3 rows (values times the row's
// inline scale, one fp32 multiply each, as the reference codec reads them), int4 rows in their
// rotated domain ((q - zp) * scale; the op rotates the query in and the output back). Per-tensor
// and per-head dequantization scales are applied by the caller.
template <CacheKind K, SourceType C, SimdLevel L>
struct EntryDecoder {
  static void decode(const uint8_t* src, const uint8_t* scales, const int64_t* group_offsets,
                     int dim, float* dst) {
    if constexpr (is_per_token_head(K)) {
      const float row_scale = per_token_head_row_scale(src, dim);
      for (int i = 0; i < dim; ++i) dst[i] = per_token_head_decode<K>(src[i]) * row_scale;
      return;
    }
    if constexpr (K == CacheKind::kInt4PerTokenHead) {  // rotated values: the op rotates q and out
      const Int4RowScale row_scale = int4_row_scale(src, dim);
      for (int i = 0; i < dim; ++i) dst[i] = int4_rotated_value(src, row_scale, i);
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

}  // namespace vllm_kv::cpu::attention
