// CPU implementation of _C_cache_ops::paged_attention: shared validation, the per-sequence value
// checks (lengths, page ids, scale values) that need the tensors' contents, then the torch-free
// kernel of cpu/paged_attention.h (through cpu/attention_dispatch.h).

// GCC 12 reports its own AVX-512 intrinsics (their undefined pass-through operands) as
// maybe-uninitialized (GCC bug 105593, fixed in 13). The pragma has to come before the first
// inclusion of <immintrin.h>, which torch's headers also include.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "cache_ops_checks.h"
#include "cache_ops_torch.h"
#include "cpu/attention_dispatch.h"
#include "cpu/cpu_op_utils.h"
#include "dispatch_utils.h"
#include "int4_per_token_head.h"

namespace vllm_kv {
namespace {

constexpr const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512:
      return "avx512";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kGeneric:
      return "generic";
    case SimdLevel::kAuto:
      break;
  }
  return "auto";
}

constexpr SimdLevel kAllLevels[] = {SimdLevel::kAvx512, SimdLevel::kAvx2, SimdLevel::kGeneric};

// The instruction-set levels this build compiled, widest first.
std::vector<std::string> paged_attention_simd_levels() {
  std::vector<std::string> names;
  for (const SimdLevel level : kAllLevels) {
    if (cpu::attention::simd_level_compiled(level)) names.emplace_back(simd_level_name(level));
  }
  return names;
}

SimdLevel parse_simd_level(const std::string& name) {
  if (name == "auto") return SimdLevel::kAuto;
  for (const SimdLevel level : kAllLevels) {
    if (name != simd_level_name(level)) continue;
    TORCH_CHECK(cpu::attention::simd_level_compiled(level), "simd: '", name,
                "' is not compiled into this build (target of VLLM_KV_CPU_ARCH); available: ",
                c10::Join(", ", paged_attention_simd_levels()));
    return level;
  }
  TORCH_CHECK(false, "simd: expected 'auto' or one of ",
              c10::Join(", ", paged_attention_simd_levels()), ", got '", name, "'");
}

// Lengths and page ids of every sequence, before anything is read from the cache. With
// rope_cos_sin (max_positions >= 0 rows) every position of every sequence must have a row.
void check_sequences(const PagedAttentionParams& p, int64_t query_rows, int64_t out_rows,
                     int64_t num_blocks, int64_t max_blocks, int64_t max_positions) {
  TORCH_CHECK(p.query_start_loc[0] == 0, "query_start_loc: expected 0 first, got ",
              p.query_start_loc[0]);
  for (const int seq : c10::irange(p.num_seqs)) {
    const int64_t seq_len = p.seq_lens[seq];
    const int64_t q_len = int64_t(p.query_start_loc[seq + 1]) - p.query_start_loc[seq];
    TORCH_CHECK(q_len >= 0 && q_len <= seq_len, "seq_lens: sequence ", seq, " has ", seq_len,
                " tokens and ", q_len,
                " query tokens (query_start_loc); expected 0 <= query_len <= seq_len");
    TORCH_CHECK(max_positions < 0 || seq_len <= max_positions, "rope_cos_sin: expected at least ",
                seq_len, " rows (sequence ", seq, "'s seq_len), got ", max_positions);
    if (q_len == 0) continue;
    const int first_key = cpu::attention::key_range(p, seq, int(seq_len), int(q_len), 0).first;
    const int64_t first_page = first_key / p.block_size;
    const int64_t last_page = (seq_len - 1) / p.block_size;
    TORCH_CHECK(last_page < max_blocks, "block_table: sequence ", seq, " of ", seq_len,
                " tokens needs ", last_page + 1, " pages of ", p.block_size,
                " tokens, the table has ", max_blocks, " columns");
    for (int64_t j = first_page; j <= last_page; ++j) {
      const int64_t page = p.block_table[seq * p.block_table_stride + j];
      TORCH_CHECK(page >= 0 && page < num_blocks, "block_table: sequence ", seq, " uses page ",
                  page, " at column ", j, ", the cache has ", num_blocks, " pages");
    }
  }
  const int64_t tokens = p.query_start_loc[p.num_seqs];
  TORCH_CHECK(tokens <= query_rows, "query: expected at least ", tokens,
              " rows (query_start_loc[-1]), got ", query_rows);
  TORCH_CHECK(tokens <= out_rows, "out: expected at least ", tokens,
              " rows (query_start_loc[-1]), got ", out_rows);
}

void run_paged_attention(const PagedAttentionParams& p, const at::Tensor& query, SimdLevel level) {
  const cpu::attention::AttentionPlan plan =
      cpu::attention::plan_attention(p, at::get_num_threads());
  const at::Tensor scratch = at::empty({plan.scratch_floats}, query.options().dtype(at::kFloat));
  cpu::attention::paged_attention(p, plan, scratch.data_ptr<float>(), level,
                                  [](int64_t begin, int64_t end, int64_t grain, const auto& fn) {
                                    dynamic_parallel_for(begin, end, grain, fn);
                                  });
}

// Rotates each of the first `rows` rows of x (fp32, [rows, width] contiguous) in place.
void rotate_rows(at::Tensor& x, int64_t rows, const float* signs, bool inverse) {
  const int width = int(x.size(-1));
  const float factor = 1.0f / float(int4_rht_block(width));  // a power of two: exact
  float* data = x.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      int4_rotate_row(data + r * width, width, signs, inverse, factor);
  });
}

