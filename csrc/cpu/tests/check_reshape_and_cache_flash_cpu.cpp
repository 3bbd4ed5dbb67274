// Torch-free check and micro-benchmark of the CPU reshape_and_cache_flash kernels
// (csrc/cpu/reshape_and_cache_flash.h) for the instruction set this file is compiled for: build it
// with -march=native (AVX-512 here), -march=x86-64-v3 (AVX2) and -march=x86-64 (the portable
// path) to check every path the extension can be built with (tools/check_cpu_kernels.sh).
//
//   check (default): the vector encoders against the scalar ones of kv_quant_math.h on every fp32
//     (and every 16-bit) input; then random problems (flash_test_problem.h: dtypes, kinds, head
//     sizes, NHD / HND, padded pages, strides, misalignment, skipped slots, linear / interleave4
//     scales, key sink rows) and adversarial NVFP4 groups, whole cache images compared byte for
//     byte with the independent scalar reference FlashTestProblem::expected.
//   bench | bench-cold  T H D [reps]: one thread, bf16 -> FP8 e4m3 and NVFP4, NHD, cache-resident
//     or cold (caches flushed before every call); best ns per element.
//
//   g++ -std=c++20 -O3 -march=native -ffp-contract=off -fopenmp -I csrc
//       csrc/cpu/tests/check_reshape_and_cache_flash_cpu.cpp -o /tmp/check_cpu && /tmp/check_cpu
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/reshape_and_cache_flash.h"
#include "cuda/tests/flash_test_problem.h"

namespace {

using namespace vllm_kv;

// Every fp32 bit pattern through the vector encoder `vec` (kLanes at a time) and the scalar
// `ref`; lanes where skip(bits) holds are not compared.
template <typename Vector, typename Scalar, typename Skip>
bool check_all_floats(const char* name, Vector vec, Scalar ref, Skip skip) {
  int64_t mismatches = 0;
  uint32_t first_bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : mismatches)
  for (int64_t hi = 0; hi < (int64_t(1) << 16); ++hi) {
    for (uint32_t lo = 0; lo < (1u << 16); lo += cpu::kLanes) {
      cpu::U32v bits;
      for (int l = 0; l < cpu::kLanes; ++l) bits[l] = (uint32_t(hi) << 16) | (lo + l);
      const cpu::U32v got = vec(std::bit_cast<cpu::F32v>(bits));
      for (int l = 0; l < cpu::kLanes; ++l) {
        if (!skip(bits[l]) && got[l] != uint32_t(ref(bits_as_float(bits[l])))) {
          if (mismatches == 0) {
#pragma omp critical
            first_bad = bits[l];
          }
          ++mismatches;
        }
      }
    }
  }
  std::printf("%-44s %s (%" PRId64 " mismatches of 2^32", name, mismatches ? "FAILED" : "ok",
              mismatches);
  if (mismatches) std::printf(", e.g. bits 0x%08x", first_bad);
  std::printf(")\n");
  return mismatches == 0;
}

bool check_e4m3_decode() {
  int bad = 0;
  for (uint32_t b0 = 0; b0 < 256; b0 += cpu::kLanes) {
    cpu::U32v bytes;
    for (int l = 0; l < cpu::kLanes; ++l) bytes[l] = b0 + l;
    const cpu::U32v got = std::bit_cast<cpu::U32v>(cpu::e4m3_to_float(bytes));
    for (int l = 0; l < cpu::kLanes; ++l) {
      const float ref = e4m3_to_float(uint8_t(b0 + l));
      bad += is_nan(ref) ? !is_nan(bits_as_float(got[l])) : got[l] != float_as_bits(ref);
    }
  }
  std::printf("%-44s %s (%d mismatches of 256)\n", "e4m3_to_float (vector)", bad ? "FAILED" : "ok",
              bad);
  return bad == 0;
}

const auto kSerial = [](int64_t begin, int64_t end, int64_t, const auto& fn) { fn(begin, end); };
// One thread taking the tasks of grain tokens one after the other, as the op's parallel-for does.
const auto kSerialTasks = [](int64_t begin, int64_t end, int64_t grain, const auto& fn) {
  for (int64_t b = begin; b < end; b += grain) fn(b, std::min(end, b + grain));
};

// The CPU op rejects out-of-range slots and non-finite or non-positive scales before the kernel
// runs (cache_ops_cpu.cpp): such problems are turned into valid ones.
void make_cpu_valid(test::FlashTestProblem& t) {
  const int64_t num_slots = int64_t(t.shape.num_blocks) * t.shape.block_size;
  for (int64_t& s : t.slots) s = s >= num_slots ? -1 : s;
  for (auto* scales : {&t.k_scale, &t.v_scale}) {
    for (float& s : *scales) s = std::isfinite(s) && s > 0.0f ? s : 0.125f;
  }
}

