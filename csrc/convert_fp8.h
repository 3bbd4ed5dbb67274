// Element-wise kernel of convert_fp8 (docs/design.md §6), shared by the CPU op and the CUDA kernel.
// Framework-free: the torch glue (csrc/convert_fp8_torch.cpp) validates the arguments and hands
// over contiguous buffers. Every conversion is the reference codec's sequence of fp32 operations
// (vllm/kv_quant/fp8.py): quantize fp8(float32(x) / scale), dequantize float32(q) * scale then a
// round to the output dtype, so the op writes the codec's bytes.
#pragma once

#include <cstdint>
#include <type_traits>

#include "dispatch_utils.h"
#include "kv_quant_math.h"
#if defined(__CUDA_ARCH__)
#include "cuda/kv_quant_fast.h"
#endif

namespace vllm_kv {

// What one element of a convert_fp8 buffer holds.
enum class ConvertType { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFp8E4M3 = 3, kFp8E5M2 = 4 };

inline constexpr bool is_fp8(ConvertType t) {
  return t == ConvertType::kFp8E4M3 || t == ConvertType::kFp8E5M2;
}

template <ConvertType T>
inline constexpr bool kIsFp8 = is_fp8(T);

struct ConvertFp8Params {
  const void* src;  // numel contiguous elements of src_type
  void* dst;        // numel contiguous elements of dst_type
  int64_t numel;
  // Dequantization scale (real value = FP8 value * scale): dividing by it quantizes, multiplying
  // dequantizes; a float -> float cast ignores it.
  float scale;
  ConvertType src_type;
  ConvertType dst_type;
};

// load: storage -> fp32 (exact); store: fp32 -> storage (rounded, FP8 saturating). The float
// types reuse the widening of dispatch_utils.h.
template <ConvertType T>
struct ConvertTraits;

template <>
struct ConvertTraits<ConvertType::kFloat32> : SourceTraits<SourceType::kFloat32> {
  static KV_HOST_DEVICE float store(float y) { return y; }
};

template <>
struct ConvertTraits<ConvertType::kFloat16> : SourceTraits<SourceType::kFloat16> {
  static KV_HOST_DEVICE uint16_t store(float y) { return float_to_fp16_bits(y); }
};

template <>
struct ConvertTraits<ConvertType::kBFloat16> : SourceTraits<SourceType::kBFloat16> {
  static KV_HOST_DEVICE uint16_t store(float y) { return float_to_bf16_bits(y); }
};

// On the GPU the branch-free encoders of kv_quant_fast.h, which the reshape_and_cache_flash
// kernels use too (proven byte-equal to kv_quant_math.h over all inputs).
template <>
struct ConvertTraits<ConvertType::kFp8E4M3> {
  using Storage = uint8_t;
  static KV_HOST_DEVICE float to_float(uint8_t q) {
#if defined(__CUDA_ARCH__)
    return e4m3_to_float_fast(q);
#else
    return e4m3_to_float(q);
#endif
  }
  static KV_HOST_DEVICE uint8_t store(float y) {
#if defined(__CUDA_ARCH__)
    return float_to_e4m3_satfinite_fast(y);
#else
    return float_to_e4m3_satfinite(y);
#endif
  }
};

template <>
struct ConvertTraits<ConvertType::kFp8E5M2> {
  using Storage = uint8_t;
  static KV_HOST_DEVICE float to_float(uint8_t q) { return e5m2_to_float(q); }
  static KV_HOST_DEVICE uint8_t store(float y) {
#if defined(__CUDA_ARCH__)
    return float_to_e5m2_satfinite_fast(y);
#else
    return float_to_e5m2_satfinite(y);
#endif
  }
};

// dst[i] = convert(src[i]) for i in [begin, end): FP8 -> float dequantizes, float -> FP8
// quantizes, float -> float is a plain cast. FP8 -> FP8 is not a conversion (never dispatched).
template <ConvertType kSrc, ConvertType kDst>
KV_HOST_DEVICE void convert_fp8_range(const ConvertFp8Params& p, int64_t begin, int64_t end,
                                      int64_t step = 1) {
  static_assert(!(kIsFp8<kSrc> && kIsFp8<kDst>), "FP8 -> FP8 is not a convert_fp8 conversion");
  using In = ConvertTraits<kSrc>;
  using Out = ConvertTraits<kDst>;
  const auto* src = static_cast<const typename In::Storage*>(p.src);
  auto* dst = static_cast<typename Out::Storage*>(p.dst);
  for (int64_t i = begin; i < end; i += step) {
    const float x = In::to_float(src[i]);
    if constexpr (kIsFp8<kSrc>) {
      dst[i] = Out::store(kv_fmul(x, p.scale));
    } else if constexpr (kIsFp8<kDst>) {
      dst[i] = Out::store(kv_fdiv(x, p.scale));
    } else {
      dst[i] = Out::store(x);
    }
  }
}

template <ConvertType T>
using ConvertTag = std::integral_constant<ConvertType, T>;

// Calls fn(ConvertTag<kSrc>{}, ConvertTag<kDst>{}) for the runtime pair (src, dst); FP8 -> FP8
// pairs (rejected by the validation) call nothing.
template <typename Fn>
void dispatch_convert_fp8(ConvertType src, ConvertType dst, Fn&& fn) {
  const auto with_tag = [](ConvertType t, auto&& then) {
    switch (t) {
      case ConvertType::kFloat32:
        return then(ConvertTag<ConvertType::kFloat32>{});
      case ConvertType::kFloat16:
        return then(ConvertTag<ConvertType::kFloat16>{});
      case ConvertType::kBFloat16:
        return then(ConvertTag<ConvertType::kBFloat16>{});
      case ConvertType::kFp8E4M3:
        return then(ConvertTag<ConvertType::kFp8E4M3>{});
      case ConvertType::kFp8E5M2:
        return then(ConvertTag<ConvertType::kFp8E5M2>{});
    }
  };
  with_tag(src, [&](auto src_tag) {
    with_tag(dst, [&](auto dst_tag) {
      constexpr ConvertType kSrc = std::decay_t<decltype(src_tag)>::value;
      constexpr ConvertType kDst = std::decay_t<decltype(dst_tag)>::value;
      if constexpr (!(kIsFp8<kSrc> && kIsFp8<kDst>)) fn(src_tag, dst_tag);
    });
  });
}

}  // namespace vllm_kv
