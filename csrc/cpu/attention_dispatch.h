// Runtime dispatch of the CPU attention kernels: a call's cache kind, cache type and instruction
// set pick the PagedAttention instantiation that runs its plan's items; the split items' partials
// are merged after.
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention_kernels.h"
#include "cpu/attention_plan.h"
#include "cpu/attention_rows.h"
#include "cpu/attention_simd.h"
#include "cpu/paged_attention.h"

namespace vllm_kv::cpu::attention {

// Runs the attention of `p` with instruction set `level` (kAuto: the widest compiled) over the
// items of `plan`. parallel_for(begin, end, grain, fn) runs fn on sub-ranges of [begin, end) in
// parallel. scratch holds plan.scratch_floats floats.
template <typename ParallelFor>
void paged_attention(const PagedAttentionParams& p, const AttentionPlan& plan, float* scratch,
                     SimdLevel level, const ParallelFor& parallel_for) {
  if (level == SimdLevel::kAuto) level = widest_simd_level();
  const auto run = [&](auto kind_tag, auto type_tag, auto level_tag) {
    const PagedAttention<decltype(kind_tag)::value, decltype(type_tag)::value,
                         decltype(level_tag)::value>
        kernel(p);
    parallel_for(0, int64_t(plan.items.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) kernel.run(plan.items[i], scratch);
    });
  };
  const auto with_level = [&](auto kind_tag, auto type_tag) {
    switch (level) {
#if defined(VLLM_KV_HAVE_AVX512)
      case SimdLevel::kAvx512:
        return run(kind_tag, type_tag, std::integral_constant<SimdLevel, SimdLevel::kAvx512>{});
#endif
#if defined(VLLM_KV_HAVE_AVX2)
      case SimdLevel::kAvx2:
        return run(kind_tag, type_tag, std::integral_constant<SimdLevel, SimdLevel::kAvx2>{});
#endif
      default:
        return run(kind_tag, type_tag, std::integral_constant<SimdLevel, SimdLevel::kGeneric>{});
    }
  };
  using F32 = std::integral_constant<SourceType, SourceType::kFloat32>;
  if (p.cache_kind == kPackedSlotKind) {  // past the enumerators: no case below takes it
    with_level(std::integral_constant<CacheKind, kPackedSlotKind>{}, F32{});
  }
  switch (p.cache_kind) {
    case CacheKind::kFp8E4M3:
      with_level(std::integral_constant<CacheKind, CacheKind::kFp8E4M3>{}, F32{});
      break;
    case CacheKind::kFp8E5M2:
      with_level(std::integral_constant<CacheKind, CacheKind::kFp8E5M2>{}, F32{});
      break;
    case CacheKind::kNvfp4:
      with_level(std::integral_constant<CacheKind, CacheKind::kNvfp4>{}, F32{});
      break;
    case CacheKind::kInt8PerTokenHead:
      with_level(std::integral_constant<CacheKind, CacheKind::kInt8PerTokenHead>{}, F32{});
      break;
    case CacheKind::kFp8PerTokenHead:
      with_level(std::integral_constant<CacheKind, CacheKind::kFp8PerTokenHead>{}, F32{});
      break;
    case CacheKind::kInt4PerTokenHead:
      with_level(std::integral_constant<CacheKind, CacheKind::kInt4PerTokenHead>{}, F32{});
      break;
    case CacheKind::kUnquantized: {
      using U = std::integral_constant<CacheKind, CacheKind::kUnquantized>;
      switch (p.cache_type) {
        case SourceType::kFloat32:
          with_level(U{}, F32{});
          break;
        case SourceType::kFloat16:
          with_level(U{}, std::integral_constant<SourceType, SourceType::kFloat16>{});
          break;
        case SourceType::kBFloat16:
          with_level(U{}, std::integral_constant<SourceType, SourceType::kBFloat16>{});
          break;
      }
      break;
    }
  }
  parallel_for(0, int64_t(plan.merges.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) merge_partials(p, plan.merges[i], scratch);
  });
}

}  // namespace vllm_kv::cpu::attention
