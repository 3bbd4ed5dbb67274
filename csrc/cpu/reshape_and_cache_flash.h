// CPU reshape_and_cache_flash (docs/design.md §6). Framework-free: the torch glue validates the
// arguments, fills a ReshapeAndCacheParams and passes in the parallel-for (at::parallel_for) that
// splits the tokens among threads. FP8 bytes and NVFP4 block scales come from the scalar code of
// kv_quant_math.h (in loops the compiler vectorises), E2M1 codes from a lane-parallel form of its
// float_to_e2m1 (equal on all 2^32 fp32 inputs), every address from cache_layout.h.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "cache_kernels.h"
#include "cache_layout.h"
#include "dispatch_utils.h"
#include "kv_quant_math.h"

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
inline uint8_t fp8_encode(float x) {
  if constexpr (K == CacheKind::kFp8E4M3) {
    return float_to_e4m3_satfinite(x);
  } else {
    return float_to_e5m2_satfinite(x);
  }
}

inline float head_scale(const CacheSide& side, int head) {
  return side.scale[side.scale_per_head ? head : 0];
}

// Lane-parallel NVFP4 with GCC/Clang vector extensions at the native vector width (wider generic
// vectors lower badly).
#if defined(__AVX512F__)
inline constexpr int kVecBytes = 64;
#elif defined(__AVX__)
inline constexpr int kVecBytes = 32;
#else
inline constexpr int kVecBytes = 16;
#endif

template <typename T, int kBytes>
struct VecOf {
  typedef T type __attribute__((vector_size(kBytes)));
};
template <typename T, int kBytes = kVecBytes>
using Vec = typename VecOf<T, kBytes>::type;
using F32v = Vec<float>;
using U32v = Vec<uint32_t>;
using U64v = Vec<uint64_t>;
inline constexpr int kLanes = kVecBytes / 4;
inline constexpr int kVecsPerGroup = kNvfp4GroupSize / kLanes;

// Transposing max-reduction of kLanes vectors: v[g] holds partial maxima of group g, and after
// reduce_max<kLanes>(v) lane g of v[0] is the maximum of group g. Each level pairs vectors and
// keeps, per kSeg-lane segment (one group), the max of its two halves: a segment halves while
// the groups per vector double, two shuffles and one max per pair.
template <size_t kSeg>
constexpr int half_segment_lane(size_t i, bool high) {
  constexpr size_t kHalf = kLanes / 2;
  return int((i >= kHalf ? kLanes : 0) + (i % kHalf) / (kSeg / 2) * kSeg + i % (kSeg / 2) +
             (high ? kSeg / 2 : 0));
}

template <size_t kSeg, size_t... kI>
inline U32v max_of_half_segments(U32v a, U32v b, std::index_sequence<kI...>) {
  const U32v lo = __builtin_shufflevector(a, b, half_segment_lane<kSeg>(kI, false)...);
  const U32v hi = __builtin_shufflevector(a, b, half_segment_lane<kSeg>(kI, true)...);
  return lo > hi ? lo : hi;
}

template <size_t kSeg>
inline void reduce_max(U32v* v) {  // v[0 .. kSeg): segments of kSeg lanes
  if constexpr (kSeg > 1) {
    for (size_t j = 0; j < kSeg / 2; ++j) {
      v[j] = max_of_half_segments<kSeg>(v[2 * j], v[2 * j + 1], std::make_index_sequence<kLanes>{});
    }
    reduce_max<kSeg / 2>(v);
  }
}

// float_to_e2m1 (kv_quant_math.h) lane by lane, as round-half-to-even to a float with one
// mantissa bit (which is what its thresholds spell out) in a few integer operations:
// |v| < 1 is a multiple of 0.5, code RNE(2|v|) in {0, 1, 2}, rounded by adding 2^23;
// |v| >= 1 keeps one mantissa bit (ties to even; a carry bumps the exponent), code
// 2 * (exponent - 127) + mantissa + 2, saturated at 7 (6.0). NaN gives code 0.
inline U32v float_to_e2m1(F32v v) {
  const U32v bits = std::bit_cast<U32v>(v);
  const U32v abs_bits = bits & 0x7FFFFFFFu;
  const F32v a = std::bit_cast<F32v>(abs_bits);
  const U32v small = std::bit_cast<U32v>(a * 2.0f + 8388608.0f) - 0x4B000000u;
  const U32v rounded = abs_bits + 0x1FFFFFu + ((abs_bits >> 22) & 1u);
  const U32v large = (rounded >> 22) - 252u;
  const U32v magnitude = a < 1.0f ? small : (large < 7u ? large : 7u);
  const U32v not_nan = std::bit_cast<U32v>(v == v);
  return (((bits >> 28) & 0x8u) | magnitude) & not_nan;
}

