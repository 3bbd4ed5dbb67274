// Torch glue helpers shared by the CPU ops: device and scale-value checks, and a dynamically
// scheduled parallel-for.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>

namespace vllm_kv {

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor, got device ", t.device());
}

// Quantized kinds divide by the scales: they must be finite and > 0.
inline void check_scale_values(const at::Tensor& scale, const char* name,
                               const std::string& kv_cache_dtype) {
  const float* values = scale.data_ptr<float>();
  for (const int64_t i : c10::irange(scale.numel())) {
    TORCH_CHECK(std::isfinite(values[i]) && values[i] > 0.0f, name,
                ": expected finite values > 0 for kv_cache_dtype '", kv_cache_dtype, "', got ",
                name, "[", i, "] = ", values[i]);
  }
}

// at::parallel_for over [begin, end) with dynamic scheduling: the threads take grain-sized blocks
// from a shared counter, so a thread slowed down by other load on its core does not hold up the
// call (at::parallel_for alone splits the range into one fixed part per thread).
template <typename Fn>
void dynamic_parallel_for(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  const int64_t num_parts = (end - begin + grain - 1) / grain;
  std::atomic<int64_t> next{0};
  const int64_t num_workers = std::min<int64_t>(num_parts, at::get_num_threads());
  at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    for (int64_t part = next++; part < num_parts; part = next++) {
      fn(begin + part * grain, std::min(end, begin + (part + 1) * grain));
    }
  });
}

}  // namespace vllm_kv
