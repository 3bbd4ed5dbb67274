// CPU reshape_and_cache_flash (docs/design.md §6). Framework-free: the torch glue validates the
// arguments, fills a ReshapeAndCacheParams and passes in the parallel-for (at::parallel_for) that
// splits the tokens among threads. FP8 bytes come from the scalar code of kv_quant_math.h (in
// loops the compiler vectorises); NVFP4 from the lane-parallel encoders of nvfp4_lanes.h, the
// instruction set being the build's (-march). Global scales below 2^-128 (whose inverse is Inf)
// take the scalar nvfp4_quantize_group. Every address comes from cache_layout.h, through a
// per-call plan of per-group offsets (Nvfp4SidePlan). Key sink rows (key_sink_rows.h) are
// written with the token's K rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cache_kernels.h"
#include "cache_layout.h"
#include "cpu/nvfp4_lanes.h"
#include "cpu/per_token_head_lanes.h"
#include "dispatch_utils.h"
#include "int4_per_token_head.h"
#include "key_sink_rows.h"
#include "kv_quant_math.h"
#include "per_token_head.h"

namespace vllm_kv::cpu {

// Page and row of a slot (slot >= 0).
struct SlotPosition {
  int64_t block;
  int64_t token;
};

inline SlotPosition slot_position(int64_t slot, int block_size) {
  const int64_t block = slot / block_size;
  return {block, slot - block * block_size};
}

template <CacheKind K>
inline uint8_t fp8_encode(float x) {  // the scalar encoders, not nvfp4_lanes.h's vector ones
  if constexpr (K == CacheKind::kFp8E4M3) {
    return vllm_kv::float_to_e4m3_satfinite(x);
  } else {
    return vllm_kv::float_to_e5m2_satfinite(x);
  }
}

inline float head_scale(const CacheSide& side, int head) {
  return side.scale[side.scale_per_head ? head : 0];
}

// What the quantizers of one NVFP4 side need besides the data, computed once per call before the
// tokens are split among threads. Group q = head * num_groups + group of a token has its scale byte
// at layout.scale_offset(block, token, 0, 0, scale_layout) + scale_offsets[q] and its data at
// layout.data_offset(block, token, 0) + data_offsets[q]: both addresses are a per-token base plus
// a per-group offset (cache_layout.h), so the slot loop needs no per-group address arithmetic.
struct Nvfp4SidePlan {
  CacheSide side;
  Nvfp4SideLayout layout;
  int num_heads;
  // kv_fdiv(1, global scale) per group, padded with 1 to whole chunks, and whether one is
  // infinite (a scale below 2^-128).
  std::vector<float> inv_scales;
  bool any_infinite = false;
  std::vector<int64_t> scale_offsets;
  std::vector<int64_t> data_offsets;
  bool scales_contiguous = true;  // scale_offsets[q] == q (linear scales, NHD)
  bool data_contiguous = true;    // data_offsets[q] == 8q (NHD)
#if defined(__AVX512VBMI__)
  // Scattered (interleave4 or HND) scale bytes go out as masked 64-byte stores: window w covers
  // bytes [offset, offset + 64) from the token's scale base, byte i (if mask bit i) taken from
  // entry index[i] of its chunk's scale bytes. Chunk c's windows: [chunk_windows[c],
  // chunk_windows[c + 1]).
  struct ScaleWindow {
    int64_t offset;
    uint64_t mask;
    uint8_t index[64];
  };
  std::vector<ScaleWindow> windows;
  std::vector<int> chunk_windows;
#endif

