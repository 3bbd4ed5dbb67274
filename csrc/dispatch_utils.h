// kv_cache_dtype parsing and compile-time dispatch over (source dtype x cache kind), shared by the
// CPU and CUDA cache kernels. Framework-free; the torch glue turns a failed parse into a
// TORCH_CHECK error.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>

#include "cache_kernels.h"
#include "kv_quant_math.h"

namespace vllm_kv {

inline constexpr std::string_view kNvfp4DtypeString = "nvfp4";
// NVFP4 with the block-scale search (docs/design.md §5.3): the same CacheKind and bytes layout,
// only the writer's choice of each group's scale byte differs; readers treat it as nvfp4.
inline constexpr std::string_view kNvfp4MseDtypeString = "nvfp4_mse";
// NVFP4 with upstream v0.33's amax / 6 or amax / 4 block scale (docs/formats.md §6.1): likewise.
inline constexpr std::string_view kNvfp44over6DtypeString = "nvfp4_4over6";

// Every kv_cache_dtype string the cache ops accept (the parsers below), for error messages. The
// op parses the strings itself because upstream engines call it directly; the Python side of this
// table is the format registry (vllm/kv_quant/formats.py, `cache_kind`), and
// tests/kv_quant/test_formats.py keeps the two equal (docs/design.md §2.1).
inline constexpr std::string_view kKvCacheDtypeNames =
    "auto, float16, bfloat16, float32, float, fp8, fp8_e4m3, fp8_e5m2, nvfp4, nvfp4_mse, "
    "nvfp4_4over6, int8_per_token_head, fp8_per_token_head, int4_per_token_head";

// The kinds that are not an FP8 variant of the element type: routed before
// parse_fp8_kv_cache_data_type (whose kAuto / kFp8E4M3 / kFp8E5M2 is upstream's enum).
inline std::optional<CacheKind> parse_non_fp8_cache_kind(std::string_view s) {
  if (s == kNvfp4DtypeString || s == kNvfp4MseDtypeString || s == kNvfp44over6DtypeString) {
    return CacheKind::kNvfp4;
  }
  if (s == "int8_per_token_head") return CacheKind::kInt8PerTokenHead;
  if (s == "fp8_per_token_head") return CacheKind::kFp8PerTokenHead;
  if (s == "int4_per_token_head") return CacheKind::kInt4PerTokenHead;
  return std::nullopt;
}

// How the writer chooses each NVFP4 group's block scale.
inline Nvfp4ScalePolicy nvfp4_scale_policy(std::string_view s) {
  if (s == kNvfp4MseDtypeString) return Nvfp4ScalePolicy::kMse;
  if (s == kNvfp44over6DtypeString) return Nvfp4ScalePolicy::k4over6;
  return Nvfp4ScalePolicy::kNearest;
}

// docs/design.md §3: auto, float16, bfloat16, float32 / float -> kAuto (unquantized); fp8,
// fp8_e4m3 -> kFp8E4M3; fp8_e5m2 -> kFp8E5M2. Anything else (nvfp4, the per-token-head strings
// included) -> nullopt.
inline std::optional<Fp8KVCacheDataType> parse_fp8_kv_cache_data_type(std::string_view s) {
  if (s == "auto" || s == "float16" || s == "bfloat16" || s == "float32" || s == "float") {
    return Fp8KVCacheDataType::kAuto;
  }
  if (s == "fp8" || s == "fp8_e4m3") return Fp8KVCacheDataType::kFp8E4M3;
  if (s == "fp8_e5m2") return Fp8KVCacheDataType::kFp8E5M2;
  return std::nullopt;
}

// The source dtype that an explicit unquantized kv_cache_dtype string names ("auto": none).
inline std::optional<SourceType> explicit_unquantized_type(std::string_view s) {
  if (s == "float16") return SourceType::kFloat16;
  if (s == "bfloat16") return SourceType::kBFloat16;
  if (s == "float32" || s == "float") return SourceType::kFloat32;
  return std::nullopt;
}

inline constexpr CacheKind cache_kind_of(Fp8KVCacheDataType t) {
  switch (t) {
    case Fp8KVCacheDataType::kFp8E4M3:
      return CacheKind::kFp8E4M3;
    case Fp8KVCacheDataType::kFp8E5M2:
      return CacheKind::kFp8E5M2;
    case Fp8KVCacheDataType::kAuto:
      break;
  }
  return CacheKind::kUnquantized;
}

inline constexpr bool is_quantized(CacheKind kind) { return kind != CacheKind::kUnquantized; }

// Whether the kind's bytes depend on k_scale / v_scale (the per-token-head kinds compute their own
// scales, so the values passed are not read and need not be valid).
inline constexpr bool reads_kv_scale(CacheKind kind) {
  return is_quantized(kind) && kind != CacheKind::kInt8PerTokenHead &&
         kind != CacheKind::kFp8PerTokenHead && kind != CacheKind::kInt4PerTokenHead &&
         kind != kPackedSlotKind;
}

// Storage type of a float dtype (16-bit formats as raw bits), its exact widening to fp32 and the
// rounding of an fp32 back to it (nearest even, as torch's .to(); kv_quant_math.h).
template <SourceType S>
struct SourceTraits;

template <>
struct SourceTraits<SourceType::kFloat32> {
  using Storage = float;
  static KV_HOST_DEVICE float to_float(float x) { return x; }
  static KV_HOST_DEVICE float from_float(float x) { return x; }
};

template <>
struct SourceTraits<SourceType::kFloat16> {
  using Storage = uint16_t;
  static KV_HOST_DEVICE float to_float(uint16_t x) { return fp16_bits_to_float(x); }
  static KV_HOST_DEVICE uint16_t from_float(float x) { return float_to_fp16_bits(x); }
};

template <>
struct SourceTraits<SourceType::kBFloat16> {
  using Storage = uint16_t;
  static KV_HOST_DEVICE float to_float(uint16_t x) { return bf16_bits_to_float(x); }
  static KV_HOST_DEVICE uint16_t from_float(float x) { return float_to_bf16_bits(x); }
};

// One element of float type S as float type C: the exact widening, then one rounding to nearest
// even (fp16 <-> bf16 too: the fp32 in between is exact). Overflow gives ±Inf, a NaN stays a NaN.
template <SourceType S, SourceType C>
KV_HOST_DEVICE typename SourceTraits<C>::Storage cast_element(typename SourceTraits<S>::Storage x) {
  return SourceTraits<C>::from_float(SourceTraits<S>::to_float(x));
}

template <SourceType S>
using SourceTag = std::integral_constant<SourceType, S>;
template <CacheKind K>
using CacheKindTag = std::integral_constant<CacheKind, K>;

// Calls fn(SourceTag<S>{}) for the runtime float type t (the element type of an unquantized cache).
template <typename Fn>
void dispatch_source_type(SourceType t, Fn&& fn) {
  switch (t) {
    case SourceType::kFloat32:
      return fn(SourceTag<SourceType::kFloat32>{});
    case SourceType::kFloat16:
      return fn(SourceTag<SourceType::kFloat16>{});
    case SourceType::kBFloat16:
      return fn(SourceTag<SourceType::kBFloat16>{});
  }
}

// Calls fn(SourceTag<S>{}, CacheKindTag<K>{}) for the runtime pair (source, kind), instantiating
// fn for all 21 combinations. fn reads the pair back as constants:
//   dispatch_source_and_kind(p.source_type, p.cache_kind, [&](auto src, auto kind) {
//     launch<decltype(src)::value, decltype(kind)::value>(p);
//   });
template <typename Fn>
void dispatch_source_and_kind(SourceType source, CacheKind kind, Fn&& fn) {
  const auto with_kind = [&](auto source_tag) {
    switch (kind) {
      case CacheKind::kUnquantized:
        return fn(source_tag, CacheKindTag<CacheKind::kUnquantized>{});
      case CacheKind::kFp8E4M3:
        return fn(source_tag, CacheKindTag<CacheKind::kFp8E4M3>{});
      case CacheKind::kFp8E5M2:
        return fn(source_tag, CacheKindTag<CacheKind::kFp8E5M2>{});
      case CacheKind::kNvfp4:
        return fn(source_tag, CacheKindTag<CacheKind::kNvfp4>{});
      case CacheKind::kInt8PerTokenHead:
        return fn(source_tag, CacheKindTag<CacheKind::kInt8PerTokenHead>{});
      case CacheKind::kFp8PerTokenHead:
        return fn(source_tag, CacheKindTag<CacheKind::kFp8PerTokenHead>{});
      case CacheKind::kInt4PerTokenHead:
        return fn(source_tag, CacheKindTag<CacheKind::kInt4PerTokenHead>{});
    }
  };
  switch (source) {
    case SourceType::kFloat32:
      return with_kind(SourceTag<SourceType::kFloat32>{});
    case SourceType::kFloat16:
      return with_kind(SourceTag<SourceType::kFloat16>{});
    case SourceType::kBFloat16:
      return with_kind(SourceTag<SourceType::kBFloat16>{});
  }
}

}  // namespace vllm_kv
