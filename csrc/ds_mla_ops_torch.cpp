// The compiled nvfp4_ds_mla writer's glue: validation shared by the CPU and CUDA ops, and the CPU
// op, which runs the CUDA kernel's units (ds_mla_nvfp4.h) in a loop.
#include "ds_mla_ops_torch.h"

#include <ATen/Parallel.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include "cache_ops_checks.h"
#include "cache_ops_torch.h"
#include "cpu/cpu_op_utils.h"

namespace vllm_kv {

namespace {

void check_rows(const at::Tensor& t, const char* name, int64_t width) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, ": expected dtype bfloat16, got ",
              dtype_str(t.scalar_type()));
  TORCH_CHECK(t.dim() == 2 && t.size(1) == width && (t.size(0) <= 1 || t.stride(1) == 1), name,
              ": expected a [T, ", width, "] tensor with contiguous rows, got shape ", shape_str(t),
              " and strides ", t.strides());
}

}  // namespace

DsMlaWriteArgs prepare_ds_mla_write(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                    const at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  check_same_device(kv_c, "kv_c", kv_cache);
  check_same_device(k_pe, "k_pe", kv_cache);
  check_same_device(slot_mapping, "slot_mapping", kv_cache);
  check_rows(kv_c, "kv_c", kDsMlaNopeDim);
  check_rows(k_pe, "k_pe", kDsMlaRopeDim);
  TORCH_CHECK(k_pe.size(0) == kv_c.size(0), "k_pe: expected ", kv_c.size(0),
              " tokens (kv_c's), got ", k_pe.size(0));
  TORCH_CHECK(kv_cache.scalar_type() == at::kByte, "kv_cache: expected dtype uint8, got ",
              dtype_str(kv_cache.scalar_type()));
  TORCH_CHECK(
      kv_cache.dim() == 3 && kv_cache.size(2) == kDsMlaRecordBytes && kv_cache.stride(2) == 1,
      "kv_cache: expected a (num_blocks, block_size, ", kDsMlaRecordBytes,
      ") tensor with contiguous records, got shape ", shape_str(kv_cache), " and strides ",
      kv_cache.strides());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  (slot_mapping.size(0) <= 1 || slot_mapping.stride(0) == 1),
              "slot_mapping: expected a contiguous int64 [T] tensor, got ",
              dtype_str(slot_mapping.scalar_type()), " of shape ", shape_str(slot_mapping));
  TORCH_CHECK(slot_mapping.size(0) <= kv_c.size(0), "slot_mapping: expected at most ", kv_c.size(0),
              " entries (kv_c's tokens), got ", slot_mapping.size(0));
  check_int_range(kv_cache.size(1), "kv_cache block_size");
  DsMlaWriteArgs a{};
  a.kv_c = static_cast<const uint16_t*>(kv_c.data_ptr());
  a.k_pe = static_cast<const uint16_t*>(k_pe.data_ptr());
  a.kv_c_stride = kv_c.stride(0);
  a.k_pe_stride = k_pe.stride(0);
  a.cache = static_cast<uint8_t*>(kv_cache.data_ptr());
  a.block_stride = kv_cache.stride(0);
  a.entry_stride = kv_cache.stride(1);
  a.slot_mapping = slot_mapping.data_ptr<int64_t>();
  a.num_tokens = slot_mapping.size(0);
  a.num_slots = kv_cache.size(0) * kv_cache.size(1);
  a.block_size = int(kv_cache.size(1));
  return a;
}

namespace {

void concat_and_cache_nvfp4_ds_mla_cpu(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                       at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  check_cpu(kv_cache, "kv_cache");
  const DsMlaWriteArgs a = prepare_ds_mla_write(kv_c, k_pe, kv_cache, slot_mapping);
  for (const int64_t i : c10::irange(a.num_tokens)) {
    TORCH_CHECK(a.slot_mapping[i] < a.num_slots,
                "slot_mapping: expected slots < num_blocks * block_size = ", a.num_slots,
                " (negative to skip a token), got slot_mapping[", i, "] = ", a.slot_mapping[i]);
  }
  at::parallel_for(0, a.num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      for (int unit = 0; unit < kDsMlaUnits; ++unit) write_ds_mla_unit(a, token, unit);
    }
  });
}

}  // namespace
}  // namespace vllm_kv

TORCH_LIBRARY_IMPL(_C_cache_ops, CPU, m) {
  m.impl("concat_and_cache_nvfp4_ds_mla", &vllm_kv::concat_and_cache_nvfp4_ds_mla_cpu);
}
