// The int4_per_token_head rotation's sign vectors for the kernels (int4_per_token_head.h): drawn
// once per (device, Hadamard block) exactly as the reference codec draws them (a CPU generator
// seeded kInt4RhtSeed, bernoulli(0.5) over `block` values, then 2b - 1), and kept for the life of
// the process so that a kernel still running on a stream never sees them freed.
#include "int4_rht_signs_torch.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/bernoulli.h>
#include <ATen/ops/full.h>

#include <map>
#include <mutex>
#include <tuple>

namespace vllm_kv {

namespace {

// Seed of the codec's generator (vllm/kv_quant/int4_per_token_head.py, RHT_SEED).
constexpr uint64_t kInt4RhtSeed = 0x9E3779B9u;

at::Tensor draw_signs(int64_t block) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(kInt4RhtSeed);
  const at::Tensor draws = at::bernoulli(at::full({block}, 0.5, at::kFloat), gen);
  return draws.mul(2.0).sub(1.0);
}

}  // namespace

const float* int4_rht_signs(int64_t block, const at::Device& device) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int64_t>, at::Tensor> signs;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::tuple{int(device.type()), int(device.index()), block};
  auto it = signs.find(key);
  if (it == signs.end()) {
    it = signs.emplace(key, draw_signs(block).to(device).contiguous()).first;
  }
  return it->second.data_ptr<float>();
}

}  // namespace vllm_kv
