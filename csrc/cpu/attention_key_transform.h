// Keys stored before RoPE, rebuilt in the CPU attention kernels' decoded key tiles: sink keys, the
// fixed Hadamard rotation, per-head offsets, the forward RoPE. Each step is the reference's own
// operations in its order (no fusion), so a rebuilt key is the reference's to the bit. A row
// that fills whole vectors (and whose rotary pairs do) is rebuilt in registers in one pass: a
// pass per step through the tile would make each step's loads wait on the previous step's wide
// stores. Other rows take the scalar loops.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "attention_kernels.h"
#include "cpu/attention_rows.h"
#include "cpu/attention_simd.h"

namespace vllm_kv::cpu::attention {

template <SimdLevel L>
class KeyRebuild {
 public:
  using V = VecF<L>;
  static constexpr int kN = kLanes<L>;
  // Most vectors a row rebuilt in registers may take.
  static constexpr int kMaxVectors = 16;

  // Whether a call's key rows are rebuilt in registers (whole vectors, rotary pairs of whole
  // vectors), by register_rows; otherwise by scalar_rows.
  static bool in_registers(const PagedAttentionParams& p) {
    const int dim = p.key_cache.head_size;
    const bool pairs_fit =
        p.rope_cos_sin == nullptr || (p.rope_is_neox ? p.rotary_dim / 2 : p.rotary_dim) % kN == 0;
    return dim % kN == 0 && dim / kN <= kMaxVectors && pairs_fit;
  }

  // Rebuilds the keys of tile rows [t0, t1) (positions page_start + t of sequence `seq`, KV head
  // `head`) from pre-RoPE keys: the sink key or the decoded key times the K scale (the reference
  // codec's value), rotated back by the Hadamard rotation, plus the head's offset, then RoPE by
  // the rope_cos_sin row of the key's position. key(t, d): vector d of page row t's decoded key.
  template <typename Key>
  static void register_rows(const PagedAttentionParams& p, int seq, int head, int page_start,
                            int t0, int t1, const Key& key, float* tile, int row_stride) {
    const Rebuild r(p, seq, head, page_start);
    const int vectors = r.dim / kN;
    const auto run = [&]<int kVectors>() {
      for (int t = t0; t < t1; ++t) {
        register_row<kVectors>(r, t, key, tile + int64_t(t) * row_stride);
      }
    };
    [&]<int... kR>(std::integer_sequence<int, kR...>) {
      ((vectors == kR + 1 ? run.template operator()<kR + 1>() : void()), ...);
    }(std::make_integer_sequence<int, kMaxVectors>{});
  }

  // The same rebuild element by element, in place on tile rows [t0, t1) decoded by decode_page.
  static void scalar_rows(const PagedAttentionParams& p, int seq, int head, int page_start, int t0,
                          int t1, float* tile, int row_stride) {
    const Rebuild r(p, seq, head, page_start);
    for (int t = t0; t < t1; ++t) scalar_row(r, t, tile + int64_t(t) * row_stride);
  }

 private:
  using VI = VecI<L>;
  typedef float HalfV __attribute__((vector_size(sizeof(V) / 2)));

  // What rebuilds the rows of one (sequence, KV head, page).
  struct Rebuild {
    Rebuild(const PagedAttentionParams& p, int seq, int head, int page_start)
        : p(p),
          dim(p.key_cache.head_size),
          half(p.rotary_dim / 2),
          page_start(page_start),
          k_scale(side_scale(p.key_cache, head, p.cache_kind)),
          offset(p.key_offset != nullptr ? p.key_offset + int64_t(head) * dim : nullptr),
          sinks(p.sink_keys == nullptr
                    ? nullptr
                    : p.sink_keys +
                          (int64_t(seq) * p.num_sink_keys * p.num_kv_heads + head) * dim) {}

    // Page row t's sink key (fp32, dim values), or nullptr when it is the cache's.
    const float* sink(int t) const {
      const int position = page_start + t;
      return position < p.num_sink_keys ? sinks + int64_t(position) * p.num_kv_heads * dim
                                        : nullptr;
    }
    // Page row t's cos (half values), its sin after them.
    const float* cos(int t) const {
      return p.rope_cos_sin + int64_t(page_start + t) * p.rotary_dim;
    }

    const PagedAttentionParams& p;
    int dim;
    int half;
    int page_start;
    float k_scale;
    const float* offset;
    const float* sinks;
  };