// int4_per_token_head pages hold rotated rows y; attention over the rows they stand for is
// attention over y with the query rotated forward and the output rotated back (int4_rotate_row),
// in fp32, so the kernel reads the pages once and decodes no row back.
void run_int4_paged_attention(PagedAttentionParams p, at::Tensor& out, const at::Tensor& query,
                              SimdLevel level) {
  const int64_t tokens = p.query_start_loc[p.num_seqs];
  const at::TensorOptions fp32 = query.options().dtype(at::kFloat);
  at::Tensor q = at::empty({tokens, query.size(1), query.size(2)}, fp32);
  q.copy_(query.narrow(0, 0, tokens));  // a copy even when query is fp32: rotated in place
  at::Tensor o = at::empty({tokens, out.size(1), out.size(2)}, fp32);
  const int64_t heads = q.size(1);
  rotate_rows(q, tokens * heads, p.key_cache.rht_signs, /*inverse=*/false);
  p.query = q.data_ptr();
  p.query_token_stride = q.stride(0);
  p.query_head_stride = q.stride(1);
  p.out = o.data_ptr();
  p.out_token_stride = o.stride(0);
  p.out_head_stride = o.stride(1);
  p.io_type = SourceType::kFloat32;
  run_paged_attention(p, q, level);
  rotate_rows(o, tokens * heads, p.value_cache.rht_signs, /*inverse=*/true);
  out.narrow(0, 0, tokens).copy_(o);
}

void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_table,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                         const at::Tensor& v_scale, double scale, int64_t sliding_window,
                         double logits_soft_cap, const std::optional<at::Tensor>& sinks,
                         bool causal, const std::optional<std::string>& k_scale_layout,
                         const std::optional<std::string>& v_scale_layout, const std::string& simd,
                         const std::optional<at::Tensor>& rope_cos_sin, bool rope_is_neox,
                         const std::optional<at::Tensor>& key_offset,
                         const std::optional<at::Tensor>& sink_keys, bool key_hadamard,
                         const std::optional<at::Tensor>& alibi_slopes,
                         const std::optional<at::Tensor>& seq_causal, bool key_split) {
  check_cpu(key_cache, "key_cache");
  const SimdLevel level = parse_simd_level(simd);
  const PagedAttentionParams p = prepare_paged_attention(
      out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, kv_cache_dtype,
      k_scale, v_scale, scale, sliding_window, logits_soft_cap, sinks, causal, k_scale_layout,
      v_scale_layout, rope_cos_sin, rope_is_neox, key_offset, sink_keys, key_hadamard, alibi_slopes,
      seq_causal, key_split);
  check_sequences(p, query.size(0), out.size(0), key_cache.size(0), block_table.size(1),
                  rope_cos_sin ? rope_cos_sin->size(0) : -1);
  if (reads_kv_scale(p.cache_kind)) {
    check_scale_values(k_scale, "k_scale", kv_cache_dtype);
    check_scale_values(v_scale, "v_scale", kv_cache_dtype);
  }
  if (p.cache_kind == CacheKind::kInt4PerTokenHead) {
    run_int4_paged_attention(p, out, query, level);
  } else {
    run_paged_attention(p, query, level);
  }
}

// Paged attention over a packed K+V slot cache, in the format's frames (the caller rotates the
// query into the key frame and the output back from the value frame).
void packed_paged_attention_cpu(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    const std::string& kv_cache_dtype, int64_t key_bits, int64_t value_bits, bool norm_correction,
    int64_t rope_dim, const std::optional<at::Tensor>& codebook, double scale,
    int64_t sliding_window, double logits_soft_cap, const std::optional<at::Tensor>& sinks,
    bool causal, const std::string& simd, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& seq_causal, bool key_split) {
  check_cpu(kv_cache, "kv_cache");
  if (codebook) check_cpu(*codebook, "codebook");
  const SimdLevel level = parse_simd_level(simd);
  TORCH_CHECK(query.dim() == 3,
              "query: expected a 3-D tensor [T, num_heads, head_size], got shape ",
              shape_str(query));
  const PackedSlotFormat format = parse_packed_slot_format(
      kv_cache_dtype, query.size(2), key_bits, value_bits, norm_correction, rope_dim, codebook);
  const at::Tensor unit = at::ones({1}, kv_cache.options().dtype(at::kFloat));
  const PagedAttentionParams p = prepare_paged_attention(
      out, query, kv_cache, kv_cache, block_table, seq_lens, query_start_loc, kv_cache_dtype, unit,
      unit, scale, sliding_window, logits_soft_cap, sinks, causal, std::nullopt, std::nullopt,
      std::nullopt, true, std::nullopt, std::nullopt, false, alibi_slopes, seq_causal, key_split,
      &format);
  check_sequences(p, query.size(0), out.size(0), kv_cache.size(0), block_table.size(1), -1);
  run_paged_attention(p, query, level);
}

}  // namespace
}  // namespace vllm_kv

TORCH_LIBRARY_IMPL(_C_cache_ops, CPU, m) {
  m.impl("paged_attention", &vllm_kv::paged_attention_cpu);
  m.impl("packed_paged_attention", &vllm_kv::packed_paged_attention_cpu);
}

TORCH_LIBRARY_IMPL(_C_cache_ops, CompositeExplicitAutograd, m) {
  m.impl("paged_attention_simd_levels", &vllm_kv::paged_attention_simd_levels);
}
