// CPU implementations of the _C_cache_ops ops.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "cache_ops_torch.h"
#include "convert_fp8.h"
#include "cpu/cpu_op_utils.h"
#include "cpu/reshape_and_cache_flash.h"
#include "dispatch_utils.h"

namespace vllm_kv {
namespace {

void reshape_and_cache_flash_cpu(const at::Tensor& key, const at::Tensor& value,
                                 at::Tensor& key_cache, at::Tensor& value_cache,
                                 const at::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                                 const at::Tensor& k_scale, const at::Tensor& v_scale,
                                 const std::optional<std::string>& k_scale_layout,
                                 const std::optional<std::string>& v_scale_layout,
                                 const std::optional<at::Tensor>& key_sinks,
                                 const std::optional<at::Tensor>& key_sink_scale) {
  check_cpu(key_cache, "key_cache");
  const ReshapeAndCacheParams p = prepare_reshape_and_cache_flash(
      key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
      k_scale_layout, v_scale_layout, key_sinks, key_sink_scale);
  const int64_t num_slots = p.num_blocks * p.block_size;
  for (const int64_t i : c10::irange(p.num_tokens)) {
    TORCH_CHECK(p.slot_mapping[i] < num_slots,
                "slot_mapping: expected slots < num_blocks * block_size = ", num_slots,
                " (negative to skip a token), got slot_mapping[", i, "] = ", p.slot_mapping[i]);
  }
  if (reads_kv_scale(p.cache_kind)) {
    check_scale_values(k_scale, "k_scale", kv_cache_dtype);
    check_scale_values(v_scale, "v_scale", kv_cache_dtype);
  }
  if (key_sink_scale.has_value()) {  // the sink rows divide by it whatever the format
    check_scale_values(*key_sink_scale, "key_sink_scale", kv_cache_dtype);
  }
  cpu::reshape_and_cache_flash(p, [](int64_t begin, int64_t end, int64_t grain, const auto& fn) {
    dynamic_parallel_for(begin, end, grain, fn);
  });
}

void swap_blocks_cpu(const at::Tensor& src, at::Tensor& dst, int64_t block_size_in_bytes,
                     const at::Tensor& block_mapping) {
  check_cpu(src, "src");
  check_cpu(dst, "dst");
  check_swap_blocks_args(src, dst, block_size_in_bytes, block_mapping);
  const auto* src_bytes = static_cast<const char*>(src.data_ptr());
  auto* dst_bytes = static_cast<char*>(dst.data_ptr());
  const auto mapping = block_mapping.accessor<int64_t, 2>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / block_size_in_bytes);
  at::parallel_for(0, block_mapping.size(0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memmove(dst_bytes + mapping[i][1] * block_size_in_bytes,
                   src_bytes + mapping[i][0] * block_size_in_bytes, block_size_in_bytes);
    }
  });
}

#ifndef VLLM_KV_WITH_CUDA
// CPU-only builds: every address is host memory. (The CUDA build registers its own CPU-key
// implementation, csrc/cuda/torch_bindings_cuda.cpp, since the descriptors are CPU tensors
// whatever memory they address.)
void swap_blocks_batch_cpu(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                           const at::Tensor& sizes, bool /*is_src_access_order_any*/) {
  check_swap_blocks_batch_args(src_ptrs, dst_ptrs, sizes);
  swap_blocks_batch_on_host(src_ptrs, dst_ptrs, sizes);
}
#endif

void convert_fp8_cpu(at::Tensor& dst_cache, const at::Tensor& src_cache, double scale,
                     const std::string& kv_cache_dtype) {
  check_cpu(dst_cache, "dst_cache");
  run_convert_fp8(dst_cache, src_cache, scale, kv_cache_dtype, [](const ConvertFp8Params& p) {
    dispatch_convert_fp8(p.src_type, p.dst_type, [&](auto src, auto dst) {
      at::parallel_for(0, p.numel, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
        convert_fp8_range<decltype(src)::value, decltype(dst)::value>(p, begin, end);
      });
    });
  });
}

}  // namespace
}  // namespace vllm_kv

TORCH_LIBRARY_IMPL(_C_cache_ops, CPU, m) {
  m.impl("reshape_and_cache_flash", &vllm_kv::reshape_and_cache_flash_cpu);
  m.impl("swap_blocks", &vllm_kv::swap_blocks_cpu);
  m.impl("convert_fp8", &vllm_kv::convert_fp8_cpu);
#ifndef VLLM_KV_WITH_CUDA
  m.impl("swap_blocks_batch", &vllm_kv::swap_blocks_batch_cpu);
#endif
}
