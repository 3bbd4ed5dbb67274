// Host-side validation shared by the CPU and CUDA registrations of the cache ops.
#include "cache_ops_torch.h"

#include <ATen/Parallel.h>

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <vector>

#include "cache_ops_checks.h"
#include "dispatch_utils.h"
#include "int4_per_token_head.h"
#include "int4_rht_signs_torch.h"
#include "kv_quant_math.h"
#include "per_token_head.h"

namespace vllm_kv {

Fp8KVCacheDataType get_fp8_kv_cache_data_type(const std::string& kv_cache_dtype) {
  const std::optional<Fp8KVCacheDataType> type = parse_fp8_kv_cache_data_type(kv_cache_dtype);
  TORCH_CHECK(type.has_value(), "kv_cache_dtype: unknown KV-cache dtype '", kv_cache_dtype,
              "'; expected one of ", kKvCacheDtypeNames);
  return *type;
}

CacheKind get_cache_kind(const std::string& kv_cache_dtype) {
  if (const auto kind = parse_non_fp8_cache_kind(kv_cache_dtype)) return *kind;
  return cache_kind_of(get_fp8_kv_cache_data_type(kv_cache_dtype));
}

std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kByte:
      return "uint8";
    case at::kFloat:
      return "float32";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kLong:
      return "int64";
    case at::kInt:
      return "int32";
    case at::kChar:
      return "int8";
    case at::kDouble:
      return "float64";
    case at::kFloat8_e4m3fn:
      return "float8_e4m3fn";
    case at::kFloat8_e5m2:
      return "float8_e5m2";
    default:
      return c10::toString(t);
  }
}

std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

SourceType source_type_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return SourceType::kFloat32;
    case at::kHalf:
      return SourceType::kFloat16;
    case at::kBFloat16:
      return SourceType::kBFloat16;
    default:
      TORCH_CHECK(false, name, ": expected dtype float32, float16 or bfloat16, got ",
                  dtype_str(t.scalar_type()));
  }
}

namespace {

at::ScalarType scalar_type_of(SourceType t) {
  switch (t) {
    case SourceType::kFloat16:
      return at::kHalf;
    case SourceType::kBFloat16:
      return at::kBFloat16;
    case SourceType::kFloat32:
      break;
  }
  return at::kFloat;
}

ScaleLayout parse_scale_layout(const std::string& s, const char* name) {
  if (s == "linear") return ScaleLayout::kLinear;
  if (s == "interleave4") return ScaleLayout::kInterleave4;
  TORCH_CHECK(false, name, ": expected 'linear' or 'interleave4', got '", s, "'");
}

}  // namespace

void check_int_range(int64_t v, const char* what) {
  TORCH_CHECK(v <= INT_MAX, what, ": expected at most ", INT_MAX, ", got ", v);
}

// The cache's last dim for head size d (one home for both ops) and how to say it in errors.
int64_t cache_last_dim(CacheKind kind, int64_t d) {
  if (kind == CacheKind::kNvfp4) return d / 2 + d / kNvfp4GroupSize;
  if (is_per_token_head(kind)) return d + kPerTokenHeadScaleBytes;
  if (kind == CacheKind::kInt4PerTokenHead) return int4_row_bytes(d);
  return d;
}

namespace {

const char* cache_last_dim_formula(CacheKind kind) {
  if (kind == CacheKind::kNvfp4) return "F(D) = D/2 + D/16";
  if (is_per_token_head(kind)) return "D + 4";
  if (kind == CacheKind::kInt4PerTokenHead) return "D/2 + 4";
  return "D";
}

}  // namespace

// Element dtype of a quantized cache (unquantized caches hold the source dtype).
at::ScalarType quantized_cache_dtype(CacheKind kind) {
  return kind == CacheKind::kInt8PerTokenHead ? at::kChar : at::kByte;
}