bool run_problem(test::FlashTestProblem& t, const char* what) {
  make_cpu_valid(t);
  test::Bytes cache(t.cache.size());
  std::memcpy(cache.data(), t.cache.data(), t.cache.size());
  const ReshapeAndCacheParams p =
      t.params(cache.data(), t.key.data(), t.value.data(), t.slots.data(), t.k_scale.data(),
               t.v_scale.data(), t.sink_scale.data(), t.k_signs.data(), t.v_signs.data());
  cpu::reshape_and_cache_flash(p, kSerial);
  const test::Bytes expected = t.expected();
  for (size_t i = 0; i < cache.size(); ++i) {
    if (cache.data()[i] != expected.data()[i]) {
      std::printf("FAILED %s %s: first differing byte %zu (kernel %02x, reference %02x)\n", what,
                  t.describe().c_str(), i, cache.data()[i], expected.data()[i]);
      return false;
    }
  }
  return true;
}

bool check_random_problems(int num_problems) {
  std::mt19937_64 rng(4242);
  int failed = 0;
  for (int i = 0; i < num_problems && failed < 5; ++i) {
    test::FlashTestProblem t = test::make_random_problem(rng);
    failed += run_problem(t, "random") ? 0 : 1;
  }
  std::printf("%-44s %s (%d problems)\n", "random problems == scalar reference",
              failed ? "FAILED" : "ok", num_problems);
  return failed == 0;
}

// NVFP4 problems whose groups are built to hit E2M1 ties and thresholds, saturated and subnormal
// block scales, zero groups, NaN and Inf, with odd numbers of heads (chunk tails).
bool check_adversarial_nvfp4(int num_problems) {
  std::mt19937_64 rng(777);
  int failed = 0;
  for (int n = 0; n < num_problems && failed < 5; ++n) {
    const int heads = 1 + int(rng() % 7);
    const int head_size = 16 * (1 + int(rng() % 16));
    const SourceType source = SourceType(rng() % 3);
    test::FlashTestProblem t = test::make_dense_problem(
        source, CacheKind::kNvfp4, 1 + int(rng() % 40), heads, head_size, 16, rng() % 2, rng);
    t.shape.per_head = rng() % 2;
    t.k_scale.assign(t.shape.per_head ? heads : 1, 1.0f);
    t.v_scale.assign(t.k_scale.size(), 1.0f);
    for (auto* scales : {&t.k_scale, &t.v_scale}) {
      for (float& s : *scales) {
        // 1e-40: a subnormal global scale, whose inverse overflows to Inf.
        const int pick = int(rng() % 5);
        s = pick == 0   ? 1.0f
            : pick == 1 ? std::ldexp(1.0f, int(rng() % 60) - 30)
            : pick == 2 ? 1e-40f
                        : 1e-3f;
      }
    }
    for (test::Bytes* image : {&t.key, &t.value}) {
      const size_t elems = image->size() / t.src_size;
      for (size_t g = 0; g + 16 <= elems; g += 16) {
        const int mode = int(rng() % 6);
        const float unit = std::ldexp(1.0f, int(rng() % 40) - 20);
        for (size_t i = g; i < g + 16; ++i) {
          float x;
          switch (mode) {
            case 0:  // multiples of 1/8 of the group maximum: E2M1 ties after scaling
              x = unit * float(int(rng() % 97) - 48) * 0.125f;
              break;
            case 1:
              x = unit * (i == g ? 6.0f : float(int(rng() % 25) - 12) * 0.25f);
              break;
            case 2:
              x = rng() % 4 ? 0.0f : test::random_float(rng);
              break;
            case 3:  // tiny: subnormal block scales
              x = std::ldexp(float(int(rng() % 17) - 8), -int(rng() % 30) - 110);
              break;
            case 4:  // huge: saturated block scales
              x = std::ldexp(float(int(rng() % 17) - 8), int(rng() % 20) + 100);
              break;
            default:
              x = test::random_float(rng);
          }
          if (t.src_size == 4) {
            std::memcpy(image->data() + i * 4, &x, 4);
          } else {
            const uint16_t h = source == SourceType::kBFloat16 ? test::float_to_bf16_bits(x)
                                                               : test::float_to_fp16_bits(x);
            std::memcpy(image->data() + i * 2, &h, 2);
          }
        }
      }
    }
    failed += run_problem(t, "adversarial") ? 0 : 1;
  }
  std::printf("%-44s %s (%d problems)\n", "adversarial NVFP4 == scalar reference",
              failed ? "FAILED" : "ok", num_problems);
  return failed == 0;
}

