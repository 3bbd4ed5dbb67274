// The CPU packed-slot stores (TurboQuant, ultraquant_4bit, Octave) after the shared validation
// (packed_slot_ops_torch.h), a parallel loop over slots: TurboQuant and ultraquant_4bit row at a
// time (cpu/packed_slot_rows.h), Octave kLanes slots at a time (cpu/octave_slot_lanes.h).
// Compiled with the CPU kernels' -march, so that their loops vectorize.
#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>

#include <torch/library.h>

#include "cpu/cpu_op_utils.h"
#include "cpu/octave_slot_lanes.h"
#include "cpu/packed_slot_rows.h"
#include "packed_slot_ops_torch.h"

namespace vllm_kv {
namespace {

void turboquant_store_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping,
                          const std::optional<at::Tensor>& key_norms,
                          const std::optional<at::Tensor>& midpoints, int64_t key_bits,
                          int64_t value_bits) {
  check_cpu(kv_cache, "kv_cache");
  const TurboQuantWriteArgs a = prepare_turboquant_store(
      key, value, kv_cache, slot_mapping, key_norms, midpoints, key_bits, value_bits);
  check_slot_range(a);
  const bool key_fp8 = a.key_bits == kTurboQuantFp8KeyBits;
  dispatch_turboquant_types(key_fp8, a.value_type, [&](auto ks, auto vs) {
    at::parallel_for(0, a.num_tokens * a.num_heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        cpu::write_turboquant_slot_rows<decltype(ks)::value, decltype(vs)::value>(
            a, i / a.num_heads, int(i % a.num_heads));
      }
    });
  });
}

void ultraquant_store_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping, double constant_c) {
  check_cpu(kv_cache, "kv_cache");
  const UltraQuantWriteArgs a =
      prepare_ultraquant_store(key, value, kv_cache, slot_mapping, constant_c);
  check_slot_range(a);
  dispatch_source_type(a.value_type, [&](auto vs) {
    at::parallel_for(0, a.num_tokens * a.num_heads, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        cpu::write_ultraquant_slot_rows<decltype(vs)::value>(a, i / a.num_heads,
                                                             int(i % a.num_heads));
      }
    });
  });
}

void octave_cache_store_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& cache,
                            const at::Tensor& slot_mapping, const at::Tensor& k_signs,
                            const at::Tensor& v_signs, int64_t fmt) {
  check_cpu(cache, "cache");
  const OctaveWriteArgs a =
      prepare_octave_store(key, value, cache, slot_mapping, k_signs, v_signs, fmt);
  check_slot_range(a);
  const int64_t slots = a.num_tokens * a.num_heads;
  dispatch_source_type(a.value_type, [&](auto vs) {
    at::parallel_for(0, (slots + cpu::kLanes - 1) / cpu::kLanes, 4,
                     [&](int64_t begin, int64_t end) {
                       const auto scratch = std::make_unique<cpu::OctaveSlotLanes>();
                       for (int64_t run = begin; run < end; ++run) {
                         const int64_t first = run * cpu::kLanes;
                         const int count = int(std::min<int64_t>(cpu::kLanes, slots - first));
                         cpu::write_octave_slots<decltype(vs)::value>(a, *scratch, first, count);
                       }
                     });
  });
}

}  // namespace
}  // namespace vllm_kv

TORCH_LIBRARY_IMPL(_C, CPU, m) { m.impl("octave_cache_store", &vllm_kv::octave_cache_store_cpu); }

TORCH_LIBRARY_IMPL(_C_cache_ops, CPU, m) {
  m.impl("turboquant_store", &vllm_kv::turboquant_store_cpu);
  m.impl("ultraquant_store", &vllm_kv::ultraquant_store_cpu);
}
