// Host-side validation and buffer handling of convert_fp8, shared by the CPU and CUDA
// registrations (docs/design.md §6). The element-wise kernel is csrc/convert_fp8.h.
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cfloat>
#include <cmath>
#include <optional>
#include <string>
#include <utility>

#include "cache_ops_torch.h"
#include "dispatch_utils.h"

namespace vllm_kv {
namespace {

std::optional<ConvertType> float_type_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ConvertType::kFloat32;
    case at::kHalf:
      return ConvertType::kFloat16;
    case at::kBFloat16:
      return ConvertType::kBFloat16;
    default:
      return std::nullopt;
  }
}

// FP8 bytes of `variant` are held as uint8 (as caches hold them) or as that variant's float8
// dtype (upstream's opcheck passes a float8_e4m3fn tensor).
bool holds_fp8_bytes(at::ScalarType t, ConvertType variant) {
  const at::ScalarType float8 =
      variant == ConvertType::kFp8E4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
  return t == at::kByte || t == float8;
}

// kv_cache_dtype -> the FP8 variant, or nullopt for "auto" (a plain float -> float cast). Only
// upstream's names (+ fp8_e5m2): convert_fp8 has no NVFP4 mode, and an explicit float dtype
// string would only restate the tensors' dtypes.
std::optional<ConvertType> parse_convert_dtype(const std::string& kv_cache_dtype) {
  const std::optional<Fp8KVCacheDataType> type = parse_fp8_kv_cache_data_type(kv_cache_dtype);
  const bool known = type && (*type != Fp8KVCacheDataType::kAuto || kv_cache_dtype == "auto");
  TORCH_CHECK(known, "kv_cache_dtype: expected one of auto, fp8, fp8_e4m3, fp8_e5m2, got '",
              kv_cache_dtype, "'");
  if (*type == Fp8KVCacheDataType::kAuto) return std::nullopt;
  return *type == Fp8KVCacheDataType::kFp8E4M3 ? ConvertType::kFp8E4M3 : ConvertType::kFp8E5M2;
}

constexpr const char* kFloatDtypes = "float32, float16 or bfloat16";

// The (src, dst) element types, which decide the direction: FP8 bytes -> float dequantizes,
// float -> FP8 bytes quantizes; "auto" casts float -> float.
std::pair<ConvertType, ConvertType> convert_types(const at::Tensor& dst_cache,
                                                  const at::Tensor& src_cache,
                                                  const std::string& kv_cache_dtype) {
  const std::optional<ConvertType> variant = parse_convert_dtype(kv_cache_dtype);
  const at::ScalarType src = src_cache.scalar_type();
  const at::ScalarType dst = dst_cache.scalar_type();
  const std::optional<ConvertType> src_float = float_type_of(src);
  const std::optional<ConvertType> dst_float = float_type_of(dst);
  if (!variant) {
    TORCH_CHECK(src_float, "src_cache: expected dtype ", kFloatDtypes,
                " for kv_cache_dtype 'auto' (a plain cast), got ", dtype_str(src));
    TORCH_CHECK(dst_float, "dst_cache: expected dtype ", kFloatDtypes,
                " for kv_cache_dtype 'auto' (a plain cast), got ", dtype_str(dst));
    return {*src_float, *dst_float};
  }
  const std::string fp8_dtypes =
      std::string("uint8 or ") +
      (*variant == ConvertType::kFp8E4M3 ? "float8_e4m3fn" : "float8_e5m2");
  if (src_float) {
    TORCH_CHECK(holds_fp8_bytes(dst, *variant), "dst_cache: expected dtype ", fp8_dtypes,
                " (the FP8 bytes that src_cache's ", dtype_str(src),
                " values are quantized to for kv_cache_dtype '", kv_cache_dtype, "'), got ",
                dtype_str(dst));
    return {*src_float, *variant};
  }
  TORCH_CHECK(holds_fp8_bytes(src, *variant), "src_cache: expected dtype ", kFloatDtypes,
              " (to quantize) or ", fp8_dtypes, " (to dequantize) for kv_cache_dtype '",
              kv_cache_dtype, "', got ", dtype_str(src));
  TORCH_CHECK(dst_float, "dst_cache: expected dtype ", kFloatDtypes,
              " (src_cache holds FP8 bytes to dequantize), got ", dtype_str(dst));
  return {*variant, *dst_float};
}

