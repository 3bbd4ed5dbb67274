// Host-side validation of paged_attention's arguments (the CPU registration's; the checks it
// shares with the cache writers are cache_ops_checks.h's).
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "cache_ops_checks.h"
#include "cache_ops_torch.h"
#include "dispatch_utils.h"

namespace vllm_kv {

namespace {

// A tensor of paged attention's pre-RoPE key transform: fp32, `dims`-D, contiguous.
void check_key_tensor(const at::Tensor& t, const char* name, int64_t dims, const char* shape_doc) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, ": expected dtype float32, got ",
              dtype_str(t.scalar_type()));
  TORCH_CHECK(t.dim() == dims, name, ": expected a ", dims, "-D tensor ", shape_doc, ", got shape ",
              shape_str(t));
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor, got strides ", t.strides());
}

// Shapes of paged attention's optional rope_cos_sin, key_offset and sink_keys (devices are
// checked with the other arguments'). Their values are not read.
void check_key_transform(const std::optional<at::Tensor>& rope_cos_sin,
                         const std::optional<at::Tensor>& key_offset,
                         const std::optional<at::Tensor>& sink_keys, int64_t num_seqs,
                         int64_t kv_heads, int64_t head_size) {
  if (rope_cos_sin) {
    check_key_tensor(*rope_cos_sin, "rope_cos_sin", 2, "[max_positions, rotary_dim]");
    const int64_t rotary_dim = rope_cos_sin->size(1);
    TORCH_CHECK(rotary_dim >= 2 && rotary_dim % 2 == 0 && rotary_dim <= head_size,
                "rope_cos_sin: expected an even rotary_dim in [2, head_size = ", head_size,
                "] at dim 1, got shape ", shape_str(*rope_cos_sin));
    check_int_range(rope_cos_sin->size(0), "rope_cos_sin max_positions");
  }
  if (key_offset) {
    check_key_tensor(*key_offset, "key_offset", 2, "[num_kv_heads, head_size]");
    TORCH_CHECK(key_offset->size(0) == kv_heads && key_offset->size(1) == head_size,
                "key_offset: expected shape [num_kv_heads, head_size] = [", kv_heads, ", ",
                head_size, "], got ", shape_str(*key_offset));
  }
  if (sink_keys) {
    check_key_tensor(*sink_keys, "sink_keys", 4, "[num_seqs, S, num_kv_heads, head_size]");
    TORCH_CHECK(sink_keys->size(0) == num_seqs && sink_keys->size(1) >= 1 &&
                    sink_keys->size(2) == kv_heads && sink_keys->size(3) == head_size,
                "sink_keys: expected shape [num_seqs, S >= 1, num_kv_heads, head_size] = [",
                num_seqs, ", S, ", kv_heads, ", ", head_size, "], got ", shape_str(*sink_keys));
    check_int_range(sink_keys->size(1), "sink_keys S");
  }
}

}  // namespace