// Head-size rules of the packed kinds: NVFP4 groups of 16; per-token-head rows whose fp32 scale
// stays 4-byte aligned (as upstream's fp32 view of the page needs: D / 2 + 4 bytes for int4, so D
// a multiple of 8, rotated in a local array of at most kInt4MaxHeadSize values). `name` is the
// argument whose last dim is the head size.
void check_head_size(CacheKind kind, const std::string& kv_cache_dtype, int64_t d,
                     const char* name) {
  if (kind == CacheKind::kInt4PerTokenHead) {
    TORCH_CHECK(d <= kInt4MaxHeadSize, name, ": ", kv_cache_dtype, " needs a head size of at most ",
                kInt4MaxHeadSize, ", got ", d);
  }
  const int64_t multiple = kind == CacheKind::kNvfp4              ? kNvfp4GroupSize
                           : is_per_token_head(kind)              ? kPerTokenHeadScaleBytes
                           : kind == CacheKind::kInt4PerTokenHead ? 2 * kInt4WordBytes
                                                                  : 1;
  TORCH_CHECK(d % multiple == 0, name, ": ", kv_cache_dtype,
              " needs a head size that is a multiple of ", multiple, ", got ", d);
}

namespace {

// key / value: [T_pad, H, D], each token's [H, D] contiguous, rows stride(0) >= H*D apart.
void check_source(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3, name, ": expected a 3-D tensor [T_pad, H, D], got shape ",
              shape_str(x));
  const int64_t heads = x.size(1);
  const int64_t dim = x.size(2);
  check_int_range(heads, name);
  check_int_range(dim, name);
  const bool row_dense = (dim <= 1 || x.stride(2) == 1) && (heads <= 1 || x.stride(1) == dim);
  const bool rows_apart = x.size(0) <= 1 || x.stride(0) >= heads * dim;
  TORCH_CHECK(row_dense && rows_apart, name,
              ": expected each token's [H, D] contiguous and tokens at least H*D = ", heads * dim,
              " elements apart (strides [>= ", heads * dim, ", ", dim, ", 1]), got strides ",
              x.strides());
}

}  // namespace

// Side of a paged cache, logical [B, N, H, last_dim]; each page's [N, H, last_dim] region must be
// dense in NHD or HND order, except that HND heads may lie further apart than N*D' (a side of
// upstream's CPU cache, whose pages interleave each head's K and V regions) for every kind but
// NVFP4, whose scale region sits after a dense data region. Size-1 dims get the canonical stride
// of the detected order.
CacheSide make_side(const at::Tensor& cache, const char* name, CacheKind kind, int64_t head_size,
                    int64_t last_dim, const at::Tensor& scale, bool scale_per_head,
                    ScaleLayout layout) {
  const int64_t num_blocks = cache.size(0);
  const int64_t block_size = cache.size(1);
  const int64_t heads = cache.size(2);
  const int64_t head_region = block_size * last_dim;
  const bool last_ok = last_dim <= 1 || cache.stride(3) == 1;
  const bool nhd = (block_size <= 1 || cache.stride(1) == heads * last_dim) &&
                   (heads <= 1 || cache.stride(2) == last_dim);
  const bool spaced_heads = kind != CacheKind::kNvfp4 && cache.stride(2) > head_region;
  const bool hnd = (block_size <= 1 || cache.stride(1) == last_dim) &&
                   (heads <= 1 || cache.stride(2) == head_region || spaced_heads);
  TORCH_CHECK(last_ok && (nhd || hnd), name,
              ": expected each page's region dense in NHD order (strides [*, H*D', D', 1] = [*, ",
              heads * last_dim, ", ", last_dim,
              ", 1]) or HND order (strides [*, D', N*D', 1] = [*, ", last_dim, ", ", head_region,
              ", 1]), got strides ", cache.strides());
  const int64_t head_stride = nhd ? last_dim : heads <= 1 ? head_region : cache.stride(2);
  const bool spaced = !nhd && head_stride != head_region;
  const int64_t page_elements =
      spaced ? (heads - 1) * head_stride + head_region : block_size * heads * last_dim;
  TORCH_CHECK(num_blocks <= 1 || cache.stride(0) >= page_elements, name,
              ": expected a page stride of at least ",
              spaced ? "(H-1)*head_stride + N*D' = " : "N*H*D' = ", page_elements,
              " elements so that pages do not overlap, got ", cache.stride(0));
  CacheSide side{};
  side.data = cache.data_ptr();
  side.block_stride = num_blocks <= 1 ? page_elements : cache.stride(0);
  side.token_stride = nhd ? heads * last_dim : last_dim;
  side.head_stride = head_stride;
  side.head_size = int(head_size);
  side.scale = scale.data_ptr<float>();
  side.scale_per_head = scale_per_head;
  side.scale_layout = layout;
  if (kind == CacheKind::kInt4PerTokenHead) {
    side.rht_signs = int4_rht_signs(int4_rht_block(int(head_size)), cache.device());
  }
  return side;
}

