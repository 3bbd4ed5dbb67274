// Host check that the branch-free encoders of csrc/cuda/kv_quant_fast.h produce the same bytes as
// the reference-matching encoders of csrc/kv_quant_math.h:
//   - float_to_e4m3_satfinite_fast, float_to_e5m2_satfinite_fast, float_to_e2m1_fast and (on
//     non-NaN inputs) float_to_e2m1_not_nan: every one of the 2^32 fp32 bit patterns;
//   - e4m3_to_float_fast: every byte;
//   - nvfp4_quantize_group_fast: random and adversarial 16-element groups and global scales.
// Framework-free; build with any C++17 compiler, e.g.
//   g++ -std=c++17 -O2 -fopenmp -I csrc csrc/cuda/tests/check_kv_quant_fast.cpp -o /tmp/check
// Prints one line per check and "N passed, N failed"; exits non-zero on any mismatch.
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>

#include "cuda/kv_quant_fast.h"
#include "kv_quant_math.h"

namespace {

using vllm_kv::bits_as_float;

template <typename Fast, typename Ref>
bool check_all_floats(const char* name, Fast fast, Ref ref) {
  int64_t mismatches = 0;
  uint32_t first_bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : mismatches)
  for (int64_t hi = 0; hi < (int64_t(1) << 16); ++hi) {
    for (uint32_t lo = 0; lo < (1u << 16); ++lo) {
      const uint32_t bits = (uint32_t(hi) << 16) | lo;
      const float x = bits_as_float(bits);
      if (fast(x) != ref(x)) {
        if (mismatches == 0) {
#pragma omp critical
          first_bad = bits;
        }
        ++mismatches;
      }
    }
  }
  std::printf("%-40s %s (%" PRId64 " mismatches of 2^32%s", name, mismatches ? "FAILED" : "ok",
              mismatches, mismatches ? "" : ")\n");
  if (mismatches) std::printf(", e.g. bits 0x%08x)\n", first_bad);
  return mismatches == 0;
}

// A random fp32 value drawn to hit the interesting ranges of NVFP4 quantization.
float random_value(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> pick(0, 99);
  const int kind = pick(rng);
  if (kind < 2) return bits_as_float(uint32_t(rng()));  // any bit pattern, NaN included
  if (kind < 4) return 0.0f * (rng() & 1 ? 1.0f : -1.0f);
  if (kind < 5) return (rng() & 1 ? 1.0f : -1.0f) * bits_as_float(0x7F800000u);
  if (kind < 8) return bits_as_float(uint32_t(rng()) & 0x807FFFFFu);  // subnormal
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 30);
  return std::ldexp(normal(rng), exponent(rng));
}

bool check_groups(int64_t num_groups) {
  std::mt19937_64 rng(20240521);
  int64_t mismatches = 0;
  for (int64_t n = 0; n < num_groups; ++n) {
    float x[vllm_kv::kNvfp4GroupSize];
    const int mode = int(rng() % 4);
    const float base = random_value(rng);
    for (int i = 0; i < vllm_kv::kNvfp4GroupSize; ++i) {
      // mode 0: independent values; 1: values near one magnitude (E2M1 ties and thresholds);
      // 2: exact multiples of 0.25 of a power of two; 3: mostly zeros.
      switch (mode) {
        case 0:
          x[i] = random_value(rng);
          break;
        case 1:
          x[i] = base * (1.0f + float(int(rng() % 64) - 32) / 64.0f);
          break;
        case 2:
          x[i] = std::ldexp(float(int(rng() % 49) - 24) * 0.25f, int(rng() % 20) - 10);
          break;
        default:
          x[i] = rng() % 8 == 0 ? random_value(rng) : 0.0f;
      }
    }
    float global_scale;
    switch (rng() % 4) {
      case 0:
        global_scale = 1.0f;
        break;
      case 1:
        global_scale = std::ldexp(1.0f, int(rng() % 40) - 20) / 448.0f;
        break;
      case 2:
        global_scale = random_value(rng);  // includes 0, negative, Inf, NaN, subnormal
        break;
      default:
        global_scale = std::fabs(std::ldexp(std::normal_distribution<float>(0, 1)(rng), -8));
    }
    const float inv = vllm_kv::kv_fdiv(1.0f, global_scale);
    uint8_t packed_ref[8], packed_fast[8];
    const uint8_t s_ref = vllm_kv::nvfp4_quantize_group(x, inv, packed_ref);
    const uint8_t s_fast = vllm_kv::nvfp4_quantize_group_fast(x, inv, packed_fast);
    bool same = s_ref == s_fast;
    for (int j = 0; j < 8; ++j) same = same && packed_ref[j] == packed_fast[j];
    if (!same) {
      if (mismatches == 0) {
        std::printf("group mismatch: scale %02x vs %02x, global_scale %a\n", s_ref, s_fast,
                    global_scale);
      }
      ++mismatches;
    }
  }
  std::printf("%-40s %s (%" PRId64 " mismatches of %" PRId64 " groups)\n",
              "nvfp4_quantize_group_fast", mismatches ? "FAILED" : "ok", mismatches, num_groups);
  return mismatches == 0;
}

}  // namespace

int main() {
  int passed = 0;
  int failed = 0;
  const auto count = [&](bool ok) { ok ? ++passed : ++failed; };
  count(check_all_floats(
      "float_to_e4m3_satfinite_fast",
      [](float x) { return vllm_kv::float_to_e4m3_satfinite_fast(x); },
      [](float x) { return vllm_kv::float_to_e4m3_satfinite(x); }));
  count(check_all_floats(
      "float_to_e5m2_satfinite_fast",
      [](float x) { return vllm_kv::float_to_e5m2_satfinite_fast(x); },
      [](float x) { return vllm_kv::float_to_e5m2_satfinite(x); }));
  count(check_all_floats(
      "float_to_e2m1_fast", [](float x) { return vllm_kv::float_to_e2m1_fast(x); },
      [](float x) { return vllm_kv::float_to_e2m1(x); }));
  count(check_all_floats(
      "float_to_e2m1_not_nan (non-NaN inputs)",
      [](float x) { return vllm_kv::is_nan(x) ? 0u : uint32_t(vllm_kv::float_to_e2m1_not_nan(x)); },
      [](float x) { return vllm_kv::is_nan(x) ? 0u : uint32_t(vllm_kv::float_to_e2m1(x)); }));
  {
    int bad = 0;
    for (int b = 0; b < 256; ++b) {
      const float ref = vllm_kv::e4m3_to_float(uint8_t(b));
      const float fast = vllm_kv::e4m3_to_float_fast(uint8_t(b));
      const bool same = vllm_kv::is_nan(ref)
                            ? vllm_kv::is_nan(fast)
                            : vllm_kv::float_as_bits(ref) == vllm_kv::float_as_bits(fast);
      bad += same ? 0 : 1;
    }
    std::printf("%-40s %s (%d mismatches of 256)\n", "e4m3_to_float_fast", bad ? "FAILED" : "ok",
                bad);
    count(bad == 0);
  }
  count(check_groups(4000000));
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
