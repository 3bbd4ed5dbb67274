// Host replay of the CUDA reshape_and_cache_flash kernels, compared byte for byte with an
// independent scalar reference (FlashTestProblem::expected). Needs no GPU and no torch.
//
// For random problems (flash_test_problem.h: source dtype, cache kind, head sizes K != V, NHD /
// HND, padded pages, fused or separate K/V caches, source token strides larger than H*D,
// T < T_pad, skipped and out-of-range slots, per-tensor / per-head scales including degenerate
// ones, linear / interleave4 NVFP4 scales, misaligned pointers and strides, key sink rows inside
// the pages in [S][H][D] or [H][S][D] order) it builds the launch
// plan exactly as launch_reshape_and_cache_flash does, then runs the selected kernel
// instantiation's per-thread function (gpu::write_unit) for every (block, thread) of the planned
// grid, including the grid-stride loop. The whole cache image, padding and guard bytes included,
// must equal what the scalar reference writes.
//
// Build and run (tools/compile_cuda_kernels.sh does this):
//   nvcc -std=c++20 -O1 -I csrc csrc/cuda/tests/check_reshape_and_cache_flash_replay.cu -o /tmp/r
//   /tmp/r [num_problems] [verbose]
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>

#include "cuda/reshape_and_cache_flash.cuh"
#include "cuda/tests/flash_test_problem.h"

namespace {

using namespace vllm_kv;

struct HostReplay {
  const gpu::FlashLaunchPlan& plan;
  std::string* instantiation;

  template <typename Src, CacheKind kKind, int kVec, bool kWide>
  void operator()(gpu::KernelTag<Src, kKind, kVec, kWide>) const {
    *instantiation = "src" + std::to_string(Src::kSize) + " kind" + std::to_string(int(kKind)) +
                     " vec" + std::to_string(kVec) + (kWide ? " wide" : " narrow");
    const gpu::FlashArgs& a = plan.args;
    std::vector<float> scratch(size_t(a.row_scratch_floats) + 1);  // one thread's at a time
    for (unsigned bx = 0; bx < plan.grid.x; ++bx) {
      for (unsigned by = 0; by < plan.grid.y; ++by) {
        for (unsigned ty = 0; ty < plan.block.y; ++ty) {
          for (unsigned tx = 0; tx < plan.block.x; ++tx) {
            const int unit = int(by * plan.block.x + tx);
            if (unit >= a.units_total) continue;
            const int64_t step = int64_t(plan.grid.x) * plan.block.y;
            for (int64_t token = int64_t(bx) * plan.block.y + ty; token < a.num_tokens;
                 token += step) {
              gpu::write_unit<Src, kKind, kVec, kWide>(a, token, unit, scratch.data());
            }
          }
        }
      }
    }
  }
};

bool run_problem(std::mt19937_64& rng, std::map<std::string, int>& seen, bool verbose) {
  const test::FlashTestProblem t = test::make_random_problem(rng);
  test::Bytes cache(t.cache.size());
  std::memcpy(cache.data(), t.cache.data(), t.cache.size());
  const ReshapeAndCacheParams params =
      t.params(cache.data(), t.key.data(), t.value.data(), t.slots.data(), t.k_scale.data(),
               t.v_scale.data(), t.sink_scale.data(), t.k_signs.data(), t.v_signs.data());
  const gpu::FlashLaunchPlan plan = gpu::plan_reshape_and_cache_flash(params);
  std::string inst = "empty";
  if (!plan.empty) {
    if (plan.block.x * plan.block.y > unsigned(gpu::kThreadsPerBlock) || plan.grid.y > 65535u ||
        plan.shared_bytes > size_t(gpu::kRowScratchBytes)) {
      std::printf("FAILED bad launch shape for %s\n", t.describe().c_str());
      return false;
    }
    gpu::dispatch_flash_kernel(params, plan, HostReplay{plan, &inst});
  }
  seen[inst]++;

  const test::Bytes expected = t.expected();
  for (size_t i = 0; i < cache.size(); ++i) {
    if (cache.data()[i] != expected.data()[i]) {
      std::printf("FAILED %s [%s]: first differing byte %zu (replay %02x, reference %02x)\n",
                  t.describe().c_str(), inst.c_str(), i, cache.data()[i], expected.data()[i]);
      return false;
    }
  }
  if (verbose) std::printf("ok %s [%s]\n", t.describe().c_str(), inst.c_str());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const int num_problems = argc > 1 ? std::atoi(argv[1]) : 3000;
  const bool verbose = argc > 2;
  std::mt19937_64 rng(12345);
  std::map<std::string, int> seen;
  int passed = 0, failed = 0;
  for (int i = 0; i < num_problems; ++i) {
    run_problem(rng, seen, verbose) ? ++passed : ++failed;
  }
  std::printf("kernel instantiations exercised:");
  for (const auto& [name, n] : seen) std::printf(" [%s]x%d", name.c_str(), n);
  std::printf("\n%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