namespace {

// The interleave4 scale layout's divisibility needs (a no-op for linear).
void check_interleave4(ScaleLayout layout, const char* name, int64_t block_size, int64_t dim) {
  if (layout != ScaleLayout::kInterleave4) return;
  TORCH_CHECK(block_size % 4 == 0, name,
              ": interleave4 needs a block size that is a multiple of 4, got block_size ",
              block_size);
  TORCH_CHECK((dim / kNvfp4GroupSize) % 4 == 0, name,
              ": interleave4 needs head_size / 16 to be a multiple of 4, got head size ", dim);
}

}  // namespace

// The scale layouts of a call, for both ops (the one home of the rule): a named layout is parsed;
// V without a name follows a named K; a side with no name at all gets the default for its geometry
// (default_scale_layout: upstream's interleave4 where it fits). NVFP4 sides are checked against
// interleave4's divisibility needs.
std::pair<ScaleLayout, ScaleLayout> resolve_scale_layouts(const std::optional<std::string>& k_name,
                                                          const std::optional<std::string>& v_name,
                                                          CacheKind kind, int64_t block_size,
                                                          int64_t head_size, int64_t head_size_v) {
  const ScaleLayout k_layout = k_name ? parse_scale_layout(*k_name, "k_scale_layout")
                                      : default_scale_layout(block_size, head_size);
  const ScaleLayout v_layout = v_name   ? parse_scale_layout(*v_name, "v_scale_layout")
                               : k_name ? k_layout
                                        : default_scale_layout(block_size, head_size_v);
  if (kind == CacheKind::kNvfp4) {
    check_interleave4(k_layout, "k_scale_layout", block_size, head_size);
    check_interleave4(v_layout, "v_scale_layout", block_size, head_size_v);
  }
  return {k_layout, v_layout};
}

// The scale rule (one home; Python: vllm/kv_quant/kv_scale.py): a float32 tensor holding one
// value in any shape (0-d as upstream engines pass it, [1], [1, 1], ...) is per-tensor; a
// contiguous [H] is per-head. Returns whether the scale is per-head.
bool check_scale(const at::Tensor& scale, const char* name, int64_t heads) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat, name, ": expected dtype float32, got ",
              dtype_str(scale.scalar_type()));
  if (scale.numel() == 1) return false;
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == heads, name,
              ": expected one value (shape [], [1], ...) or [H] = [", heads, "], got shape ",
              shape_str(scale));
  TORCH_CHECK(scale.stride(0) == 1, name, ": expected a contiguous tensor, got stride ",
              scale.stride(0));
  return true;
}

namespace {

// Where a side's bytes lie: pages `page_stride` bytes apart, each `regions` runs of
// `region_bytes` bytes `region_stride` apart (one run when the page is dense, one per head when
// HND heads are spaced, make_side).
struct SideExtent {
  int64_t page_stride;
  int64_t regions;
  int64_t region_stride;
  int64_t region_bytes;

  explicit SideExtent(const at::Tensor& t) {
    const int64_t element = int64_t(t.element_size());
    const int64_t heads = t.size(2);
    const int64_t head_region = t.size(1) * t.size(3);
    const bool spaced = heads > 1 && t.stride(2) > head_region && t.stride(1) == t.size(3);
    regions = spaced ? heads : 1;
    region_bytes = (spaced ? head_region : heads * head_region) * element;
    region_stride = spaced ? t.stride(2) * element : region_bytes;
    const int64_t page_bytes = (regions - 1) * region_stride + region_bytes;
    page_stride = t.size(0) <= 1 ? page_bytes : t.stride(0) * element;
  }