// The fp32 scale both directions use (the codec's torch.tensor(scale, dtype=float32)); quantizing
// divides by it, so it must be finite and > 0 in fp32, not only as the double the schema passes.
float check_convert_scale(double scale) {
  const bool in_range = std::isfinite(scale) && scale > 0.0 && scale <= double(FLT_MAX);
  const float scale_f = in_range ? float(scale) : 0.0f;
  TORCH_CHECK(scale_f > 0.0f, "scale: expected a finite value > 0 that float32 holds, got ", scale);
  return scale_f;
}

// Whether two non-empty tensors may share a byte. at::get_overlap_status answers exactly for
// dense layouts only; otherwise the spans from the first to the last byte are compared, which
// refuses interleaved views of one buffer too.
bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  const at::MemOverlapStatus status = at::get_overlap_status(a, b);
  if (status != at::MemOverlapStatus::TooHard) return status != at::MemOverlapStatus::No;
  const auto span = [](const at::Tensor& t) {
    const auto* first = static_cast<const char*>(t.data_ptr());
    int64_t last_element = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last_element += (t.size(d) - 1) * t.stride(d);
    return std::pair{first, first + (last_element + 1) * int64_t(t.element_size())};
  };
  const auto [a_begin, a_end] = span(a);
  const auto [b_begin, b_end] = span(b);
  return a_begin < b_end && b_begin < a_end;
}

}  // namespace

void run_convert_fp8(at::Tensor& dst_cache, const at::Tensor& src_cache, double scale,
                     const std::string& kv_cache_dtype,
                     const std::function<void(const ConvertFp8Params&)>& convert) {
  TORCH_CHECK(src_cache.device() == dst_cache.device(), "src_cache: expected device ",
              dst_cache.device(), " (dst_cache's device), got ", src_cache.device());
  const auto [src_type, dst_type] = convert_types(dst_cache, src_cache, kv_cache_dtype);
  TORCH_CHECK(dst_cache.sizes() == src_cache.sizes(), "dst_cache: expected src_cache's shape ",
              src_cache.sizes(), ", got ", dst_cache.sizes());
  // A plain cast ignores the scale, as unquantized caches do (docs/design.md §5.1).
  const float scale_f = is_fp8(src_type) || is_fp8(dst_type) ? check_convert_scale(scale) : 1.0f;
  if (src_cache.numel() == 0) return;
  TORCH_CHECK(at::has_internal_overlap(dst_cache) != at::MemOverlap::Yes,
              "dst_cache: expected every element at its own address, got strides ",
              dst_cache.strides(), " for shape ", dst_cache.sizes());
  // With different element sizes even an exact alias would read bytes already overwritten.
  TORCH_CHECK(!may_overlap(dst_cache, src_cache),
              "dst_cache: expected memory apart from src_cache's, got bytes that overlap (or may)");

  const at::Tensor src = src_cache.contiguous();
  at::Tensor dst = dst_cache.is_contiguous() ? dst_cache : dst_cache.new_empty(dst_cache.sizes());
  ConvertFp8Params p{};
  p.src = src.data_ptr();
  p.dst = dst.data_ptr();
  p.numel = src.numel();
  p.scale = scale_f;
  p.src_type = src_type;
  p.dst_type = dst_type;
  convert(p);
  if (!dst.is_same(dst_cache)) dst_cache.copy_(dst);
}

}  // namespace vllm_kv