PagedAttentionParams prepare_paged_attention(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, const std::string& kv_cache_dtype, const at::Tensor& k_scale,
    const at::Tensor& v_scale, double scale, int64_t sliding_window, double logits_soft_cap,
    const std::optional<at::Tensor>& sinks, bool causal,
    const std::optional<std::string>& k_scale_layout,
    const std::optional<std::string>& v_scale_layout, const std::optional<at::Tensor>& rope_cos_sin,
    bool rope_is_neox, const std::optional<at::Tensor>& key_offset,
    const std::optional<at::Tensor>& sink_keys, bool key_hadamard,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& seq_causal,
    bool key_split, const PackedSlotFormat* packed) {
  // A packed cache is one tensor for both sides: errors name it as its op does.
  const char* const k_name = packed != nullptr ? "kv_cache" : "key_cache";
  const char* const v_name = packed != nullptr ? "kv_cache" : "value_cache";
  const CacheKind kind = packed != nullptr ? kPackedSlotKind : get_cache_kind(kv_cache_dtype);
  for (const auto& [t, name] :
       {std::pair{&out, "out"}, std::pair{&query, "query"}, std::pair{&value_cache, v_name},
        std::pair{&block_table, "block_table"}, std::pair{&seq_lens, "seq_lens"},
        std::pair{&query_start_loc, "query_start_loc"}, std::pair{&k_scale, "k_scale"},
        std::pair{&v_scale, "v_scale"}}) {
    check_same_device(*t, name, key_cache);
  }
  for (const auto& [t, name] :
       {std::pair{&sinks, "sinks"}, std::pair{&rope_cos_sin, "rope_cos_sin"},
        std::pair{&key_offset, "key_offset"}, std::pair{&sink_keys, "sink_keys"},
        std::pair{&alibi_slopes, "alibi_slopes"}, std::pair{&seq_causal, "seq_causal"}}) {
    if (*t) check_same_device(**t, name, key_cache);
  }

  TORCH_CHECK(query.dim() == 3,
              "query: expected a 3-D tensor [T, num_heads, head_size], got shape ",
              shape_str(query));
  TORCH_CHECK(out.dim() == 3, "out: expected a 3-D tensor [T, num_heads, head_size_v], got shape ",
              shape_str(out));
  const SourceType io_type = source_type_of(query, "query");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out: expected dtype ",
              dtype_str(query.scalar_type()), " (query's), got ", dtype_str(out.scalar_type()));
  const int64_t heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t head_size_v = out.size(2);
  TORCH_CHECK(out.size(1) == heads, "out: expected num_heads = query.size(1) = ", heads,
              " at dim 1, got shape ", shape_str(out));
  TORCH_CHECK(head_size > 0 && head_size_v > 0 && heads > 0,
              "query: expected non-empty heads, got shape ", shape_str(query), " and out shape ",
              shape_str(out));
  TORCH_CHECK(query.stride(2) == 1, "query: expected a contiguous last dim, got strides ",
              query.strides());
  TORCH_CHECK(out.stride(2) == 1, "out: expected a contiguous last dim, got strides ",
              out.strides());

  const bool quantized = kind != CacheKind::kUnquantized;
  TORCH_CHECK(key_cache.dim() == 4, k_name,
              ": expected a 4-D tensor [num_blocks, block_size, num_kv_heads, head_dim], "
              "got shape ",
              shape_str(key_cache));
  const int64_t kv_heads = key_cache.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, k_name,
              ": expected num_kv_heads dividing "
              "num_heads = ",
              heads, " (GQA) at dim 2, got shape ", shape_str(key_cache));
  check_head_size(kind, kv_cache_dtype, head_size, "query");
  check_head_size(kind, kv_cache_dtype, head_size_v, "out");
  if (packed != nullptr) {
    TORCH_CHECK(head_size == packed->head_dim && head_size_v == packed->head_dim,
                "out: expected the query's head size ", packed->head_dim, " for kv_cache_dtype '",
                kv_cache_dtype, "' (K and V of a slot are one size), got ", head_size_v);
  }
  // The last dim of a side's entries for head size d.
  const auto last_dim = [&](int64_t d) {
    return packed != nullptr ? packed_slot_geometry(*packed).slot_bytes : cache_last_dim(kind, d);
  };
  for (const auto& [cache, name, dim] :
       {std::tuple{&key_cache, k_name, head_size}, std::tuple{&value_cache, v_name, head_size_v}}) {
    if (quantized) {
      TORCH_CHECK(cache->scalar_type() == quantized_cache_dtype(kind), name, ": expected dtype ",
                  dtype_str(quantized_cache_dtype(kind)), " for kv_cache_dtype '", kv_cache_dtype,
                  "', got ", dtype_str(cache->scalar_type()));
    } else {
      source_type_of(*cache, name);
    }
    TORCH_CHECK(cache->dim() == 4 && cache->size(0) == key_cache.size(0) &&
                    cache->size(1) == key_cache.size(1) && cache->size(2) == kv_heads &&
                    cache->size(3) == last_dim(dim),
                name, ": expected shape [", key_cache.size(0), ", ", key_cache.size(1), ", ",
                kv_heads, ", ", last_dim(dim), "] for head size ", dim, " and kv_cache_dtype '",
                kv_cache_dtype, "', got ", shape_str(*cache));
  }
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "value_cache: expected dtype ",
              dtype_str(key_cache.scalar_type()), " (key_cache's), got ",
              dtype_str(value_cache.scalar_type()));
  const int64_t block_size = key_cache.size(1);
  check_int_range(block_size, "key_cache block_size");
  const auto [k_layout, v_layout] = resolve_scale_layouts(k_scale_layout, v_scale_layout, kind,
                                                          block_size, head_size, head_size_v);
  const bool k_per_head = check_scale(k_scale, "k_scale", kv_heads);
  const bool v_per_head = check_scale(v_scale, "v_scale", kv_heads);

  for (const auto& [t, name] :
       {std::pair{&seq_lens, "seq_lens"}, std::pair{&query_start_loc, "query_start_loc"}}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous(), name,
                ": expected a contiguous 1-D int32 tensor, got ", dtype_str(t->scalar_type()),
                " of shape ", shape_str(*t));
  }
  const int64_t num_seqs = seq_lens.size(0);
  check_int_range(num_seqs, "seq_lens");
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1, "query_start_loc: expected ", num_seqs + 1,
              " entries (num_seqs + 1), got ", query_start_loc.size(0));
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.size(0) >= num_seqs &&
                  (block_table.size(1) <= 1 || block_table.stride(1) == 1),
              "block_table: expected an int32 tensor [num_seqs, max_blocks] with num_seqs >= ",
              num_seqs, " and contiguous rows, got ", dtype_str(block_table.scalar_type()),
              " of shape ", shape_str(block_table), " and strides ", block_table.strides());
  TORCH_CHECK(std::isfinite(scale), "scale: expected a finite softmax scale, got ", scale);
  TORCH_CHECK(sliding_window >= 0 && sliding_window <= INT_MAX,
              "sliding_window: expected a window in tokens (0 = none), got ", sliding_window);
  TORCH_CHECK(logits_soft_cap >= 0 && std::isfinite(logits_soft_cap),
              "logits_soft_cap: expected a finite cap >= 0 (0 = none), got ", logits_soft_cap);
  if (sinks) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                    sinks->size(0) == heads && sinks->is_contiguous(),
                "sinks: expected a contiguous float32 tensor [num_heads] = [", heads, "], got ",
                dtype_str(sinks->scalar_type()), " of shape ", shape_str(*sinks));
  }

  if (alibi_slopes) {
    TORCH_CHECK(alibi_slopes->scalar_type() == at::kFloat && alibi_slopes->dim() == 1 &&
                    alibi_slopes->size(0) == heads && alibi_slopes->is_contiguous(),
                "alibi_slopes: expected a contiguous float32 tensor [num_heads] = [", heads,
                "], got ", dtype_str(alibi_slopes->scalar_type()), " of shape ",
                shape_str(*alibi_slopes));
  }
  if (seq_causal) {
    TORCH_CHECK(seq_causal->scalar_type() == at::kInt && seq_causal->dim() == 1 &&
                    seq_causal->size(0) == seq_lens.size(0) && seq_causal->is_contiguous(),
                "seq_causal: expected a contiguous int32 tensor [num_seqs] = [", seq_lens.size(0),
                "], got ", dtype_str(seq_causal->scalar_type()), " of shape ",
                shape_str(*seq_causal));
  }

  check_key_transform(rope_cos_sin, key_offset, sink_keys, num_seqs, kv_heads, head_size);
  TORCH_CHECK((kind != CacheKind::kInt4PerTokenHead && kind != kPackedSlotKind) ||
                  !(rope_cos_sin || key_offset || sink_keys || key_hadamard),
              "kv_cache_dtype: expected a format that takes key transforms (rope_cos_sin, "
              "key_offset, sink_keys, key_hadamard), got '",
              kv_cache_dtype, "' (its keys are stored rotated)");
  TORCH_CHECK(!key_hadamard || (head_size & (head_size - 1)) == 0,
              "key_hadamard: expected a power-of-two head size, got ", head_size);

  PagedAttentionParams p{};
  p.out = out.data_ptr();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.query = query.data_ptr();
  p.query_token_stride = query.stride(0);
  p.query_head_stride = query.stride(1);
  p.io_type = io_type;
  p.cache_kind = kind;
  p.cache_type = quantized ? SourceType::kFloat32 : source_type_of(key_cache, "key_cache");
  p.key_cache = make_side(key_cache, k_name, kind, head_size, last_dim(head_size), k_scale,
                          k_per_head, k_layout);
  p.value_cache = make_side(value_cache, v_name, kind, head_size_v, last_dim(head_size_v), v_scale,
                            v_per_head, v_layout);
  if (packed != nullptr) p.packed = *packed;
  p.block_table = block_table.data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.num_seqs = int(num_seqs);
  p.num_heads = int(heads);
  p.num_kv_heads = int(kv_heads);
  p.block_size = int(block_size);
  p.scale = float(scale);
  p.sliding_window = int(sliding_window);
  p.logits_soft_cap = float(logits_soft_cap);
  p.sinks = sinks ? sinks->data_ptr<float>() : nullptr;
  p.causal = causal;
  p.seq_causal = seq_causal ? seq_causal->data_ptr<int32_t>() : nullptr;
  p.alibi_slopes = alibi_slopes ? alibi_slopes->data_ptr<float>() : nullptr;
  p.key_split = key_split;
  p.rope_cos_sin = rope_cos_sin ? rope_cos_sin->data_ptr<float>() : nullptr;
  p.rotary_dim = rope_cos_sin ? int(rope_cos_sin->size(1)) : 0;
  p.rope_is_neox = rope_is_neox;
  p.key_offset = key_offset ? key_offset->data_ptr<float>() : nullptr;
  p.sink_keys = sink_keys ? sink_keys->data_ptr<float>() : nullptr;
  p.num_sink_keys = sink_keys ? int(sink_keys->size(1)) : 0;
  p.key_hadamard = key_hadamard;
  return p;
}