  bool operator==(const SideExtent& o) const {
    return page_stride == o.page_stride && regions == o.regions &&
           region_stride == o.region_stride && region_bytes == o.region_bytes;
  }
};

// Pages (b of key_cache, b' of value_cache) that share a byte, if any. Exact when both sides have
// the same extent (one buffer split into K and V, as upstream's kv_cache[:, 0] / kv_cache[:, 1]
// or its CPU cache's per-head K and V halves, or two buffers); otherwise only the same start
// address is found.
std::optional<std::pair<int64_t, int64_t>> overlapping_pages(const at::Tensor& key_cache,
                                                             const at::Tensor& value_cache) {
  if (key_cache.numel() == 0 || value_cache.numel() == 0) return std::nullopt;
  // value_cache's start minus key_cache's, in bytes.
  const int64_t d = int64_t(reinterpret_cast<intptr_t>(value_cache.data_ptr()) -
                            reinterpret_cast<intptr_t>(key_cache.data_ptr()));
  if (d == 0) return std::pair<int64_t, int64_t>{0, 0};
  const SideExtent k(key_cache);
  const SideExtent v(value_cache);
  const int64_t blocks = key_cache.size(0);
  if (!(k == v) && blocks > 1) return std::nullopt;
  const int64_t stride = k.page_stride;
  // Region h of page b of K and region h + j of page b' of V overlap iff m = b - b' has
  // m * stride in (e - Rk, e + Rv), e = d + j * region_stride.
  for (int64_t j = 1 - k.regions; j < k.regions; ++j) {
    const int64_t e = d + j * k.region_stride;
    const int64_t low = e - k.region_bytes;
    int64_t m = low / stride;
    if (low % stride != 0 && low < 0) --m;  // floor
    m = std::max<int64_t>(m + 1, 1 - blocks);
    if (m > blocks - 1 || m * stride >= e + v.region_bytes) continue;
    const int64_t value_page = std::max<int64_t>(0, -m);
    return std::pair<int64_t, int64_t>{value_page + m, value_page};
  }
  return std::nullopt;
}

}  // namespace

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& key_cache) {
  TORCH_CHECK(t.device() == key_cache.device(), name, ": expected device ", key_cache.device(),
              " (key_cache's device), got ", t.device());
}

namespace {

// The optional key sink rows of reshape_and_cache_flash (docs/design.md §6): both given or
// neither; key_sinks uint8 [num_blocks, S, H, D] with 1 <= S <= block_size and a contiguous last
// dim (any other strides), key_sink_scale by the scale rule. Devices are checked with the others.
KeySinkRows make_key_sinks(const std::optional<at::Tensor>& key_sinks,
                           const std::optional<at::Tensor>& key_sink_scale, int64_t num_blocks,
                           int64_t block_size, int64_t heads, int64_t head_size) {
  TORCH_CHECK(key_sinks.has_value() == key_sink_scale.has_value(),
              key_sinks ? "key_sink_scale" : "key_sinks", ": expected a tensor with ",
              key_sinks ? "key_sinks" : "key_sink_scale", " (both or neither), got None");
  KeySinkRows rows{};
  if (!key_sinks) return rows;
  const at::Tensor& t = *key_sinks;
  TORCH_CHECK(t.scalar_type() == at::kByte, "key_sinks: expected dtype uint8, got ",
              dtype_str(t.scalar_type()));
  TORCH_CHECK(t.dim() == 4 && t.size(0) == num_blocks && t.size(1) >= 1 &&
                  t.size(1) <= block_size && t.size(2) == heads && t.size(3) == head_size,
              "key_sinks: expected shape [num_blocks, S, H, D] = [", num_blocks, ", S, ", heads,
              ", ", head_size, "] with 1 <= S <= block_size = ", block_size, ", got shape ",
              shape_str(t));
  TORCH_CHECK(head_size <= 1 || t.stride(3) == 1,
              "key_sinks: expected a contiguous last dim (stride 1), got strides ", t.strides());
  rows.data = static_cast<uint8_t*>(t.data_ptr());
  rows.block_stride = t.stride(0);
  rows.token_stride = t.stride(1);
  rows.head_stride = t.stride(2);
  rows.rows = int(t.size(1));
  rows.scale_per_head = check_scale(*key_sink_scale, "key_sink_scale", heads);
  rows.scale = key_sink_scale->data_ptr<float>();
  return rows;
}

}  // namespace

