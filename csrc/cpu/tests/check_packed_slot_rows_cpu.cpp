// Torch-free check of the CPU row writers of TurboQuant and ultraquant_4bit slots
// (csrc/cpu/packed_slot_rows.h) and of Octave's slot-lanes writer (csrc/cpu/octave_slot_lanes.h,
// runs of kLanes slots, a partial run included) against the per-value writers and team steps the
// CUDA kernels run (turboquant_slot.h, ultraquant_slot.h,
// octave_slot.h), byte for byte, for the instruction set this file is
// compiled for (tools/check_cpu_kernels.sh builds it for AVX-512, AVX2 and SSE2): every key and
// value bit width, fp32 / fp16 / bf16 sources, head sizes that are and are not whole vectors,
// Octave's block, compact and 3- / 4-bit value formats with 0 to all rotary dims; random rows and
// adversarial ones (signed-zero extremes in either order, NaN first and later,
// Inf, constant rows, values on the decision boundaries, subnormals, scales at both ends of
// UE8M0's range, 2^-126 and 2^127).
//
//   g++ -std=c++20 -O3 -march=native -ffp-contract=off -I csrc
//       csrc/cpu/tests/check_packed_slot_rows_cpu.cpp -o /tmp/check_rows && /tmp/check_rows
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cpu/octave_slot_lanes.h"
#include "cpu/packed_slot_rows.h"