// One group of 16 values widened to fp32, kVecsPerGroup vectors.
struct Group {
  F32v v[kVecsPerGroup];
};

template <SourceType S>
inline Group widen_group(const typename SourceTraits<S>::Storage* x) {
  float widened[kNvfp4GroupSize];
  for (int i = 0; i < kNvfp4GroupSize; ++i) widened[i] = SourceTraits<S>::to_float(x[i]);
  Group group;
  std::memcpy(group.v, widened, sizeof(group.v));
  return group;
}

// Lane-wise max of |x_i| as bits over a group's vectors: |x| orders like its bits, and bits
// above +Inf's mean a NaN.
inline U32v partial_max_abs_bits(const Group& group) {
  U32v m = std::bit_cast<U32v>(group.v[0]) & 0x7FFFFFFFu;
  for (int k = 1; k < kVecsPerGroup; ++k) {
    const U32v b = std::bit_cast<U32v>(group.v[k]) & 0x7FFFFFFFu;
    m = m > b ? m : b;
  }
  return m;
}

// The 8 packed E2M1 bytes of x_i * multiplier (even element in the low nibble).
inline void pack_e2m1(const Group& group, float multiplier, uint8_t* data) {
  for (int k = 0; k < kVecsPerGroup; ++k) {
    // Element pairs (2j, 2j+1) share a 64-bit lane, odd element high: byte j is the low code
    // with the high one shifted from bit 32 to bit 4.
    const U64v pairs = std::bit_cast<U64v>(float_to_e2m1(group.v[k] * multiplier));
    const auto packed = __builtin_convertvector(pairs | (pairs >> 28), Vec<uint8_t, kLanes / 2>);
    std::memcpy(data + k * (kLanes / 2), &packed, kLanes / 2);
  }
}

// Block-scale bytes and multipliers of kChunk groups from their max |x| bits and global scales,
// in one loop that the compiler vectorises (out of line: inlined into the token loop, GCC no
// longer vectorises it).
template <int kChunk>
__attribute__((noinline)) void nvfp4_chunk_scales(const uint32_t (&max_abs_bits)[kChunk],
                                                  const float (&global_scale)[kChunk],
                                                  uint8_t (&scale_bytes)[kChunk],
                                                  float (&multipliers)[kChunk]) {
  for (int q = 0; q < kChunk; ++q) {
    const float inv_global_scale = kv_fdiv(1.0f, global_scale[q]);
    const bool has_nan = max_abs_bits[q] > 0x7F800000u;
    scale_bytes[q] = nvfp4_scale_byte(bits_as_float(max_abs_bits[q]), has_nan, inv_global_scale);
    multipliers[q] = nvfp4_multiplier(scale_bytes[q], inv_global_scale);
  }
}