ReshapeAndCacheParams prepare_reshape_and_cache_flash(
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const std::string& kv_cache_dtype, const at::Tensor& k_scale, const at::Tensor& v_scale,
    const std::optional<std::string>& k_scale_layout,
    const std::optional<std::string>& v_scale_layout, const std::optional<at::Tensor>& key_sinks,
    const std::optional<at::Tensor>& key_sink_scale) {
  const CacheKind kind = get_cache_kind(kv_cache_dtype);

  check_same_device(key, "key", key_cache);
  check_same_device(value, "value", key_cache);
  check_same_device(value_cache, "value_cache", key_cache);
  check_same_device(slot_mapping, "slot_mapping", key_cache);
  check_same_device(k_scale, "k_scale", key_cache);
  check_same_device(v_scale, "v_scale", key_cache);
  if (key_sinks) check_same_device(*key_sinks, "key_sinks", key_cache);
  if (key_sink_scale) check_same_device(*key_sink_scale, "key_sink_scale", key_cache);

  check_source(key, "key");
  check_source(value, "value");
  const SourceType source = source_type_of(key, "key");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "value: expected dtype ",
              dtype_str(key.scalar_type()), " (key's dtype), got ", dtype_str(value.scalar_type()));
  const int64_t tokens_padded = key.size(0);
  const int64_t heads = key.size(1);
  const int64_t head_size = key.size(2);
  const int64_t head_size_v = value.size(2);
  TORCH_CHECK(value.size(0) == tokens_padded,
              "value: expected T_pad = key.size(0) = ", tokens_padded, " tokens, got ",
              value.size(0));
  TORCH_CHECK(value.size(1) == heads, "value: expected H = key.size(1) = ", heads, " heads, got ",
              value.size(1));

  // The dtype rule (docs/design.md §6; Python twin: check_kv_dtypes in vllm/_custom_ops.py): key
  // and value share one float dtype; an unquantized cache holds the float dtype its string names
  // ("auto": any, key_cache's) whatever the key's, the kernels casting each element.
  at::ScalarType cache_dtype = quantized_cache_dtype(kind);
  SourceType cache_type = source;
  std::string cache_dtype_reason = "for kv_cache_dtype '" + kv_cache_dtype + "'";
  if (kind == CacheKind::kUnquantized) {
    if (const std::optional<SourceType> named = explicit_unquantized_type(kv_cache_dtype)) {
      cache_type = *named;
      cache_dtype = scalar_type_of(*named);
      TORCH_CHECK(key_cache.scalar_type() == cache_dtype, "key_cache: expected dtype ",
                  dtype_str(cache_dtype), " for kv_cache_dtype '", kv_cache_dtype, "', got ",
                  dtype_str(key_cache.scalar_type()));
    } else {
      const at::ScalarType t = key_cache.scalar_type();
      TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16,
                  "key_cache: expected dtype float32, float16 or bfloat16 for kv_cache_dtype '",
                  kv_cache_dtype, "', got ", dtype_str(t));
      cache_type = source_type_of(key_cache, "key_cache");
      cache_dtype = t;
      cache_dtype_reason = "(key_cache's dtype)";
    }
  } else {
    check_head_size(kind, kv_cache_dtype, head_size, "key");
    check_head_size(kind, kv_cache_dtype, head_size_v, "value");
  }
  const char* last_dim_formula = cache_last_dim_formula(kind);

  for (const auto& [cache, name, dim, source_name] :
       {std::tuple{&key_cache, "key_cache", head_size, "key"},
        std::tuple{&value_cache, "value_cache", head_size_v, "value"}}) {
    TORCH_CHECK(cache->scalar_type() == cache_dtype, name, ": expected dtype ",
                dtype_str(cache_dtype), " ", cache_dtype_reason, ", got ",
                dtype_str(cache->scalar_type()));
    TORCH_CHECK(cache->dim() == 4, name,
                ": expected a 4-D tensor [num_blocks, block_size, num_heads, head_dim], got shape ",
                shape_str(*cache));
    TORCH_CHECK(cache->size(2) == heads, name, ": expected num_heads = key.size(1) = ", heads,
                " at dim 2, got shape ", shape_str(*cache));
    TORCH_CHECK(cache->size(3) == cache_last_dim(kind, dim), name, ": expected last dim ",
                last_dim_formula, " = ", cache_last_dim(kind, dim), " for ", source_name,
                " head size D = ", dim, " and kv_cache_dtype '", kv_cache_dtype, "', got ",
                cache->size(3));
  }
  TORCH_CHECK(value_cache.size(0) == key_cache.size(0) && value_cache.size(1) == key_cache.size(1),
              "value_cache: expected [num_blocks, block_size] = [", key_cache.size(0), ", ",
              key_cache.size(1), "] (key_cache's), got shape ", shape_str(value_cache));
  const int64_t num_blocks = key_cache.size(0);
  const int64_t block_size = key_cache.size(1);
  check_int_range(block_size, "key_cache block_size");

  const auto [k_layout, v_layout] = resolve_scale_layouts(k_scale_layout, v_scale_layout, kind,
                                                          block_size, head_size, head_size_v);

  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping: expected dtype int64, got ",
              dtype_str(slot_mapping.scalar_type()));
  TORCH_CHECK(slot_mapping.dim() == 1, "slot_mapping: expected a 1-D tensor [T], got shape ",
              shape_str(slot_mapping));
  TORCH_CHECK(slot_mapping.size(0) <= 1 || slot_mapping.stride(0) == 1,
              "slot_mapping: expected a contiguous tensor, got stride ", slot_mapping.stride(0));
  TORCH_CHECK(slot_mapping.size(0) <= tokens_padded,
              "slot_mapping: expected at most T_pad = key.size(0) = ", tokens_padded,
              " entries, got ", slot_mapping.size(0));
  const bool k_per_head = check_scale(k_scale, "k_scale", heads);
  const bool v_per_head = check_scale(v_scale, "v_scale", heads);
  TORCH_CHECK(kind != CacheKind::kInt4PerTokenHead || !key_sinks,
              "key_sinks: expected none for kv_cache_dtype '", kv_cache_dtype,
              "' (its keys are stored rotated), got a tensor");
  const KeySinkRows sink_rows =
      make_key_sinks(key_sinks, key_sink_scale, num_blocks, block_size, heads, head_size);

  ReshapeAndCacheParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_token_stride = key.stride(0);
  p.value_token_stride = value.stride(0);
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.num_tokens = slot_mapping.size(0);
  p.num_blocks = num_blocks;
  p.block_size = int(block_size);
  p.num_heads = int(heads);
  p.source_type = source;
  p.cache_type = cache_type;
  p.cache_kind = kind;
  p.nvfp4_scale_policy = nvfp4_scale_policy(kv_cache_dtype);
  p.key_cache = make_side(key_cache, "key_cache", kind, head_size, cache_last_dim(kind, head_size),
                          k_scale, k_per_head, k_layout);
  p.value_cache = make_side(value_cache, "value_cache", kind, head_size_v,
                            cache_last_dim(kind, head_size_v), v_scale, v_per_head, v_layout);
  p.key_sinks = sink_rows;
  if (const auto pages = overlapping_pages(key_cache, value_cache)) {
    TORCH_CHECK(false,
                "value_cache: expected a different tensor from key_cache, got the same bytes "
                "(value_cache page ",
                pages->second, " overlaps key_cache page ", pages->first, ")");
  }
  return p;
}

