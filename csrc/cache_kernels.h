// Framework-free interface of the cache kernels: enums, the parameter block that the torch glue
// fills after validation, and the kernel entry points. Included by C++ and CUDA sources alike.
#pragma once

#include <cstdint>

#include "key_sink_rows.h"
#include "nvfp4_scale_policy.h"

namespace vllm_kv {

// Cache element kind selected by the kv_cache_dtype string (docs/design.md §3). NVFP4 is routed
// before this enum is consulted.
enum class Fp8KVCacheDataType { kAuto = 0, kFp8E4M3 = 1, kFp8E5M2 = 2 };

// Element type of key/value.
enum class SourceType { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// What one cache element holds. The per-token-head kinds store rows of head_size one-byte values
// followed by their own fp32 scale (docs/design.md §5.4); they ignore k_scale / v_scale.
enum class CacheKind {
  kUnquantized = 0,
  kFp8E4M3 = 1,
  kFp8E5M2 = 2,
  kNvfp4 = 3,
  kInt8PerTokenHead = 4,
  kFp8PerTokenHead = 5,
  kInt4PerTokenHead = 6
};

// The kind paged attention gives packed K+V slot caches (TurboQuant, ultraquant_4bit, Octave): a
// value past the enumerators above, which mirror the registry's row encodings (Python's
// CacheKind), since a slot is no row of one side. No writer takes it (the slot stores are their
// own ops) and get_cache_kind never returns it.
inline constexpr CacheKind kPackedSlotKind{7};

// Placement of NVFP4 block scales inside each head's [block_size, head_size / 16] plane.
enum class ScaleLayout { kLinear = 0, kInterleave4 = 1 };

// The layout used when the caller names none (Python twin: ScaleLayout.default_for in
// vllm/kv_quant/scale_layout.py): upstream vLLM always writes the 4x4-swizzled (interleave4)
// order, so that is the default wherever it fits (block_size % 4 == 0 and head_size / 16 a
// multiple of 4, i.e. head_size % 64 == 0); geometries upstream cannot write fall back to linear.
inline ScaleLayout default_scale_layout(int64_t block_size, int64_t head_size) {
  const bool fits = block_size > 0 && block_size % 4 == 0 && head_size > 0 && head_size % 64 == 0;
  return fits ? ScaleLayout::kInterleave4 : ScaleLayout::kLinear;
}

// One side (K or V) of a paged cache, logical [num_blocks, block_size, num_heads, last_dim].
// Strides are in elements of the cache dtype (bytes for the quantized kinds); NHD and HND caches
// differ only in token_stride / head_stride. For NVFP4, last_dim = head_size / 2 + head_size / 16
// and each page holds [data | scales] as in docs/design.md §5; for the per-token-head kinds,
// last_dim = head_size + 4 (the row's values, then its fp32 scale); for int4_per_token_head,
// last_dim = head_size / 2 + 4 (int4_per_token_head.h).
struct CacheSide {
  void* data;
  int64_t block_stride;
  int64_t token_stride;
  int64_t head_stride;
  int head_size;       // elements of the source head (D or Dv)
  const float* scale;  // FP8 / NVFP4 dequantization scale, fp32, [1] or [num_heads]
  bool scale_per_head;
  ScaleLayout scale_layout;  // NVFP4 only
  // int4_per_token_head only: the rotation's ±1 signs, fp32 [largest power of 2 dividing D].
  const float* rht_signs;
};

struct ReshapeAndCacheParams {
  const void* key;    // [num_tokens_padded, num_heads, head_size], each token's [H, D]
  const void* value;  // contiguous; rows key_token_stride elements apart
  int64_t key_token_stride;
  int64_t value_token_stride;
  const int64_t* slot_mapping;  // [num_tokens]; slot < 0 skips the token
  int64_t num_tokens;
  int64_t num_blocks;
  int block_size;
  int num_heads;
  SourceType source_type;  // key and value
  // Element type of both sides of an unquantized cache: any float type, whatever source_type is
  // (the kernels cast each element, rounding to nearest even as torch's .to() does; docs/design.md
  // §6). Quantized kinds ignore it.
  SourceType cache_type;
  CacheKind cache_kind;
  // kNvfp4 only: how each group's block scale is chosen (kv_cache_dtype nvfp4, nvfp4_mse or
  // nvfp4_4over6); readers need not know.
  Nvfp4ScalePolicy nvfp4_scale_policy;
  CacheSide key_cache;
  CacheSide value_cache;
  // The first key_sinks.rows keys of every page again in FP8 e4m3 (docs/design.md §6); rows == 0:
  // none. Written with the K rows, whatever cache_kind is.
  KeySinkRows key_sinks;
};

}  // namespace vllm_kv