namespace {

using namespace vllm_kv;

constexpr int kTokens = 48;
constexpr int kHeads = 2;

// Rows of fp32 values: random normal, then each token an adversarial pattern over its heads.
std::vector<float> make_rows(int d, float spread, std::mt19937& rng, const float* boundaries,
                             int num_boundaries) {
  std::normal_distribution<float> normal(0.0f, spread);
  std::vector<float> x(size_t(kTokens) * kHeads * d);
  for (float& v : x) v = normal(rng);
  const float nan = bits_as_float(0x7FC00000u);
  const float inf = bits_as_float(0x7F800000u);
  for (int t = 0; t < kTokens; ++t) {
    float* row = x.data() + size_t(t) * kHeads * d;  // head 0 of token t
    switch (t % 12) {
      case 1:  // all positive with +0 then -0: the minimum is the first zero
      case 2:  // the same with -0 first
        for (int i = 0; i < d; ++i) row[i] = std::fabs(row[i]) + 0.5f;
        row[1] = t % 12 == 1 ? 0.0f : -0.0f;
        row[d - 1] = t % 12 == 1 ? -0.0f : 0.0f;
        break;
      case 3:  // all negative, the maximum a zero
        for (int i = 0; i < d; ++i) row[i] = -std::fabs(row[i]) - 0.5f;
        row[0] = -0.0f;
        row[d / 2] = 0.0f;
        break;
      case 4:
        row[0] = nan;
        break;
      case 5:
        row[d / 3] = nan;
        row[d - 1] = -inf;
        break;
      case 6:
        for (int i = 0; i < d; ++i) row[i] = 1.25f;
        break;
      case 7:
        for (int i = 0; i < d; ++i) row[i] = boundaries[i % num_boundaries];
        break;
      case 8:
        for (int i = 0; i < d; ++i) row[i] *= 1e-41f;  // subnormal
        break;
      case 9:
        for (int i = 0; i < d; ++i) row[i] *= 1e37f;  // scales near the top of fp32
        break;
      case 10:
        for (int i = 0; i < d; ++i) row[i] = 0.0f;
        break;
      case 11:  // UltraQuant's largest scale, 2^127
        for (int i = 0; i < d; ++i) row[i] = i % 3 == 0 ? 3e38f : row[i] * 1e37f;
        break;
      default:
        break;
    }
  }
  return x;
}

template <SourceType S>
std::vector<typename SourceTraits<S>::Storage> as_source(const std::vector<float>& x) {
  std::vector<typename SourceTraits<S>::Storage> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = SourceTraits<S>::from_float(x[i]);
  return out;
}

// A cache of kTokens slots of `slot_bytes`, one block of kTokens entries; token 5 skipped.
template <typename Args>
void set_geometry(Args& a, int d, int slot_bytes, const std::vector<int64_t>& slots,
                  uint8_t* cache) {
  a.key_token_stride = a.value_token_stride = int64_t(kHeads) * d;
  a.key_head_stride = a.value_head_stride = d;
  a.cache = cache;
  a.block_stride = int64_t(kTokens) * kHeads * slot_bytes;
  a.entry_stride = int64_t(kHeads) * slot_bytes;
  a.head_stride = slot_bytes;
  a.slot_mapping = slots.data();
  a.num_tokens = kTokens;
  a.num_slots = kTokens;
  a.num_heads = kHeads;
  a.head_dim = d;
  a.block_size = kTokens;
}

std::vector<int64_t> slot_order() {
  std::vector<int64_t> slots(kTokens);
  for (int t = 0; t < kTokens; ++t) slots[t] = (t * 7) % kTokens;
  slots[5] = -1;
  return slots;
}

template <SourceType VS>
bool check_turboquant(int d, int key_bits, int value_bits, std::mt19937& rng) {
  constexpr SourceType kKeyFp8 = VS;
  const bool fp8 = key_bits == kTurboQuantFp8KeyBits;
  float midpoints[kTurboQuantMaxMidpoints] = {};
  const int num_mid = fp8 ? 0 : (1 << key_bits) - 1;
  for (int m = 0; m < num_mid; ++m) midpoints[m] = -0.2f + 0.4f * float(m) / float(num_mid);
  const float edges[] = {0.0f, -0.0f, 448.0f, -500.0f, 1e-3f, midpoints[0], midpoints[1]};
  const std::vector<float> key = make_rows(d, fp8 ? 100.0f : 0.1f, rng, fp8 ? edges : midpoints,
                                           fp8 ? 7 : (num_mid > 0 ? num_mid : 1));
  const std::vector<float> value = make_rows(d, 3.0f, rng, edges, 7);
  std::vector<float> norms(size_t(kTokens) * kHeads);
  for (size_t i = 0; i < norms.size(); ++i) norms[i] = 0.5f + float(i);
  const auto key_source = as_source<kKeyFp8>(key);
  const auto value_source = as_source<VS>(value);
  const int slot_bytes = turboquant_key_bytes(d, key_bits) + d * value_bits / 8 + 4;
  std::vector<uint8_t> want(size_t(kTokens) * kHeads * slot_bytes, 0x5A), got = want;
  const std::vector<int64_t> slots = slot_order();
  TurboQuantWriteArgs a{};
  a.value = value_source.data();
  a.key = fp8 ? static_cast<const void*>(key_source.data()) : key.data();
  a.key_norms = norms.data();
  a.midpoints = midpoints;
  a.key_bits = key_bits;
  a.value_bits = value_bits;
  a.value_type = VS;
  const auto run = [&](uint8_t* cache, bool rows) {
    set_geometry(a, d, slot_bytes, slots, cache);
    dispatch_turboquant_types(fp8, VS, [&](auto ks, auto vs) {
      for (int t = 0; t < kTokens; ++t) {
        for (int h = 0; h < kHeads; ++h) {
          if (rows) {
            cpu::write_turboquant_slot_rows<decltype(ks)::value, decltype(vs)::value>(a, t, h);
          } else {
            write_turboquant_slot<decltype(ks)::value, decltype(vs)::value>(a, t, h);
          }
        }
      }
    });
  };
  run(want.data(), false);
  run(got.data(), true);
  const bool ok = want == got;
  if (!ok) {
    std::printf("FAILED turboquant d=%d key_bits=%d value_bits=%d source=%d\n", d, key_bits,
                value_bits, int(VS));
  }
  return ok;
}

template <SourceType VS>
bool check_ultraquant(int d, float constant_c, std::mt19937& rng) {
  const float edges[] = {0.25f, -0.25f, 0.75f, -5.0f, 5.0f, 2.5f, -1.75f, 0.0f};
  const std::vector<float> key = make_rows(d, 2.0f, rng, edges, 8);
  const std::vector<float> value = make_rows(d, 0.5f, rng, edges, 8);
  const auto value_source = as_source<VS>(value);
  const int slot_bytes = d + 2 * (d / kUltraQuantGroup);
  std::vector<uint8_t> want(size_t(kTokens) * kHeads * slot_bytes, 0x5A), got = want;
  const std::vector<int64_t> slots = slot_order();
  UltraQuantWriteArgs a{};
  a.value = value_source.data();
  a.key = key.data();
  a.constant_c = constant_c;
  a.value_type = VS;
  set_geometry(a, d, slot_bytes, slots, want.data());
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHeads; ++h) {
      for (int unit = 0; unit < ultraquant_units(d); ++unit)
        write_ultraquant_unit<VS>(a, t, h, unit);
    }
  }
  set_geometry(a, d, slot_bytes, slots, got.data());
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHeads; ++h) cpu::write_ultraquant_slot_rows<VS>(a, t, h);
  }
  const bool ok = want == got;
  if (!ok) {
    std::printf("FAILED ultraquant d=%d c=%g source=%d\n", d, double(constant_c), int(VS));
  }
  return ok;
}