  // A row of kVectors whole vectors, loaded once, rebuilt in registers, stored once. Every index
  // into v is a constant once the loops unroll, so that v stays in registers.
  template <int kVectors, typename Key>
  static void register_row(const Rebuild& r, int t, const Key& key, float* x) {
    V v[kVectors];
    const float* sink = r.sink(t);
#pragma GCC unroll 16
    for (int i = 0; i < kVectors; ++i) {
      v[i] = sink != nullptr ? load<L>(sink + i * kN) : key(t, i * kN) * splat<L>(r.k_scale);
    }
    if (r.p.key_hadamard) {
#pragma GCC unroll 16
      for (int i = 0; i < kVectors; ++i) v[i] = butterflies(v[i]);                 // spans below kN
      if constexpr (std::has_single_bit(unsigned(kVectors))) across<kVectors>(v);  // whole vectors
      const V c = splat<L>(hadamard_scale(r.dim));
#pragma GCC unroll 16
      for (int i = 0; i < kVectors; ++i) v[i] = v[i] * c;
    }
    if (r.offset != nullptr) {
#pragma GCC unroll 16
      for (int i = 0; i < kVectors; ++i) v[i] = v[i] + load<L>(r.offset + i * kN);
    }
    if (r.p.rope_cos_sin != nullptr) {
      const float* cos = r.cos(t);
      if (r.p.rope_is_neox) {
        neox(v, cos, cos + r.half, r.half / kN,
             std::make_integer_sequence<int, kVectors / 2 + 1>{});
      } else {  // pairs (2i, 2i + 1): neighbouring lanes, pair i's cos / sin in both
        const float* sin = cos + r.half;
#pragma GCC unroll 16
        for (int i = 0; i < kVectors; ++i) {
          if (i >= 2 * r.half / kN) break;
          const V c = twice(cos + i * kN / 2, std::make_index_sequence<kN>{});
          const V s = twice(sin + i * kN / 2, std::make_index_sequence<kN>{});
          const V swapped = swap_pairs(v[i], std::make_index_sequence<kN>{});
          v[i] = even_odd(v[i] * c - swapped * s, v[i] * c + swapped * s,
                          std::make_index_sequence<kN>{});
        }
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < kVectors; ++i) store<L>(x + i * kN, v[i]);
  }

  // The Hadamard levels whose spans are kH and more whole vectors, kH first.
  template <int kVectors, int kH = 1>
  static void across(V* v) {
    if constexpr (kH < kVectors) {
#pragma GCC unroll 16
      for (int i = 0; i < kVectors; i += 2 * kH) {
#pragma GCC unroll 16
        for (int j = i; j < i + kH; ++j) {
          const V a = v[j];
          const V b = v[j + kH];
          v[j] = a + b;
          v[j + kH] = a - b;
        }
      }
      across<kVectors, 2 * kH>(v);
    }
  }

  // RoPE pairs (i, i + half), half = span vectors: the one kS of kSpans that is span.
  template <int... kSpans>
  static void neox(V* v, const float* cos, const float* sin, int span,
                   std::integer_sequence<int, kSpans...>) {
    ((span == kSpans ? neox_span<kSpans>(v, cos, sin) : void()), ...);
  }

  template <int kSpan>
  static void neox_span(V* v, const float* cos, const float* sin) {
#pragma GCC unroll 16
    for (int i = 0; i < kSpan; ++i) {
      const V a = v[i];
      const V b = v[i + kSpan];
      const V c = load<L>(cos + i * kN);
      const V s = load<L>(sin + i * kN);
      v[i] = a * c - b * s;
      v[i + kSpan] = b * c + a * s;
    }
  }

  static void scalar_row(const Rebuild& r, int t, float* x) {
    const int dim = r.dim;
    if (const float* sink = r.sink(t)) {
      std::memcpy(x, sink, sizeof(float) * dim);
    } else {
      for (int d = 0; d < dim; ++d) x[d] *= r.k_scale;
    }
    if (r.p.key_hadamard) {
      for (int h = 1; h < dim; h *= 2) {
        for (int i = 0; i < dim; i += 2 * h) {
          for (int j = i; j < i + h; ++j) {
            const float a = x[j];
            const float b = x[j + h];
            x[j] = a + b;
            x[j + h] = a - b;
          }
        }
      }
      const float c = hadamard_scale(dim);
      for (int d = 0; d < dim; ++d) x[d] *= c;
    }
    if (r.offset != nullptr) {
      for (int d = 0; d < dim; ++d) x[d] += r.offset[d];
    }
    if (r.p.rope_cos_sin == nullptr) return;
    const float* cos = r.cos(t);
    const float* sin = cos + r.half;
    for (int i = 0; i < r.half; ++i) {
      float& a = x[r.p.rope_is_neox ? i : 2 * i];
      float& b = x[r.p.rope_is_neox ? i + r.half : 2 * i + 1];
      const float a0 = a;
      const float b0 = b;
      a = a0 * cos[i] - b0 * sin[i];
      b = b0 * cos[i] + a0 * sin[i];
    }
  }

  // fp32(1 / sqrt(dim)), as torch rounds it.
  static float hadamard_scale(int dim) { return float(1.0 / std::sqrt(double(dim))); }

  // The Hadamard butterfly levels of spans 1 .. kN / 2 inside one vector, span 1 first: lane j
  // with bit kH clear becomes x[j] + x[j + kH], its partner x[j] - x[j + kH].
  template <int kH = 1>
  static V butterflies(V x) {
    if constexpr (kH >= kN) {
      return x;
    } else {
      return butterflies<2 * kH>(butterfly<kH>(x, std::make_index_sequence<kN>{}));
    }
  }

  template <int kH, size_t... kI>
  static V butterfly(V x, std::index_sequence<kI...>) {
    const V partner = __builtin_shufflevector(x, x, int(kI ^ kH)...);
    const VI upper = {((kI & kH) != 0 ? -1 : 0)...};
    return upper != 0 ? partner - x : x + partner;
  }

  // (p[0], p[0], p[1], p[1], ...): kN / 2 floats at p, each twice.
  template <size_t... kI>
  static V twice(const float* p, std::index_sequence<kI...>) {
    HalfV h;
    std::memcpy(&h, p, sizeof(h));
    return __builtin_shufflevector(h, h, int(kI / 2)...);
  }

  template <size_t... kI>
  static V swap_pairs(V v, std::index_sequence<kI...>) {
    return __builtin_shufflevector(v, v, int(kI ^ 1)...);
  }

  // Even lanes of `even`, odd lanes of `odd`.
  template <size_t... kI>
  static V even_odd(V even, V odd, std::index_sequence<kI...>) {
    return __builtin_shufflevector(even, odd, int(kI % 2 == 0 ? kI : kI + kN)...);
  }
};

}  // namespace vllm_kv::cpu::attention
