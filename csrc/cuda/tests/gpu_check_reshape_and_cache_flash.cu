// Runs the CUDA reshape_and_cache_flash kernels on a GPU without torch:
//   1. random problems (flash_test_problem.h, a third with key sink rows) launched through
//      launch_reshape_and_cache_flash and compared byte for byte (whole cache image, guard bytes
//      and sink rows included) with the scalar reference of flash_test_problem.h;
//   2. with --bench: dense serving-shaped writes (H=8, D=128, block 16, consecutive slots) for the
//      unquantized, FP8-e4m3 and NVFP4 kinds, timed with CUDA events, against a device-to-device
//      cudaMemcpy roofline measured in the same run.
// Build (for the GPU at hand; tools/compile_cuda_kernels.sh builds it for sm_90a), from the repo
// root:
//   nvcc -std=c++20 -O2 -I csrc -gencode arch=compute_90a,code=sm_90a
//        csrc/cuda/reshape_and_cache_flash.cu csrc/cuda/tests/gpu_check_reshape_and_cache_flash.cu
//        -o /tmp/gpu_check
//   /tmp/gpu_check [num_problems] [--bench] [--json PATH]
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/reshape_and_cache_flash.h"
#include "cuda/tests/flash_test_problem.h"

namespace {

using namespace vllm_kv;

#define CHECK_CUDA(expr)                                                 \
  do {                                                                   \
    const cudaError_t err_ = (expr);                                     \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(err_));                            \
      std::exit(2);                                                      \
    }                                                                    \
  } while (0)

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t size) : size_(size) {
    CHECK_CUDA(cudaMalloc(&ptr_, size ? size : 1));
  }
  DeviceBuffer(const void* host, size_t size) : DeviceBuffer(size) {
    if (size) CHECK_CUDA(cudaMemcpy(ptr_, host, size, cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  size_t size_;
};

struct DeviceProblem {
  DeviceBuffer key, value, cache, slots, k_scale, v_scale, sink_scale, k_signs, v_signs;
  explicit DeviceProblem(const test::FlashTestProblem& t)
      : key(t.key.data(), t.key.size()),
        value(t.value.data(), t.value.size()),
        cache(t.cache.data(), t.cache.size()),
        slots(t.slots.data(), t.slots.size() * sizeof(int64_t)),
        k_scale(t.k_scale.data(), t.k_scale.size() * sizeof(float)),
        v_scale(t.v_scale.data(), t.v_scale.size() * sizeof(float)),
        sink_scale(t.sink_scale.data(), t.sink_scale.size() * sizeof(float)),
        k_signs(t.k_signs.data(), t.k_signs.size() * sizeof(float)),
        v_signs(t.v_signs.data(), t.v_signs.size() * sizeof(float)) {}
  ReshapeAndCacheParams params(const test::FlashTestProblem& t) const {
    return t.params(cache.data(), key.data(), value.data(),
                    reinterpret_cast<const int64_t*>(slots.data()),
                    reinterpret_cast<const float*>(k_scale.data()),
                    reinterpret_cast<const float*>(v_scale.data()),
                    reinterpret_cast<const float*>(sink_scale.data()),
                    reinterpret_cast<const float*>(k_signs.data()),
                    reinterpret_cast<const float*>(v_signs.data()));
  }
};

bool same_as_reference(const test::FlashTestProblem& t, const DeviceProblem& d, const char* what) {
  std::vector<uint8_t> got(t.cache.size());
  CHECK_CUDA(cudaMemcpy(got.data(), d.cache.data(), got.size(), cudaMemcpyDeviceToHost));
  const test::Bytes expected = t.expected();
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != expected.data()[i]) {
      std::printf("FAILED %s %s: first differing byte %zu (gpu %02x, reference %02x)\n", what,
                  t.describe().c_str(), i, got[i], expected.data()[i]);
      return false;
    }
  }
  return true;
}

struct BenchResult {
  std::string kind, layout;
  int tokens;
  double us_per_call, host_us_per_call, bytes, gbps, pct_roofline;
};

double memcpy_roofline_gbps() {
  const size_t size = size_t(1) << 30;
  DeviceBuffer a(size), b(size);
  CHECK_CUDA(cudaMemset(a.data(), 1, size));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  CHECK_CUDA(cudaMemcpyAsync(b.data(), a.data(), size, cudaMemcpyDeviceToDevice));
  const int iters = 10;
  CHECK_CUDA(cudaEventRecord(start));
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaMemcpyAsync(b.data(), a.data(), size, cudaMemcpyDeviceToDevice));
  }
  CHECK_CUDA(cudaEventRecord(stop));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  return 2.0 * double(size) * iters / (ms * 1e-3) / 1e9;  // bytes read + written
}