  Nvfp4SidePlan(const CacheSide& cache_side, int block_size, int heads)
      : side(cache_side), layout(cache_side, block_size, heads), num_heads(heads) {
    const int num_groups = layout.num_groups;
    const int total = num_heads * num_groups;
    inv_scales.assign(round_up(total, kNvfp4Chunk), 1.0f);
    scale_offsets.resize(total);
    data_offsets.resize(total);
    const int64_t scale_base = layout.scale_offset(0, 0, 0, 0, side.scale_layout);
    for (int h = 0; h < num_heads; ++h) {
      const float inv = kv_fdiv(1.0f, head_scale(side, h));
      any_infinite |= std::isinf(inv);
      for (int g = 0; g < num_groups; ++g) {
        const int q = h * num_groups + g;
        inv_scales[q] = inv;
        scale_offsets[q] = layout.scale_offset(0, 0, h, g, side.scale_layout) - scale_base;
        data_offsets[q] = layout.data_offset(0, 0, h) + g * (kNvfp4GroupSize / 2);
        scales_contiguous &= scale_offsets[q] == q;
        data_contiguous &= data_offsets[q] == q * (kNvfp4GroupSize / 2);
      }
    }
#if defined(__AVX512VBMI__)
    for (int first = 0; first < total; first += kNvfp4Chunk) {
      chunk_windows.push_back(int(windows.size()));
      std::vector<std::pair<int64_t, int>> entries;  // (offset, index in the chunk), by offset
      for (int k = 0; k < std::min(kNvfp4Chunk, total - first); ++k) {
        entries.emplace_back(scale_offsets[first + k], k);
      }
      std::sort(entries.begin(), entries.end());
      for (const auto& [offset, k] : entries) {
        const bool first_of_chunk = windows.size() == size_t(chunk_windows.back());
        if (first_of_chunk || offset >= windows.back().offset + 64) {
          windows.push_back({offset, 0, {}});
        }
        ScaleWindow& w = windows.back();
        w.mask |= uint64_t{1} << (offset - w.offset);
        w.index[offset - w.offset] = uint8_t(k);
      }
    }
    chunk_windows.push_back(int(windows.size()));
#endif
  }
};

// Stores the scale bytes and packed data of the chunk of groups [first, first + n) of a token
// (first a multiple of kNvfp4Chunk, n the chunk's size, scale_bytes kNvfp4Chunk long).
inline void store_nvfp4_chunk(const Nvfp4SidePlan& plan, int64_t block, int token, int first, int n,
                              const uint8_t* scale_bytes, const uint8_t* packed) {
  constexpr int kPacked = kNvfp4GroupSize / 2;
  uint8_t* cache = static_cast<uint8_t*>(plan.side.data);
  uint8_t* scales = cache + plan.layout.scale_offset(block, token, 0, 0, plan.side.scale_layout);
  uint8_t* data = cache + plan.layout.data_offset(block, token, 0);
  if (plan.scales_contiguous) {
    std::memcpy(scales + first, scale_bytes, n);
  } else {
#if defined(__AVX512VBMI__)
    const __m512i bytes = _mm512_loadu_si512(scale_bytes);
    const int chunk = first / kNvfp4Chunk;
    for (int w = plan.chunk_windows[chunk]; w < plan.chunk_windows[chunk + 1]; ++w) {
      const Nvfp4SidePlan::ScaleWindow& window = plan.windows[w];
      // (maskz with all lanes: the same vpermb; GCC 12 warns about the unmasked form's
      // undefined pass-through.)
      _mm512_mask_storeu_epi8(
          scales + window.offset, window.mask,
          _mm512_maskz_permutexvar_epi8(~__mmask64(0), _mm512_loadu_si512(window.index), bytes));
    }
#else
    const int64_t* offsets = plan.scale_offsets.data() + first;
    for (int k = 0; k < n; ++k) scales[offsets[k]] = scale_bytes[k];
#endif
  }
  if (plan.data_contiguous) {
    std::memcpy(data + first * kPacked, packed, n * kPacked);
  } else {
    const int64_t* offsets = plan.data_offsets.data() + first;
    for (int k = 0; k < n; ++k) std::memcpy(data + offsets[k], packed + k * kPacked, kPacked);
  }
}

// Quantizes the chunk of groups [first, first + n) of one token (docs/design.md §5, the steps of
// nvfp4_quantize_group) into a packed NVFP4 side, with the vector encoders (finite inverse global
// scales only). One pass per step: the vector max of each group, then the scale arithmetic of the
// whole chunk, then the E2M1 encoding. kFullChunk: n == kNvfp4Chunk, loops of constant length.
template <SourceType S, bool kFullChunk>
inline void quantize_nvfp4_chunk(const typename SourceTraits<S>::Storage* row,
                                 const Nvfp4SidePlan& plan, int64_t block, int token, int first,
                                 int chunk_groups) {
  constexpr int kChunk = kNvfp4Chunk;
  constexpr int kPacked = kNvfp4GroupSize / 2;
  const int n = kFullChunk ? kChunk : chunk_groups;
  const float* inv_scales = plan.inv_scales.data();
  const auto* x = row + int64_t(first) * kNvfp4GroupSize;  // a token's [H, D] is contiguous
  alignas(64) uint8_t scale_bytes[kChunk];
  alignas(64) uint8_t packed[kChunk * kPacked];
#if defined(__AVX512BW__)
  if constexpr (S == SourceType::kBFloat16) {
    // Zeroed only for GCC 12's flow analysis: every lane read below is written first.
    alignas(64) uint32_t max_bits[kChunk] = {};
    alignas(64) float multipliers[kChunk];
    for (int q = 0; q < n; q += kBf16Groups) {
      if (kFullChunk || n - q >= kBf16Groups) {
        bf16_group_maxima<true>(x + q * kNvfp4GroupSize, n - q, max_bits + q);
      } else {
        bf16_group_maxima<false>(x + q * kNvfp4GroupSize, n - q, max_bits + q);
      }
    }
    static_assert(kBf16Groups % kLanes == 0);
    nvfp4_chunk_scales(max_bits, inv_scales + first, round_up(n, kBf16Groups), scale_bytes,
                       multipliers);
    for (int q = 0; q < n; q += kBf16Groups) {
      if (kFullChunk || n - q >= kBf16Groups) {
        bf16_encode_groups<true>(x + q * kNvfp4GroupSize, n - q, multipliers + q,
                                 packed + q * kPacked);
      } else {
        bf16_encode_groups<false>(x + q * kNvfp4GroupSize, n - q, multipliers + q,
                                  packed + q * kPacked);
      }
    }
    zero_nan_groups(scale_bytes, n, packed);
  } else
#endif
  {
    Group groups[kChunk];
    // Zeroed only to settle GCC's maybe-uninitialized check (every lane read is written below).
    uint32_t max_bits[kChunk] = {};
    for (int q0 = 0; q0 < n; q0 += kLanes) {
      U32v partial[kLanes];
      for (int q = q0; q < q0 + kLanes; ++q) {
        if (q < n) {
          groups[q] = widen_group<S>(x + q * kNvfp4GroupSize);
          partial[q - q0] = partial_max_abs_bits(groups[q]);
        } else {
          partial[q - q0] = U32v{};
        }
      }
      reduce_max<kLanes>(partial);
      std::memcpy(max_bits + q0, &partial[0], sizeof(U32v));
    }
    float multipliers[kChunk];
    nvfp4_chunk_scales(max_bits, inv_scales + first, round_up(n, kLanes), scale_bytes, multipliers);
    encode_chunk(groups, multipliers, scale_bytes, n, packed);
  }
  store_nvfp4_chunk(plan, block, token, first, n, scale_bytes, packed);
}

// Quantizes the num_heads * num_groups groups of one token with quantize_nvfp4_chunk.
template <SourceType S>
inline void quantize_nvfp4_token(const typename SourceTraits<S>::Storage* row,
                                 const Nvfp4SidePlan& plan, int64_t block, int token) {
  const int total = plan.num_heads * plan.layout.num_groups;
  for (int first = 0; first < total; first += kNvfp4Chunk) {
    if (total - first >= kNvfp4Chunk) {
      quantize_nvfp4_chunk<S, true>(row, plan, block, token, first, kNvfp4Chunk);
    } else {
      quantize_nvfp4_chunk<S, false>(row, plan, block, token, first, total - first);
    }
  }
}

// quantize_nvfp4_token with the scalar group writer of kPolicy, for any global scales.
template <SourceType S, Nvfp4ScalePolicy kPolicy = Nvfp4ScalePolicy::kNearest>
inline void quantize_nvfp4_token_scalar(const typename SourceTraits<S>::Storage* row,
                                        const Nvfp4SidePlan& plan, int64_t block, int token) {
  constexpr int kPacked = kNvfp4GroupSize / 2;
  const int total = plan.num_heads * plan.layout.num_groups;
  for (int first = 0; first < total; first += kNvfp4Chunk) {
    const int n = std::min(kNvfp4Chunk, total - first);
    alignas(64) uint8_t scale_bytes[kNvfp4Chunk] = {};
    uint8_t packed[kNvfp4Chunk][kPacked];
    for (int k = 0; k < n; ++k) {
      const int q = first + k;
      float x[kNvfp4GroupSize];
      for (int i = 0; i < kNvfp4GroupSize; ++i) {
        x[i] = SourceTraits<S>::to_float(row[q * kNvfp4GroupSize + i]);
      }
      scale_bytes[k] = nvfp4_policy_quantize_group(kPolicy, x, plan.inv_scales[q], packed[k]);
    }
    store_nvfp4_chunk(plan, block, token, first, n, scale_bytes, packed[0]);
  }
}

// Asks for a coming token's source row ahead of time: the quantizing loops consume a row faster
// than the hardware prefetcher, which sees only one short run per token, brings it in.
template <typename T>
inline void prefetch_row(const T* row, int64_t elements) {
  constexpr int64_t kLineBytes = 64;
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < elements * int64_t(sizeof(T)); offset += kLineBytes) {
    __builtin_prefetch(bytes + offset, /*rw=*/0, /*locality=*/3);
  }
}

