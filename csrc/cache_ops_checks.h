// Argument checks shared by the cache ops' torch glue (cache_ops_torch.cpp, which defines them,
// and attention_ops_torch.cpp): each is a TORCH_CHECK whose message names the argument, the
// expected and the actual value. Internal to the glue; kernels never include it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "cache_kernels.h"

namespace vllm_kv {

// A tensor's shape for messages, e.g. "[2, 16, 8, 72]".
std::string shape_str(const at::Tensor& t);

// The float type of `t` (fp32, fp16, bf16); anything else fails naming `name`.
SourceType source_type_of(const at::Tensor& t, const char* name);

// `v` fits an int; `what` names it in the message.
void check_int_range(int64_t v, const char* what);

// The cache's last dim for head size d: D, F(D) = D/2 + D/16 for NVFP4, D + 4 per token and head.
int64_t cache_last_dim(CacheKind kind, int64_t d);

// Element dtype of a quantized cache (unquantized caches hold the source dtype).
at::ScalarType quantized_cache_dtype(CacheKind kind);

// Head-size rules of the packed kinds (NVFP4 groups of 16, per-token-head rows of multiples of
// 4); `name` is the argument whose last dim is the head size.
void check_head_size(CacheKind kind, const std::string& kv_cache_dtype, int64_t d,
                     const char* name);

// One side of a paged cache, logical [B, N, H, last_dim], each page's region dense in NHD or HND
// order (HND heads of a non-NVFP4 kind may be spaced further apart).
CacheSide make_side(const at::Tensor& cache, const char* name, CacheKind kind, int64_t head_size,
                    int64_t last_dim, const at::Tensor& scale, bool scale_per_head,
                    ScaleLayout layout);

// The (K, V) scale layouts of a call: named ones parsed, an unnamed V following a named K, the
// geometry's default otherwise; NVFP4 sides checked against interleave4's needs.
std::pair<ScaleLayout, ScaleLayout> resolve_scale_layouts(const std::optional<std::string>& k_name,
                                                          const std::optional<std::string>& v_name,
                                                          CacheKind kind, int64_t block_size,
                                                          int64_t head_size, int64_t head_size_v);

// The scale rule: fp32 with one value in any shape (per tensor) or a contiguous [H] (per head).
// Returns whether the scale is per head.
bool check_scale(const at::Tensor& scale, const char* name, int64_t heads);

// `t` is on key_cache's device.
void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& key_cache);

}  // namespace vllm_kv
