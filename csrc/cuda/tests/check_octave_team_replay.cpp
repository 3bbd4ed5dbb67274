// Host replay of the CUDA Octave store's warp: write_octave_side (csrc/octave_slot.h) run by
// teams that visit each step's indices in other orders than the CPU op's one loop: the 32 lanes of
// a warp, each striding over the indices, lanes taken last to first; and every index backwards.
// The kernel's warp gives the bytes of the CPU op (and of the codec) only if no index of a step
// reads what another index of that step writes; an order-dependent step shows up here as bytes
// that differ from the one-loop team's. Framework-free; build with any C++17 compiler, e.g.
//   g++ -std=c++17 -O2 -I csrc csrc/cuda/tests/check_octave_team_replay.cpp -o /tmp/check
// Prints one line per case and "N passed, N failed"; exits non-zero on any mismatch.
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "octave_slot.h"

namespace {

using vllm_kv::OctaveScratch;
using vllm_kv::OctaveWriteArgs;
using vllm_kv::SourceType;

// A warp's lanes, last lane first, each striding over the step's indices.
struct ReversedLanesTeam {
  template <typename Fn>
  void run(int n, const Fn& fn) const {
    for (int lane = 31; lane >= 0; --lane) {
      for (int i = lane; i < n; i += 32) fn(i);
    }
  }
  template <typename Fn>
  void run2(int outer, int log2_inner, const Fn& fn) const {
    const int mask = (1 << log2_inner) - 1;
    run(outer << log2_inner, [&](int i) { fn(i >> log2_inner, i & mask); });
  }
};

struct BackwardsTeam {
  template <typename Fn>
  void run(int n, const Fn& fn) const {
    for (int i = n - 1; i >= 0; --i) fn(i);
  }
  template <typename Fn>
  void run2(int outer, int log2_inner, const Fn& fn) const {
    for (int o = outer - 1; o >= 0; --o) {
      for (int i = (1 << log2_inner) - 1; i >= 0; --i) fn(o, i);
    }
  }
};

template <typename Team>
std::vector<uint8_t> store(const Team& team, OctaveWriteArgs a, int slot_bytes) {
  std::vector<uint8_t> cache(size_t(a.num_slots) * a.num_heads * slot_bytes, 0xA5);
  a.cache = cache.data();
  OctaveScratch scratch;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    for (int h = 0; h < a.num_heads; ++h) {
      for (int side = 0; side < vllm_kv::kOctaveSides; ++side) {
        vllm_kv::write_octave_side<SourceType::kFloat32>(team, scratch, a, t, h, side);
      }
    }
  }
  return cache;
}

struct Case {
  int head_dim;
  int rope_dim;
  int value_bits;
  bool compact;
};

}  // namespace

int main() {
  const Case cases[] = {{256, 64, 4, false}, {256, 64, 3, false},  {256, 0, 3, true},
                        {192, 64, 3, false}, {128, 128, 4, false}, {512, 0, 4, false},
                        {64, 0, 3, true}};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int passed = 0, failed = 0;
  for (const Case& c : cases) {
    const int tokens = 64, heads = 2, d = c.head_dim;
    const int slot_bytes = vllm_kv::octave_slot_bytes(d, c.rope_dim, c.value_bits, c.compact);
    std::vector<float> key(size_t(tokens) * heads * d), value(key.size());
    for (size_t i = 0; i < key.size(); ++i) {
      key[i] = normal(rng) * (i % 37 == 0 ? 40.0f : 1.0f);
      value[i] = normal(rng);
    }
    for (int i = 0; i < d; ++i) key[i] = 0.0f;  // an all-zero row: scale 0
    std::vector<int32_t> signs(d / 32);
    for (int32_t& w : signs) w = int32_t(rng());
    std::vector<int64_t> slots(tokens);
    for (int t = 0; t < tokens; ++t) slots[t] = t % 9 == 4 ? -1 : tokens - 1 - t;

    OctaveWriteArgs a{};
    a.value = value.data();
    a.key = key.data();
    a.key_token_stride = a.value_token_stride = int64_t(heads) * d;
    a.key_head_stride = a.value_head_stride = d;
    a.block_stride = int64_t(16) * heads * slot_bytes;
    a.entry_stride = int64_t(heads) * slot_bytes;
    a.head_stride = slot_bytes;
    a.slot_mapping = slots.data();
    a.num_tokens = tokens;
    a.num_slots = tokens;
    a.num_heads = heads;
    a.head_dim = d;
    a.block_size = 16;
    a.value_type = SourceType::kFloat32;
    a.key_signs = a.value_signs = signs.data();
    a.rope_dim = c.compact ? 0 : c.rope_dim;
    a.value_bits = c.value_bits;
    a.compact = c.compact;

    const std::vector<uint8_t> serial = store(vllm_kv::SerialTeam{}, a, slot_bytes);
    const bool lanes_ok = store(ReversedLanesTeam{}, a, slot_bytes) == serial;
    const bool backwards_ok = store(BackwardsTeam{}, a, slot_bytes) == serial;
    const bool ok = lanes_ok && backwards_ok;
    std::printf("%s d=%d rope=%d v_bits=%d%s: reversed lanes %s, backwards %s\n",
                ok ? "PASS" : "FAIL", d, c.rope_dim, c.value_bits, c.compact ? " compact" : "",
                lanes_ok ? "same bytes" : "DIFFER", backwards_ok ? "same bytes" : "DIFFER");
    (ok ? passed : failed) += 1;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