// One thread in the op's tasks, bf16 -> FP8 e4m3 and NVFP4, NHD, pages in random order (as a
// prefill writes them), the default scale layout.
// Cold: a 64 MiB buffer (twice this machine's L3) is written before every timed call, so that
// the call reads its source and cache lines from memory.
int bench(int tokens, int heads, int head_size, int reps, bool cold) {
  std::mt19937_64 rng(1);
  std::vector<uint8_t> flush(cold ? size_t(64) << 20 : 0);
  for (const CacheKind kind : {CacheKind::kFp8E4M3, CacheKind::kNvfp4}) {
    test::FlashTestProblem t = test::make_dense_problem(SourceType::kBFloat16, kind, tokens, heads,
                                                        head_size, 16, false, rng);
    // The scale layout the op picks when the caller names none.
    t.shape.interleave4_k = t.shape.interleave4_v =
        kind == CacheKind::kNvfp4 &&
        default_scale_layout(16, head_size) == ScaleLayout::kInterleave4;
    std::vector<int64_t> pages(t.shape.num_blocks);
    for (size_t b = 0; b < pages.size(); ++b) pages[b] = int64_t(b);
    std::shuffle(pages.begin(), pages.end(), rng);
    for (int i = 0; i < tokens; ++i) t.slots[i] = pages[i / 16] * 16 + i % 16;
    const ReshapeAndCacheParams p =
        t.params(t.cache.data(), t.key.data(), t.value.data(), t.slots.data(), t.k_scale.data(),
                 t.v_scale.data(), t.sink_scale.data(), t.k_signs.data(), t.v_signs.data());
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      for (size_t i = 0; i < flush.size(); i += 64) flush[i] += 1;
      const auto t0 = std::chrono::steady_clock::now();
      cpu::reshape_and_cache_flash(p, kSerialTasks);
      best = std::min(best,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const double elements = 2.0 * tokens * heads * head_size;
    std::printf("%-6s T=%d H=%d D=%d %s: best of %d %.1f us, %.3f ns/element\n",
                kind == CacheKind::kNvfp4 ? "nvfp4" : "fp8", tokens, heads, head_size,
                cold ? "cold" : "warm", reps, best * 1e6, best * 1e9 / elements);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && (std::string(argv[1]) == "bench" || std::string(argv[1]) == "bench-cold")) {
    return bench(argc > 2 ? std::atoi(argv[2]) : 256, argc > 3 ? std::atoi(argv[3]) : 8,
                 argc > 4 ? std::atoi(argv[4]) : 128, argc > 5 ? std::atoi(argv[5]) : 20,
                 std::string(argv[1]) == "bench-cold");
  }
  std::printf("vector width: %d bytes\n", cpu::kVecBytes);
  int passed = 0, failed = 0;
  const auto count = [&](bool ok) { ok ? ++passed : ++failed; };
  const auto never = [](uint32_t) { return false; };
  count(check_all_floats(
      "float_to_e2m1_not_nan (vector, non-NaN)",
      [](cpu::F32v v) { return cpu::float_to_e2m1_not_nan(v); }, float_to_e2m1,
      [](uint32_t bits) { return (bits & 0x7FFFFFFFu) > 0x7F800000u; }));
  count(check_all_floats(
      "float_to_e4m3_satfinite (vector)",
      [](cpu::F32v v) { return cpu::float_to_e4m3_satfinite(v); }, float_to_e4m3_satfinite, never));
  count(check_all_floats(
      "float_to_int8_rne_sat (vector, non-NaN)",
      [](cpu::F32v v) { return cpu::float_to_int8_rne_sat(v); }, float_to_int8_rne_sat,
      [](uint32_t bits) { return (bits & 0x7FFFFFFFu) > 0x7F800000u; }));
  count(check_e4m3_decode());
#if defined(__AVX512BW__)
  // bf16_pair_e2m1 on x = +-1.0 and m = |v|: both codes of dword l must be float_to_e2m1(v[l]).
  count(check_all_floats(
      "bf16_pair_e2m1 (AVX-512, non-NaN)",
      [](cpu::F32v v) {
        const cpu::U32v bits = std::bit_cast<cpu::U32v>(v);
        const cpu::U32v one = 0x3F80u | ((bits >> 16) & 0x8000u);  // bf16 +-1.0
        const __m512i table[2] = {_mm512_loadu_si512(cpu::kE2M1ByIndex),
                                  _mm512_loadu_si512(cpu::kE2M1ByIndex + 32)};
        const cpu::U32v codes = std::bit_cast<cpu::U32v>(
            cpu::bf16_pair_e2m1(std::bit_cast<__m512i>(one | (one << 16)),
                                std::bit_cast<__m512>(bits & 0x7FFFFFFFu), table));
        return (codes >> 16) == (codes & 0xFFFFu) ? codes & 0xFFFFu : cpu::U32v{} + 0xFFu;
      },
      float_to_e2m1, [](uint32_t bits) { return (bits & 0x7FFFFFFFu) > 0x7F800000u; }));
#endif
  count(check_random_problems(6000));
  count(check_adversarial_nvfp4(3000));
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
