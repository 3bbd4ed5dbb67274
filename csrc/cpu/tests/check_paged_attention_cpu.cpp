// Torch-free check of the CPU attention kernels (csrc/cpu/paged_attention.h), built by
// tools/check_cpu_attention.sh for several instruction sets: every kernel is instantiated (all
// formats, every SIMD level the target has), and where the target has the bf16 dot path its
// exact conversions to bf16 are checked on every input: the 256 bytes of each FP8 format (32 in
// order, 64 at once, two rows paired) against the scalar decoders, and the E2M1 x block-scale
// table against the scalar product. Where it has AVX-512, the softmax exponential's AVX-512
// steps are checked against the AVX2 ones on every float x <= 0 and every NaN.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "cpu/attention_dispatch.h"

namespace attention = vllm_kv::cpu::attention;

void run_every_kernel(const vllm_kv::PagedAttentionParams& params,
                      const attention::AttentionPlan& plan, float* scratch) {
  attention::paged_attention(
      params, plan, scratch, vllm_kv::SimdLevel::kAuto,
      [](int64_t begin, int64_t end, int64_t, const auto& fn) { fn(begin, end); });
}

namespace {

// bf16 bits b represent x exactly (NaN: both NaN).
bool same_value(uint16_t b, float x) {
  const float y = std::bit_cast<float>(uint32_t(b) << 16);
  if (std::isnan(x)) return std::isnan(y);
  return std::bit_cast<uint32_t>(y) == std::bit_cast<uint32_t>(x);
}

int failures = 0;

void expect(bool ok, const char* what, int a, int b) {
  if (!ok && ++failures <= 10) std::printf("FAIL %s at (%d, %d)\n", what, a, b);
}

#if defined(VLLM_KV_HAVE_AVX512) && defined(VLLM_KV_HAVE_AVX2)
// vexp at AVX-512 (vrndscaleps / vscalefps) against AVX2 (the portable steps): the same bits
// on the softmax's inputs, s - max <= 0 (-0 and -inf included) or NaN.
void check_vexp() {
  using vllm_kv::SimdLevel;
  constexpr int kWide = attention::kLanes<SimdLevel::kAvx512>;
  constexpr int kNarrow = attention::kLanes<SimdLevel::kAvx2>;
  const auto check_from = [](uint64_t first, uint64_t last) {
    for (uint64_t base = first; base <= last; base += kWide) {
      alignas(64) uint32_t x[kWide];
      alignas(64) uint32_t wide[kWide];
      alignas(64) uint32_t narrow[kWide];
      for (int i = 0; i < kWide; ++i) x[i] = uint32_t(std::min(base + i, last));
      const auto w = attention::vexp<SimdLevel::kAvx512>(
          attention::load<SimdLevel::kAvx512>(reinterpret_cast<const float*>(x)));
      std::memcpy(wide, &w, sizeof(wide));
      for (int h = 0; h < kWide; h += kNarrow) {
        const auto n = attention::vexp<SimdLevel::kAvx2>(
            attention::load<SimdLevel::kAvx2>(reinterpret_cast<const float*>(x + h)));
        std::memcpy(narrow + h, &n, sizeof(n));
      }
      for (int i = 0; i < kWide; ++i) {
        expect(wide[i] == narrow[i], "vexp AVX-512 = AVX2", int(x[i] >> 16), int(x[i] & 0xFFFF));
      }
    }
  };
  check_from(0x80000000u, 0xFFFFFFFFu);  // -0 .. -inf, then the negative NaNs
  check_from(0x7F800001u, 0x7FFFFFFFu);  // the positive NaNs
  std::printf("softmax exp: AVX-512 = AVX2 on every x <= 0 and NaN\n");
}
#endif

#if defined(VLLM_KV_HAVE_AVX512_BF16)
template <vllm_kv::CacheKind K>
void check_fp8(const char* name, float (*decode)(uint8_t)) {
  // Every byte, in order and reversed (y of the pairs), through the three decodes.
  alignas(64) uint8_t bytes[256];
  alignas(64) uint8_t reversed[256];
  for (int i = 0; i < 256; ++i) {
    bytes[i] = uint8_t(i);
    reversed[i] = uint8_t(255 - i);
  }
  alignas(64) uint16_t bits[64];
  for (int chunk = 0; chunk < 256; chunk += 32) {
    _mm512_store_si512(bits, attention::fp8_to_bf16_x32<K>(bytes + chunk));
    for (int j = 0; j < 32; ++j)
      expect(same_value(bits[j], decode(uint8_t(chunk + j))), name, chunk + j, 0);
    __m512i pairs[2];
    attention::fp8_pairs_to_bf16<K>(bytes + chunk, reversed + chunk, pairs);
    for (int h = 0; h < 2; ++h) {
      _mm512_store_si512(bits, pairs[h]);
      for (int j = 0; j < 16; ++j) {
        const int x = chunk + 16 * h + j;
        expect(same_value(bits[2 * j], decode(uint8_t(x))), name, x, 1);
        expect(same_value(bits[2 * j + 1], decode(uint8_t(255 - x))), name, x, 2);
      }
    }
    attention::fp8_pairs_to_bf16<K>(bytes + chunk, nullptr, pairs);
    for (int h = 0; h < 2; ++h) {
      _mm512_store_si512(bits, pairs[h]);
      for (int j = 0; j < 16; ++j) {
        expect(same_value(bits[2 * j], decode(uint8_t(chunk + 16 * h + j))), name, chunk, 3);
        expect(bits[2 * j + 1] == 0, name, chunk, 4);
      }
    }
  }
  for (int chunk = 0; chunk < 256; chunk += 64) {
    __m512i halves[2];
    attention::fp8_to_bf16_x64<K>(bytes + chunk, halves);
    for (int h = 0; h < 2; ++h) {
      _mm512_store_si512(bits, halves[h]);
      for (int j = 0; j < 32; ++j) {
        expect(same_value(bits[j], decode(uint8_t(chunk + 32 * h + j))), name, chunk + j, 5);
      }
    }
  }
}
#endif

}  // namespace

int main() {
  for (int scale = 0; scale < 256; ++scale) {
    for (int code = 0; code < 16; ++code) {
      const uint16_t bits = uint16_t(attention::kScaledE2M1.bits[scale][2 * code] |
                                     attention::kScaledE2M1.bits[scale][2 * code + 1] << 8);
      expect(
          same_value(bits, attention::kE2M1Values[code] * vllm_kv::e4m3_to_float(uint8_t(scale))),
          "E2M1 x scale table", scale, code);
    }
  }
#if defined(VLLM_KV_HAVE_AVX512) && defined(VLLM_KV_HAVE_AVX2)
  check_vexp();
#endif
#if defined(VLLM_KV_HAVE_AVX512_BF16)
  check_fp8<vllm_kv::CacheKind::kFp8E4M3>("e4m3 -> bf16", vllm_kv::e4m3_to_float);
  check_fp8<vllm_kv::CacheKind::kFp8E5M2>("e5m2 -> bf16", attention::e5m2_to_float);
  std::printf("bf16 dot path: FP8 conversions checked on all 256 bytes of each format\n");
#else
  std::printf("bf16 dot path: not in this build (no AVX-512 BF16 + VBMI)\n");
#endif
  std::printf("%s: E2M1 x block-scale table checked on all 4096 entries\n",
              failures == 0 ? "PASS" : "FAIL");
  return failures == 0 ? 0 : 1;
}