// The per-call state of a side of kind K: an Nvfp4SidePlan for NVFP4, nothing otherwise (head_size
// need not be a multiple of 16 there).
template <CacheKind K>
auto side_plan(const CacheSide& side, const ReshapeAndCacheParams& p) {
  if constexpr (K == CacheKind::kNvfp4) {
    return Nvfp4SidePlan(side, p.block_size, p.num_heads);
  } else {
    return nullptr;
  }
}

// n elements of float type S as float type C (cast_element: the exact widening, one rounding to
// nearest even), in a loop the compiler vectorises.
template <SourceType S, SourceType C>
inline void cast_run(const typename SourceTraits<S>::Storage* x,
                     typename SourceTraits<C>::Storage* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = cast_element<S, C>(x[j]);
}

// Writes tokens [begin, end) of one side (K or V). `src` points at token 0 of the source, rows
// `src_token_stride` elements apart, each row one token's [num_heads, head_size] values. C is the
// element type of an unquantized cache (S for the other kinds): C == S copies the bytes, any
// other C casts each element on the way (cast_run). Tokens at page rows below sinks.rows also
// get their key sink rows (sinks.rows == 0 for the V side).
template <SourceType S, CacheKind K, SourceType C, typename Plan>
void write_side(const typename SourceTraits<S>::Storage* src, int64_t src_token_stride,
                const CacheSide& side, const Plan& plan, const KeySinkRows& sinks,
                const ReshapeAndCacheParams& p, int64_t begin, int64_t end) {
  using Storage = typename SourceTraits<S>::Storage;
  const int head_size = side.head_size;
  const int num_heads = p.num_heads;
  constexpr int64_t kAhead = 2;  // rows prefetched this many tokens ahead (best of 1-4, cold)
  // FP8's per-element division leaves the hardware prefetcher enough time on long rows, where
  // software prefetches measured slower (H=32, D=128: 10%).
  const bool prefetch = K == CacheKind::kNvfp4 || num_heads * head_size * sizeof(Storage) <= 4096;
  for (int64_t i = begin; i < end; ++i) {
    if constexpr (K != CacheKind::kUnquantized) {
      // Past `end` too: the next task (this thread's or another's, through the shared cache)
      // starts with those rows; a task is a few tokens only.
      if (prefetch && i + kAhead < p.num_tokens) {
        prefetch_row(src + (i + kAhead) * src_token_stride, num_heads * head_size);
      }
    }
    const int64_t slot = p.slot_mapping[i];
    if (slot < 0) continue;
    const SlotPosition pos = slot_position(slot, p.block_size);
    const Storage* row = src + i * src_token_stride;
    for (int h = 0; pos.token < sinks.rows && h < num_heads; ++h) {
      const Storage* x = row + h * head_size;
      write_key_sink_row(sinks, pos.block, int(pos.token), h, 0, head_size,
                         [x](int j) { return SourceTraits<S>::to_float(x[j]); });
    }

    if constexpr (K == CacheKind::kUnquantized) {
      using CacheStorage = typename SourceTraits<C>::Storage;
      static_assert(sizeof(Storage) == 2 || sizeof(Storage) == 4);
      CacheStorage* dst =
          static_cast<CacheStorage*>(side.data) + entry_offset(side, pos.block, pos.token, 0);
      if constexpr (C == S) {                 // the same dtype: a byte copy
        if (side.head_stride == head_size) {  // NHD: the token's heads are one run
          std::memcpy(dst, row, sizeof(Storage) * head_size * num_heads);
        } else {
          for (int h = 0; h < num_heads; ++h) {
            std::memcpy(dst + h * side.head_stride, row + h * head_size,
                        sizeof(Storage) * head_size);
          }
        }
      } else if (side.head_stride == head_size) {
        cast_run<S, C>(row, dst, int64_t(head_size) * num_heads);
      } else {
        for (int h = 0; h < num_heads; ++h) {
          cast_run<S, C>(row + h * head_size, dst + h * side.head_stride, head_size);
        }
      }
    } else if constexpr (K == CacheKind::kNvfp4) {
      if (p.nvfp4_scale_policy == Nvfp4ScalePolicy::kMse) {
        quantize_nvfp4_token_scalar<S, Nvfp4ScalePolicy::kMse>(row, plan, pos.block,
                                                               int(pos.token));
      } else if (p.nvfp4_scale_policy == Nvfp4ScalePolicy::k4over6) {
        quantize_nvfp4_token_scalar<S, Nvfp4ScalePolicy::k4over6>(row, plan, pos.block,
                                                                  int(pos.token));
      } else if (plan.any_infinite) {
        quantize_nvfp4_token_scalar<S>(row, plan, pos.block, int(pos.token));
      } else {
        quantize_nvfp4_token<S>(row, plan, pos.block, int(pos.token));
      }
    } else if constexpr (is_per_token_head(K)) {  // each row computes and stores its own scale
      uint8_t* cache = static_cast<uint8_t*>(side.data);
      for (int h = 0; h < num_heads; ++h) {
        const Storage* x = row + h * head_size;
        quantize_per_token_head_row_lanes<K, S>(
            x, head_size, cache + entry_offset(side, pos.block, pos.token, h));
      }
    } else if constexpr (K == CacheKind::kInt4PerTokenHead) {  // rotated, then like the above
      uint8_t* cache = static_cast<uint8_t*>(side.data);
      for (int h = 0; h < num_heads; ++h) {
        const Storage* x = row + h * head_size;
        float scratch[kInt4MaxHeadSize];
        quantize_int4_per_token_head_row(
            [x](int j) { return SourceTraits<S>::to_float(x[j]); },
            [](float v) { return SourceTraits<S>::to_float(SourceTraits<S>::from_float(v)); },
            side.rht_signs, head_size, scratch,
            cache + entry_offset(side, pos.block, pos.token, h));
      }
    } else {  // FP8: q = fp8(clamp(x / scale)), one IEEE division per element
      uint8_t* cache = static_cast<uint8_t*>(side.data);
      for (int h = 0; h < num_heads; ++h) {
        const float scale = head_scale(side, h);
        const Storage* x = row + h * head_size;
        uint8_t* dst = cache + entry_offset(side, pos.block, pos.token, h);
        for (int j = 0; j < head_size; ++j) {
          dst[j] = fp8_encode<K>(kv_fdiv(SourceTraits<S>::to_float(x[j]), scale));
        }
      }
    }
  }
}