PackedSlotFormat parse_packed_slot_format(const std::string& kv_cache_dtype, int64_t head_size,
                                          int64_t key_bits, int64_t value_bits,
                                          bool norm_correction, int64_t rope_dim,
                                          const std::optional<at::Tensor>& codebook) {
  const std::string_view name = kv_cache_dtype;
  PackedSlotFormat f{};
  int64_t codebook_size = 0;
  int64_t multiple = 1;  // of the head size
  if (name.rfind("turboquant_", 0) == 0) {
    f.family = PackedFamily::kTurboQuant;
    TORCH_CHECK(key_bits == 3 || key_bits == 4 || key_bits == kTurboQuantFp8KeyBits,
                "key_bits: expected 3 or 4 (Lloyd-Max keys) or ", kTurboQuantFp8KeyBits,
                " (e4m3 keys) for '", kv_cache_dtype, "', got ", key_bits);
    TORCH_CHECK(value_bits == 3 || value_bits == 4, "value_bits: expected 3 or 4 for '",
                kv_cache_dtype, "', got ", value_bits);
    codebook_size = key_bits == kTurboQuantFp8KeyBits ? 0 : int64_t(1) << key_bits;
    multiple = 8;  // whole bytes of codes
  } else if (name == "ultraquant_4bit") {
    f.family = PackedFamily::kUltraQuant;
    TORCH_CHECK(key_bits == 4 && value_bits == 4, "key_bits/value_bits: expected 4/4 for '",
                kv_cache_dtype, "', got ", key_bits, "/", value_bits);
    multiple = kUltraQuantGroup;
  } else if (name.rfind("octave_", 0) == 0) {
    f.family = PackedFamily::kOctave;
    f.compact = name.size() > 8 && name.substr(name.size() - 8) == "_compact";
    TORCH_CHECK(key_bits == kOctaveNopeBits, "key_bits: expected ", kOctaveNopeBits, " for '",
                kv_cache_dtype, "', got ", key_bits);
    TORCH_CHECK(value_bits == 3 || value_bits == 4, "value_bits: expected 3 or 4 for '",
                kv_cache_dtype, "', got ", value_bits);
    const bool power_of_two = head_size > 0 && (head_size & (head_size - 1)) == 0;
    TORCH_CHECK(!f.compact || (rope_dim == 0 && power_of_two),
                "rope_dim: compact Octave K takes rope_dim 0 and a power-of-two head size, got "
                "rope_dim ",
                rope_dim, " and head size ", head_size);
    TORCH_CHECK(rope_dim >= 0 && rope_dim % kOctaveBlock == 0 && rope_dim <= head_size,
                "rope_dim: expected a multiple of ", kOctaveBlock, " in [0, head size ", head_size,
                "], got ", rope_dim);
    codebook_size = kOctaveCodebookSize;
    multiple = kOctaveBlock;
  } else {
    TORCH_CHECK(false,
                "kv_cache_dtype: expected a packed-slot format (turboquant_*, "
                "ultraquant_4bit, octave_*), got '",
                kv_cache_dtype, "'");
  }
  TORCH_CHECK(head_size > 0 && head_size % multiple == 0 && head_size <= INT_MAX, "query: '",
              kv_cache_dtype, "' needs a head size that is a multiple of ", multiple, ", got ",
              head_size);
  TORCH_CHECK(!norm_correction || (f.family == PackedFamily::kTurboQuant && codebook_size > 0),
              "norm_correction: expected false for '", kv_cache_dtype,
              "' (TurboQuant's Lloyd-Max keys only), got true");
  if (codebook_size == 0) {
    TORCH_CHECK(!codebook, "codebook: expected None for '", kv_cache_dtype, "', got a tensor");
  } else {
    TORCH_CHECK(codebook && codebook->scalar_type() == at::kFloat && codebook->dim() == 1 &&
                    codebook->size(0) == codebook_size && codebook->is_contiguous(),
                "codebook: expected a contiguous float32 tensor [", codebook_size, "] for '",
                kv_cache_dtype, "', got ",
                codebook ? dtype_str(codebook->scalar_type()) + " of shape " + shape_str(*codebook)
                         : std::string("None"));
    f.codebook = codebook->data_ptr<float>();
  }
  f.head_dim = int(head_size);
  f.key_bits = int(key_bits);
  f.value_bits = int(value_bits);
  f.norm_correction = norm_correction;
  f.rope_dim = int(rope_dim);
  return f;
}

}  // namespace vllm_kv