template <SourceType S>
bool check_octave(int d, int rope_dim, int value_bits, bool compact, std::mt19937& rng) {
  const float edges[] = {0.0f, 1e-20f, -3.5f, 1e30f, 2.0f, -0.0f, 7.0f};
  std::vector<float> key = make_rows(d, 1.0f, rng, edges, 7);
  const std::vector<float> value = make_rows(d, 2.0f, rng, edges, 7);
  for (size_t i = 0; i < key.size(); i += 37) key[i] *= 40.0f;  // outlier channels
  const auto key_source = as_source<S>(key);
  const auto value_source = as_source<S>(value);
  std::vector<int32_t> signs(d / 32);
  for (int32_t& w : signs) w = int32_t(rng());
  const int slot_bytes = octave_slot_bytes(d, rope_dim, value_bits, compact);
  std::vector<uint8_t> want(size_t(kTokens) * kHeads * slot_bytes, 0x5A), got = want;
  const std::vector<int64_t> slots = slot_order();
  OctaveWriteArgs a{};
  a.value = value_source.data();
  a.key = key_source.data();
  a.value_type = S;
  a.key_signs = a.value_signs = signs.data();
  a.rope_dim = rope_dim;
  a.value_bits = value_bits;
  a.compact = compact;
  OctaveScratch scratch;
  set_geometry(a, d, slot_bytes, slots, want.data());
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHeads; ++h) {
      for (int side = 0; side < kOctaveSides; ++side) {
        write_octave_side<S>(SerialTeam{}, scratch, a, t, h, side);
      }
    }
  }
  set_geometry(a, d, slot_bytes, slots, got.data());
  const auto lanes = std::make_unique<cpu::OctaveSlotLanes>();
  // A run of 3 slots first, so that the later runs start mid-token and the last one is partial.
  for (int64_t first = 0, count = 3; first < int64_t(kTokens) * kHeads; first += count) {
    count = std::min<int64_t>(first == 0 ? 3 : cpu::kLanes, int64_t(kTokens) * kHeads - first);
    cpu::write_octave_slots<S>(a, *lanes, first, int(count));
  }
  const bool ok = want == got;
  if (!ok) {
    std::printf("FAILED octave d=%d rope=%d value_bits=%d%s source=%d\n", d, rope_dim, value_bits,
                compact ? " compact" : "", int(S));
  }
  return ok;
}

}  // namespace

int main() {
  std::printf("vector width: %d bytes\n", cpu::kVecBytes);
  std::mt19937 rng(2026);
  int passed = 0, failed = 0;
  const auto count = [&](bool ok) { ok ? ++passed : ++failed; };
  for (const int d : {8, 40, 64, 72, 96, 128, 256}) {
    for (const int key_bits : {3, 4, kTurboQuantFp8KeyBits}) {
      for (const int value_bits : {3, 4}) {
        count(check_turboquant<SourceType::kFloat32>(d, key_bits, value_bits, rng));
        count(check_turboquant<SourceType::kFloat16>(d, key_bits, value_bits, rng));
        count(check_turboquant<SourceType::kBFloat16>(d, key_bits, value_bits, rng));
      }
    }
  }
  for (const int d : {32, 64, 128, 256}) {
    for (const float c : {0.5f, 1.0f / 6.0f, 1.0f, 20.0f, 3e-39f}) {
      count(check_ultraquant<SourceType::kFloat32>(d, c, rng));
      count(check_ultraquant<SourceType::kFloat16>(d, c, rng));
      count(check_ultraquant<SourceType::kBFloat16>(d, c, rng));
    }
  }
  for (const int d : {64, 128, 192, 256, 512}) {
    for (const int value_bits : {3, 4}) {
      for (int rope_dim = 0; rope_dim <= d; rope_dim += d / 2 >= 64 ? d / 2 / 64 * 64 : 64) {
        count(check_octave<SourceType::kFloat32>(d, rope_dim, value_bits, false, rng));
        count(check_octave<SourceType::kBFloat16>(d, rope_dim, value_bits, false, rng));
      }
    }
    if ((d & (d - 1)) == 0) {
      count(check_octave<SourceType::kFloat16>(d, 0, 3, true, rng));
      count(check_octave<SourceType::kFloat32>(d, 0, 3, true, rng));
    }
  }
  std::printf(
      "row writers and slot lanes == per-value writers and team steps: %d passed, %d failed\n",
      passed, failed);
  return failed == 0 ? 0 : 1;
}