std::vector<BenchResult> bench(double roofline) {
  std::vector<BenchResult> results;
  std::mt19937_64 rng(7);
  const int heads = 8, head_size = 128, block_size = 16;
  const struct {
    CacheKind kind;
    const char* name;
    Nvfp4ScalePolicy scale_policy;
  } kinds[] = {{CacheKind::kUnquantized, "bf16", Nvfp4ScalePolicy::kNearest},
               {CacheKind::kFp8E4M3, "fp8_e4m3", Nvfp4ScalePolicy::kNearest},
               {CacheKind::kNvfp4, "nvfp4", Nvfp4ScalePolicy::kNearest},
               {CacheKind::kNvfp4, "nvfp4_mse", Nvfp4ScalePolicy::kMse},
               {CacheKind::kNvfp4, "nvfp4_4over6", Nvfp4ScalePolicy::k4over6},
               {CacheKind::kInt4PerTokenHead, "int4_per_token_head", Nvfp4ScalePolicy::kNearest}};
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (const auto& k : kinds) {
    for (bool hnd : {false, true}) {
      for (int tokens : {1, 16, 256, 4096, 16384, 65536}) {
        const test::FlashTestProblem t =
            test::make_dense_problem(SourceType::kBFloat16, k.kind, tokens, heads, head_size,
                                     block_size, hnd, rng, k.scale_policy);
        DeviceProblem d(t);
        const ReshapeAndCacheParams p = d.params(t);
        launch_reshape_and_cache_flash(p, nullptr);
        CHECK_CUDA(cudaGetLastError());
        CHECK_CUDA(cudaDeviceSynchronize());
        if (tokens <= 16384 && !same_as_reference(t, d, "bench")) std::exit(1);
        const int iters = tokens <= 256 ? 2000 : (tokens <= 4096 ? 500 : 100);
        for (int i = 0; i < 20; ++i) launch_reshape_and_cache_flash(p, nullptr);
        CHECK_CUDA(cudaDeviceSynchronize());
        const auto h0 = std::chrono::steady_clock::now();
        CHECK_CUDA(cudaEventRecord(start));
        for (int i = 0; i < iters; ++i) launch_reshape_and_cache_flash(p, nullptr);
        CHECK_CUDA(cudaEventRecord(stop));
        const auto h1 = std::chrono::steady_clock::now();
        CHECK_CUDA(cudaEventSynchronize(stop));
        CHECK_CUDA(cudaGetLastError());
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        const double us = ms * 1e3 / iters;
        const double host_us = std::chrono::duration<double, std::micro>(h1 - h0).count() / iters;
        const int64_t elems = int64_t(tokens) * heads * 2 * head_size;
        const double written = k.kind == CacheKind::kNvfp4         ? elems / 2 + elems / 16
                               : k.kind == CacheKind::kUnquantized ? elems * 2.0
                                                                   : double(elems);
        const double bytes = elems * 2.0 + written + tokens * 8.0;
        const double gbps = bytes / (us * 1e-6) / 1e9;
        results.push_back({k.name, hnd ? "HND" : "NHD", tokens, us, host_us, bytes, gbps,
                           100.0 * gbps / roofline});
        const BenchResult& r = results.back();
        std::printf(
            "%-9s %s T=%6d  %9.2f us/call (host %.2f us/launch)  %10.0f B  %8.1f GB/s  "
            "%5.1f%% of roofline\n",
            r.kind.c_str(), r.layout.c_str(), r.tokens, r.us_per_call, r.host_us_per_call, r.bytes,
            r.gbps, r.pct_roofline);
      }
    }
  }
  return results;
}

}  // namespace

int main(int argc, char** argv) {
  int num_problems = 3000;
  bool run_bench = false;
  const char* json_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--bench") == 0) {
      run_bench = true;
    } else if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      num_problems = std::atoi(argv[i]);
    }
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);

  std::mt19937_64 rng(12345);
  int passed = 0, failed = 0;
  for (int i = 0; i < num_problems; ++i) {
    const test::FlashTestProblem t = test::make_random_problem(rng);
    DeviceProblem d(t);
    launch_reshape_and_cache_flash(d.params(t), nullptr);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    same_as_reference(t, d, "random") ? ++passed : ++failed;
  }
  std::printf("random problems on the GPU vs the reference: %d passed, %d failed\n", passed,
              failed);

  if (run_bench) {
    const double roofline = memcpy_roofline_gbps();
    std::printf("roofline: device-to-device cudaMemcpy of 1 GiB: %.1f GB/s (read + write)\n",
                roofline);
    const std::vector<BenchResult> results = bench(roofline);
    if (json_path) {
      FILE* f = std::fopen(json_path, "w");
      if (f) {
        std::fprintf(f, "{\"device\": \"%s\", \"roofline_gbps\": %.1f, \"results\": [\n", prop.name,
                     roofline);
        for (size_t i = 0; i < results.size(); ++i) {
          const BenchResult& r = results[i];
          std::fprintf(f,
                       "  {\"kind\": \"%s\", \"layout\": \"%s\", \"tokens\": %d, \"us_per_call\": "
                       "%.3f, \"host_us_per_launch\": %.3f, \"bytes\": %.0f, \"gbps\": %.1f, "
                       "\"pct_roofline\": %.1f}%s\n",
                       r.kind.c_str(), r.layout.c_str(), r.tokens, r.us_per_call,
                       r.host_us_per_call, r.bytes, r.gbps, r.pct_roofline,
                       i + 1 < results.size() ? "," : "");
        }
        std::fprintf(f, "]}\n");
        std::fclose(f);
      }
    }
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