// Tokens per parallel task, sized so that a task's work outweighs waking a thread.
inline int64_t grain_size(const ReshapeAndCacheParams& p) {
  const int64_t elements_per_token =
      int64_t(p.num_heads) * (p.key_cache.head_size + p.value_cache.head_size);
  const int64_t elements_per_task = p.cache_kind == CacheKind::kUnquantized ? 1 << 16 : 1 << 13;
  return std::max<int64_t>(1, elements_per_task / std::max<int64_t>(1, elements_per_token));
}

// Writes all p.num_tokens tokens. parallel_for(begin, end, grain, fn) must call fn(b, e) on
// disjoint sub-ranges covering [begin, end), e.g. at::parallel_for.
template <typename ParallelFor>
void reshape_and_cache_flash(const ReshapeAndCacheParams& p, ParallelFor&& parallel_for) {
  dispatch_source_and_kind(p.source_type, p.cache_kind, [&](auto source_tag, auto kind_tag) {
    constexpr SourceType S = decltype(source_tag)::value;
    constexpr CacheKind K = decltype(kind_tag)::value;
    using Storage = typename SourceTraits<S>::Storage;
    const auto* key = static_cast<const Storage*>(p.key);
    const auto* value = static_cast<const Storage*>(p.value);
    const auto key_plan = side_plan<K>(p.key_cache, p);
    const auto value_plan = side_plan<K>(p.value_cache, p);
    const auto write = [&](auto cache_tag) {
      constexpr SourceType C = decltype(cache_tag)::value;
      parallel_for(int64_t{0}, p.num_tokens, grain_size(p), [&](int64_t begin, int64_t end) {
        write_side<S, K, C>(key, p.key_token_stride, p.key_cache, key_plan, p.key_sinks, p, begin,
                            end);
        write_side<S, K, C>(value, p.value_token_stride, p.value_cache, value_plan, KeySinkRows{},
                            p, begin, end);
      });
    };
    if constexpr (K == CacheKind::kUnquantized) {
      dispatch_source_type(p.cache_type, write);  // any float cache: copy or cast
    } else {
      write(SourceTag<S>{});
    }
  });
}

}  // namespace vllm_kv::cpu