void check_swap_blocks_args(const at::Tensor& src, const at::Tensor& dst,
                            int64_t block_size_in_bytes, const at::Tensor& block_mapping) {
  TORCH_CHECK(block_size_in_bytes > 0, "block_size_in_bytes: expected a positive size, got ",
              block_size_in_bytes);
  TORCH_CHECK(block_mapping.device().is_cpu(), "block_mapping: expected a CPU tensor, got device ",
              block_mapping.device());
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong, "block_mapping: expected dtype int64, got ",
              dtype_str(block_mapping.scalar_type()));
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2,
              "block_mapping: expected shape [n, 2] of (src page, dst page), got ",
              shape_str(block_mapping));
  TORCH_CHECK(!(src.is_cuda() && dst.is_cuda()) || src.device() == dst.device(),
              "dst: expected the same CUDA device as src (", src.device(), "), got ", dst.device());
  // Pages that lie within the tensor's own bytes (from data_ptr to its last element), so that a
  // view into a shared buffer cannot reach the pages of its neighbours.
  const auto pages_of = [&](const at::Tensor& t) -> int64_t {
    if (t.numel() == 0) return 0;
    int64_t last_element = 0;
    for (const int64_t d : c10::irange(t.dim())) last_element += (t.size(d) - 1) * t.stride(d);
    return (last_element + 1) * int64_t(t.element_size()) / block_size_in_bytes;
  };
  const int64_t src_pages = pages_of(src);
  const int64_t dst_pages = pages_of(dst);
  const auto mapping = block_mapping.accessor<int64_t, 2>();
  for (const int64_t i : c10::irange(block_mapping.size(0))) {
    for (const auto& [column, name, pages] :
         {std::tuple{0, "src", src_pages}, std::tuple{1, "dst", dst_pages}}) {
      const int64_t page = mapping[i][column];
      TORCH_CHECK(page >= 0 && page < pages, "block_mapping: expected ", name, " page ids in [0, ",
                  pages, ") (", name, " holds ", pages, " pages of ", block_size_in_bytes,
                  " bytes within its extent), got block_mapping[", i, "][", column, "] = ", page);
    }
  }
}