// Quantizes the num_heads * num_groups groups of one token (docs/design.md §5, the steps of
// nvfp4_quantize_group) into a packed NVFP4 side. Works in chunks of groups, one pass per step:
// the vector max of each group, then the scale arithmetic of the whole chunk in one loop that the
// compiler vectorises, then the vector E2M1 encoding.
template <SourceType S>
inline void quantize_nvfp4_token(const typename SourceTraits<S>::Storage* row, CacheSide side,
                                 Nvfp4SideLayout layout, int num_heads, int64_t block, int token) {
  // side and layout by value: the byte stores below could alias them through a reference.
  constexpr int kChunk = 64;
  constexpr int kPacked = kNvfp4GroupSize / 2;
  uint8_t* cache = static_cast<uint8_t*>(side.data);
  const int num_groups = layout.num_groups;
  const int total = num_heads * num_groups;
  int head = 0;
  int group = 0;  // (head, group) of entry `first` of the chunk
  for (int first = 0; first < total; first += kChunk) {
    const int n = std::min(kChunk, total - first);
    const auto* x = row + int64_t(first) * kNvfp4GroupSize;  // a token's [H, D] is contiguous
    Group groups[kChunk];
    uint32_t max_bits[kChunk] = {};
    float global_scale[kChunk];
    for (int q = 0, h = head, g = group; q < kChunk; ++q) {
      global_scale[q] = q < n ? head_scale(side, h) : 1.0f;
      if (++g == num_groups) g = 0, ++h;
    }
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
    uint8_t scale_bytes[kChunk];
    float multipliers[kChunk];
    nvfp4_chunk_scales(max_bits, global_scale, scale_bytes, multipliers);
    for (int q = 0; q < n;) {
      // The rest of the current head's groups in this chunk.
      const int count = std::min(n - q, num_groups - group);
      if (side.scale_layout == ScaleLayout::kLinear) {  // a (token, head)'s scales are one run
        std::memcpy(cache + layout.scale_offset(block, token, head, group, ScaleLayout::kLinear),
                    scale_bytes + q, count);
      } else {
        for (int k = 0; k < count; ++k) {
          cache[layout.scale_offset(block, token, head, group + k, ScaleLayout::kInterleave4)] =
              scale_bytes[q + k];
        }
      }
      uint8_t* data = cache + layout.data_offset(block, token, head) + group * kPacked;
      for (int k = 0; k < count; ++k, ++q, data += kPacked) {
        if (scale_bytes[q] == kFp8NanByte) {
          std::memset(data, 0, kPacked);
        } else {
          pack_e2m1(groups[q], multipliers[q], data);
        }
      }
      group += count;
      if (group == num_groups) group = 0, ++head;
    }
  }
}

// Asks for the next token's source row ahead of time: the quantizing loops consume a row faster
// than the hardware prefetcher, which sees only one short run per token, brings it in.
template <typename T>
inline void prefetch_row(const T* row, int64_t elements) {
  constexpr int64_t kLineBytes = 64;
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < elements * int64_t(sizeof(T)); offset += kLineBytes) {
    __builtin_prefetch(bytes + offset, /*rw=*/0, /*locality=*/3);
  }
}

// Writes tokens [begin, end) of one side (K or V). `src` points at token 0 of the source, rows
// `src_token_stride` elements apart, each row one token's [num_heads, head_size] values.
template <SourceType S, CacheKind K>
void write_side(const typename SourceTraits<S>::Storage* src, int64_t src_token_stride,
                const CacheSide& side, const ReshapeAndCacheParams& p, int64_t begin, int64_t end) {
  using Storage = typename SourceTraits<S>::Storage;
  const int head_size = side.head_size;
  const int num_heads = p.num_heads;
  const auto nvfp4_layout = [&] {
    if constexpr (K == CacheKind::kNvfp4) {
      return Nvfp4SideLayout(side, p.block_size, num_heads);
    } else {
      return nullptr;  // head_size need not be a multiple of 16 here
    }
  }();
  for (int64_t i = begin; i < end; ++i) {
    if constexpr (K != CacheKind::kUnquantized) {
      if (i + 1 < end) prefetch_row(src + (i + 1) * src_token_stride, num_heads * head_size);
    }
    const int64_t slot = p.slot_mapping[i];
    if (slot < 0) continue;
    const SlotPosition pos = slot_position(slot, p.block_size);
    const Storage* row = src + i * src_token_stride;

    if constexpr (K == CacheKind::kUnquantized) {
      static_assert(sizeof(Storage) == 2 || sizeof(Storage) == 4);
      Storage* dst = static_cast<Storage*>(side.data) + entry_offset(side, pos.block, pos.token, 0);
      if (side.head_stride == head_size) {  // NHD: the token's heads are one run
        std::memcpy(dst, row, sizeof(Storage) * head_size * num_heads);
      } else {
        for (int h = 0; h < num_heads; ++h) {
          std::memcpy(dst + h * side.head_stride, row + h * head_size, sizeof(Storage) * head_size);
        }
      }
    } else if constexpr (K == CacheKind::kNvfp4) {
      quantize_nvfp4_token<S>(row, side, nvfp4_layout, num_heads, pos.block, int(pos.token));
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
    parallel_for(int64_t{0}, p.num_tokens, grain_size(p), [&](int64_t begin, int64_t end) {
      write_side<S, K>(key, p.key_token_stride, p.key_cache, p, begin, end);
      write_side<S, K>(value, p.value_token_stride, p.value_cache, p, begin, end);
    });
  });
}

}  // namespace vllm_kv::cpu