void check_swap_blocks_batch_args(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                                  const at::Tensor& sizes) {
  for (const auto& [t, name] : {std::pair{&src_ptrs, "src_ptrs"}, std::pair{&dst_ptrs, "dst_ptrs"},
                                std::pair{&sizes, "sizes"}}) {
    TORCH_CHECK(t->device().is_cpu(), name, ": expected a CPU tensor, got device ", t->device());
    TORCH_CHECK(t->scalar_type() == at::kLong, name, ": expected dtype int64, got ",
                dtype_str(t->scalar_type()));
    TORCH_CHECK(t->dim() == 1, name, ": expected a 1-D tensor, got shape ", shape_str(*t));
    TORCH_CHECK(t->is_contiguous(), name, ": expected a contiguous tensor, got strides ",
                t->strides());
  }
  const int64_t n = src_ptrs.size(0);
  TORCH_CHECK(dst_ptrs.size(0) == n, "dst_ptrs: expected ", n,
              " addresses (one per src_ptrs entry), got ", dst_ptrs.size(0));
  TORCH_CHECK(sizes.size(0) == n, "sizes: expected ", n,
              " byte counts (one per src_ptrs entry), got ", sizes.size(0));
  const int64_t* src = src_ptrs.data_ptr<int64_t>();
  const int64_t* dst = dst_ptrs.data_ptr<int64_t>();
  const int64_t* size = sizes.data_ptr<int64_t>();
  for (const int64_t i : c10::irange(n)) {
    TORCH_CHECK(size[i] >= 0, "sizes: expected byte counts >= 0, got sizes[", i, "] = ", size[i]);
    TORCH_CHECK(size[i] == 0 || (src[i] != 0 && dst[i] != 0),
                "src_ptrs / dst_ptrs: expected nonzero addresses for a copy of ", size[i],
                " bytes, got src_ptrs[", i, "] = ", src[i], " and dst_ptrs[", i, "] = ", dst[i]);
  }
}

void swap_blocks_batch_on_host(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                               const at::Tensor& sizes) {
  const int64_t* src = src_ptrs.data_ptr<int64_t>();
  const int64_t* dst = dst_ptrs.data_ptr<int64_t>();
  const int64_t* size = sizes.data_ptr<int64_t>();
  // Descriptors are usually whole pages (tens of KiB): a few per task keeps threads busy.
  at::parallel_for(0, src_ptrs.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memmove(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]),
                   static_cast<size_t>(size[i]));
    }
  });
}

}  // namespace vllm_kv
