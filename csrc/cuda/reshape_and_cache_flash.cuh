// CUDA kernels of reshape_and_cache_flash (docs/design.md §5, §6). Torch-free: raw pointers, sizes
// and strides from ReshapeAndCacheParams, launched on a caller-given cudaStream_t.
//
// Work decomposition. A token's work is cut into "units": the K side first, then the V side,
// each head_size / kVec units per head (kVec elements per unit). One thread writes one unit of
// one token, so a single launch covers K and V. The block is 2-D: threadIdx.x walks the units of
// a token (all of them when there are at most 256), threadIdx.y walks tokens, so small head
// counts still fill 256-thread blocks; grid.y covers the units when a token has more than 256,
// grid.x the tokens (with a grid-stride loop over tokens as a safety net).
//
//   unquantized: unit = one aligned vector of up to 16 bytes, copied as raw bytes; when the cache's
//                float type differs from the source's (CastOps), kVec (up to 8) elements, each
//                widened exactly and rounded to nearest even (cast_element of dispatch_utils.h).
//   FP8:         unit = kVec (up to 16) elements: vector loads, one IEEE division by the scale per
//                element (kv_fdiv = __fdiv_rn), FP8 encoding, one vector store of kVec bytes.
//   NVFP4:       unit = one 16-element group (docs/design.md §5 steps 1-6), 8 data bytes stored at
//                Nvfp4SideLayout::data_offset, 1 scale byte at Nvfp4SideLayout::scale_offset.
//   per-token-head INT8 / FP8: unit = one lane of a row (a head of a token), a warp per row:
//                each lane loads and stores runs of 4 elements (contiguous across the warp), the
//                row's scale comes from the lanes' statistics merged by warp shuffles (max and
//                or, order-free), then each lane quantizes its runs (per_token_head.h's lane
//                split of quantize_per_token_head_row, the CPU writer's arithmetic).
//   per-token-head INT4: unit = one whole row, since it is rotated first: quantize_int4_per_token_
//                head_row of int4_per_token_head.h, the CPU writer's code, so the bytes are the
//                same by construction (and host-replayable).
//   Key sink rows (key_sink_rows.h): a K unit of a page row below S also writes its elements'
//                e4m3 bytes into the sink row, from the same loaded source words.
//
// The widest vector width that every pointer, stride and head size allows is chosen on the host
// (plan_reshape_and_cache_flash), falling back to element-wide accesses. All quantization is done
// in software on every architecture (no hardware fp8 / e2m1 cvt): the fp32 operations of
// kv_quant_math.h in the same order, with the branch-free encoders of kv_quant_fast.h, which are
// proven byte-identical to kv_quant_math.h's over all 2^32 inputs; so the bytes equal the
// reference codecs bit for bit. Must not be compiled with --use_fast_math or -ftz=true (flushing
// subnormals changes the bytes; tools/compile_cuda_kernels.sh rejects .ftz / .approx in the PTX).
//
// The per-thread work (write_unit) and the launch plan are __host__ __device__ / host code, so the
// exact kernel decomposition can also be replayed on the host in tests without a GPU.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../cache_kernels.h"
#include "../cache_layout.h"
#include "../dispatch_utils.h"
#include "../int4_per_token_head.h"
#include "../key_sink_rows.h"
#include "../kv_quant_math.h"
#include "../per_token_head.h"
#include "flash_access.cuh"
#include "kv_quant_fast.h"

namespace vllm_kv::gpu {

constexpr int kThreadsPerBlock = 256;
constexpr int kMaxVectorBytes = 16;
// Shared memory an INT4 launch takes for its threads' row scratch (the default per-block limit).
constexpr int kRowScratchBytes = 48 * 1024;

// ---------------------------------------------------------------------------------------------
// Kernel arguments.

struct FlashSideArgs {
  CacheSide cache;           // as validated: element strides, head size, scale, scale layout
  Nvfp4SideLayout nvfp4;     // byte addressing of an NVFP4 side (filled for NVFP4 only)
  const uint8_t* src;        // token 0, head 0 of key / value
  int64_t src_token_stride;  // source elements between tokens
  int units_per_head;        // head_size / kVec (1 for per-token-head: a unit is a row)
};

struct FlashArgs {
  FlashSideArgs side[2];  // K, V
  const int64_t* slot_mapping;
  int64_t num_tokens;  // slot_mapping length (may be less than the source's padded token count)
  int64_t num_slots;   // num_blocks * block_size; slots at or above it are skipped
  int block_size;
  Nvfp4ScalePolicy nvfp4_scale_policy;  // kNvfp4: how each group's block scale is chosen
  int units_k;                          // units of the K side per token
  int units_total;                      // units of K and V per token
  KeySinkRows key_sinks;                // rows == 0: none
  // kInt4PerTokenHead: floats of shared memory per thread, each rotating one row at a time
  // (max(D, Dv) + 1: the odd stride keeps the threads' slices in different banks); 0 otherwise.
  int row_scratch_floats;
  bool key_bf16;  // the key is bf16 (the plain copy shares fp16's instantiations)
  // Always 0. The slot test also checks ((OR of the loaded source words and scale) & zero) != 0,
  // which makes it depend on those loads: otherwise ptxas sinks them below the test, and the
  // kernel waits for the slot load and the source loads one after the other instead of together.
  uint32_t zero;
};

template <CacheKind K>
KV_HOST_DEVICE uint8_t fp8_encode(float x) {
  if constexpr (K == CacheKind::kFp8E4M3) {
    return float_to_e4m3_satfinite_fast(x);
  } else {
    static_assert(K == CacheKind::kFp8E5M2, "FP8 kinds only");
    return float_to_e5m2_satfinite_fast(x);
  }
}

// ---------------------------------------------------------------------------------------------
// Per-thread work.

// Page and row of a slot in [0, num_slots): 32-bit division whenever the slot count allows.
KV_HOST_DEVICE void split_slot(int64_t slot, int block_size, int64_t num_slots, int64_t& block,
                               int& row) {
  if (num_slots <= int64_t(UINT32_MAX)) {
    const uint32_t s = static_cast<uint32_t>(slot);
    const uint32_t b = s / static_cast<uint32_t>(block_size);
    block = b;
    row = static_cast<int>(s - b * static_cast<uint32_t>(block_size));
  } else {
    block = slot / block_size;
    row = static_cast<int>(slot - block * block_size);
  }
}

// Element i of a unit's source words as fp32, for its key sink row. The plain copy moves fp16
// and bf16 as raw bytes in one instantiation, so there the key's dtype picks the widening.
template <typename Src, CacheKind kKind, int kWords>
KV_HOST_DEVICE float sink_element(const FlashArgs& a, const uint32_t (&w)[kWords], int i) {
  if constexpr (kKind == CacheKind::kUnquantized && !kIsCast<Src> && Src::kSize == 2) {
    const uint16_t h = static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2)));
    return a.key_bf16 ? bf16_bits_to_float(h) : fp16_bits_to_float(h);
  } else {
    return Src::element(w, i);
  }
}

// The kinds whose units are rows (a head of a token): each row computes its own scale.
KV_HOST_DEVICE constexpr bool is_row_kind(CacheKind kind) {
  return is_per_token_head(kind) || kind == CacheKind::kInt4PerTokenHead;
}

// Units per row: a warp's lanes for INT8 / FP8 rows (per_token_head.h's kRowLanes split), one
// thread for an INT4 row (its rotation runs over the whole row in the thread's scratch).
KV_HOST_DEVICE constexpr int row_lanes(CacheKind kind) {
  return is_per_token_head(kind) ? kRowLanes : 1;
}

// The whole row's statistics from each lane's (lane_stats(l)): on the GPU the warp's lanes (one
// row per warp) exchange theirs; on the host (the replay) one lane merges them all. Max and or:
// the same result in any order.
template <typename LaneStats>
KV_HOST_DEVICE PerTokenHeadStats row_stats(int lane, const LaneStats& lane_stats) {
#if defined(__CUDA_ARCH__)
  PerTokenHeadStats stats = lane_stats(lane);
  KV_DEVICE_UNROLL
  for (int offset = kRowLanes / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xFFFFFFFFu, stats.finite_amax, offset);
    const int other_nan = __shfl_xor_sync(0xFFFFFFFFu, int(stats.has_nan), offset);
    stats = merge_stats(stats, PerTokenHeadStats{other, other_nan != 0});
  }
  return stats;
#else
  (void)lane;
  PerTokenHeadStats stats;
  for (int l = 0; l < kRowLanes; ++l) stats = merge_stats(stats, lane_stats(l));
  return stats;
#endif
}

// Writes lane `lane` of row `head` of token `token` of side `side` (0: K, 1: V) of a
// per-token-head cache (INT8 / FP8: a warp per row; INT4: one thread, lane 0, rotating the row
// first), and its part of the row's key sink row if it has one.
template <typename Src, CacheKind kKind>
KV_HOST_DEVICE void write_per_token_head_row(const FlashArgs& a, int side, int64_t token, int head,
                                             int lane, float* scratch) {
  const FlashSideArgs& s = a.side[side];
  const int64_t slot = load_readonly(a.slot_mapping + token);
  if (slot < 0 || slot >= a.num_slots) return;
  int64_t block;
  int row;
  split_slot(slot, a.block_size, a.num_slots, block, row);
  const uint8_t* x =
      s.src + (token * s.src_token_stride + int64_t(head) * s.cache.head_size) * Src::kSize;
  const auto load = [x](int i) {
    uint32_t word[1];
    if constexpr (Src::kSize == 4) {
      word[0] = load_readonly(reinterpret_cast<const uint32_t*>(x) + i);
    } else {
      word[0] = load_readonly(reinterpret_cast<const uint16_t*>(x) + i);
    }
    return Src::element(word, 0);
  };
  uint8_t* dst = static_cast<uint8_t*>(s.cache.data) + entry_offset(s.cache, block, row, head);
  const bool sink = side == 0 && row < a.key_sinks.rows;
  if constexpr (kKind == CacheKind::kInt4PerTokenHead) {
    using Traits = SourceTraits<Src::kType>;
    const auto round_to_source = [](float v) { return Traits::to_float(Traits::from_float(v)); };
    quantize_int4_per_token_head_row(load, round_to_source, s.cache.rht_signs, s.cache.head_size,
                                     scratch, dst);
    if (sink) write_key_sink_row(a.key_sinks, block, row, head, 0, s.cache.head_size, load);
  } else {
    const int d = s.cache.head_size;
    const PerTokenHeadStats stats =
        row_stats(lane, [&](int l) { return per_token_head_lane_stats(load, d, l); });
    quantize_per_token_head_lane<kKind>(load, d, lane, stats, dst, [&](int start, int n) {
      if (sink) {
        write_key_sink_row(a.key_sinks, block, row, head, start, n,
                           [&](int i) { return load(start + i); });
      }
    });
  }
}

// write_unit for the unquantized, FP8 and NVFP4 kinds: units of kVec elements.
template <typename Src, CacheKind kKind, int kVec, bool kWide>
KV_HOST_DEVICE void write_vector_unit(const FlashArgs& a, int64_t token, int unit) {
  const bool is_value = unit >= a.units_k;
  const FlashSideArgs& s = a.side[is_value ? 1 : 0];
  // Unsigned division: cheaper on the GPU, and every operand is non-negative.
  const uint32_t r = static_cast<uint32_t>(is_value ? unit - a.units_k : unit);
  const uint32_t units_per_head = static_cast<uint32_t>(s.units_per_head);
  const int head = static_cast<int>(r / units_per_head);
  const int chunk = static_cast<int>(r - static_cast<uint32_t>(head) * units_per_head);
  const int64_t src_elem =
      token * s.src_token_stride + int64_t(head) * s.cache.head_size + int64_t(chunk) * kVec;

  // The source row of every token below num_tokens is readable, so the source (and scale) loads
  // are issued before the slot load and all of them are in flight together instead of one after
  // the other (see FlashArgs::zero). Skipped tokens waste one load.
  constexpr int kInBytes = kVec * Src::kSize;
  constexpr int kInWord = (kKind == CacheKind::kNvfp4 && !kWide)
                              ? Src::kSize
                              : (kInBytes < kMaxVectorBytes ? kInBytes : kMaxVectorBytes);
  uint32_t in[words_for_bytes(kInBytes)];
  load_bytes<kInBytes, kInWord>(s.src + src_elem * Src::kSize, in);
  float scale = 1.0f;
  if constexpr (kKind != CacheKind::kUnquantized) {
    scale = load_readonly(s.cache.scale + (s.cache.scale_per_head ? head : 0));
  }
  uint32_t loaded = float_as_bits(scale);
  KV_DEVICE_UNROLL
  for (int i = 0; i < words_for_bytes(kInBytes); ++i) loaded |= in[i];
  const int64_t slot = load_readonly(a.slot_mapping + token);
  // Padding token, or a slot outside the cache (the last term is always false, see `zero`).
  if (slot < 0 || slot >= a.num_slots || (loaded & a.zero) != 0) return;
  int64_t block;
  int row;
  split_slot(slot, a.block_size, a.num_slots, block, row);
  uint8_t* cache = static_cast<uint8_t*>(s.cache.data);
  if (!is_value && row < a.key_sinks.rows) {  // this unit's elements of the key's sink row
    write_key_sink_row(a.key_sinks, block, row, head, chunk * kVec, kVec,
                       [&](int i) { return sink_element<Src, kKind>(a, in, i); });
  }

  if constexpr (kKind == CacheKind::kUnquantized && kIsCast<Src>) {
    constexpr int kOutBytes = kVec * Src::kCacheSize;
    constexpr int kOutWord = kOutBytes < kMaxVectorBytes ? kOutBytes : kMaxVectorBytes;
    using SrcStorage = typename SourceTraits<Src::kSource>::Storage;
    uint32_t out[words_for_bytes(kOutBytes)];
    KV_DEVICE_UNROLL
    for (int j = 0; j < words_for_bytes(kOutBytes); ++j) out[j] = 0;
    KV_DEVICE_UNROLL
    for (int i = 0; i < kVec; ++i) {
      SrcStorage x;
      if constexpr (Src::kSize == 4) {
        x = bits_as_float(in[i]);
      } else {
        x = static_cast<uint16_t>(in[i / 2] >> (16 * (i % 2)));
      }
      const auto y = cast_element<Src::kSource, Src::kCache>(x);
      if constexpr (Src::kCacheSize == 4) {
        out[i] = float_as_bits(y);
      } else {
        out[i / 2] |= uint32_t(y) << (16 * (i % 2));
      }
    }
    const int64_t dst_elem = entry_offset(s.cache, block, row, head) + int64_t(chunk) * kVec;
    store_bytes<kOutBytes, kOutWord>(cache + dst_elem * Src::kCacheSize, out);
  } else if constexpr (kKind == CacheKind::kUnquantized) {
    constexpr int kWord = kInBytes < kMaxVectorBytes ? kInBytes : kMaxVectorBytes;
    const int64_t dst_elem = entry_offset(s.cache, block, row, head) + int64_t(chunk) * kVec;
    store_bytes<kInBytes, kWord>(cache + dst_elem * Src::kSize, in);
  } else if constexpr (kKind == CacheKind::kNvfp4) {
    static_assert(kVec == kNvfp4GroupSize, "one NVFP4 group per unit");
    constexpr int kOutBytes = kNvfp4GroupSize / 2;
    constexpr int kOutWord = kWide ? kOutBytes : 1;
    float x[kNvfp4GroupSize];
    KV_DEVICE_UNROLL
    for (int i = 0; i < kNvfp4GroupSize; ++i) x[i] = Src::element(in, i);
    const float inv_global_scale = kv_fdiv(1.0f, scale);  // __fdiv_rn on the device
    uint8_t packed[kOutBytes];
    const uint8_t scale_byte =
        a.nvfp4_scale_policy == Nvfp4ScalePolicy::kNearest
            ? nvfp4_quantize_group_fast(x, inv_global_scale, packed)
            : nvfp4_policy_quantize_group(a.nvfp4_scale_policy, x, inv_global_scale, packed);
    uint32_t out[words_for_bytes(kOutBytes)];
    KV_DEVICE_UNROLL
    for (int j = 0; j < words_for_bytes(kOutBytes); ++j) {
      out[j] = uint32_t(packed[4 * j]) | (uint32_t(packed[4 * j + 1]) << 8) |
               (uint32_t(packed[4 * j + 2]) << 16) | (uint32_t(packed[4 * j + 3]) << 24);
    }
    store_bytes<kOutBytes, kOutWord>(
        cache + s.nvfp4.data_offset(block, row, head) + int64_t(chunk) * kOutBytes, out);
    cache[s.nvfp4.scale_offset(block, row, head, chunk, s.cache.scale_layout)] = scale_byte;
  } else {  // FP8: q = fp8(clamp(x / scale)), one IEEE division per element
    constexpr int kOutWord = kVec < kMaxVectorBytes ? kVec : kMaxVectorBytes;
    uint32_t out[words_for_bytes(kVec)];
    KV_DEVICE_UNROLL
    for (int j = 0; j < words_for_bytes(kVec); ++j) out[j] = 0;
    KV_DEVICE_UNROLL
    for (int i = 0; i < kVec; ++i) {
      const uint8_t q = fp8_encode<kKind>(kv_fdiv(Src::element(in, i), scale));
      out[i / 4] |= uint32_t(q) << (8 * (i % 4));
    }
    const int64_t dst = entry_offset(s.cache, block, row, head) + int64_t(chunk) * kVec;
    store_bytes<kVec, kOutWord>(cache + dst, out);
  }
}

// Writes unit `unit` (in [0, units_total)) of token `token` (in [0, num_tokens)); `scratch`: the
// thread's a.row_scratch_floats floats (INT4 rows only).
template <typename Src, CacheKind kKind, int kVec, bool kWide>
KV_HOST_DEVICE void write_unit(const FlashArgs& a, int64_t token, int unit, float* scratch) {
  if constexpr (is_row_kind(kKind)) {
    const bool is_value = unit >= a.units_k;
    const int local = is_value ? unit - a.units_k : unit;
    constexpr int kLanes = row_lanes(kKind);
    write_per_token_head_row<Src, kKind>(a, is_value ? 1 : 0, token, local / kLanes, local % kLanes,
                                         scratch);
  } else {
    write_vector_unit<Src, kKind, kVec, kWide>(a, token, unit);
  }
}

template <typename Src, CacheKind kKind, int kVec, bool kWide>
__global__ void __launch_bounds__(kThreadsPerBlock)
    reshape_and_cache_flash_kernel(const __grid_constant__ FlashArgs args) {
  extern __shared__ float row_scratch[];
  const int unit = static_cast<int>(blockIdx.y * blockDim.x + threadIdx.x);
  if (unit >= args.units_total) return;
  float* scratch =
      row_scratch + (threadIdx.y * blockDim.x + threadIdx.x) * unsigned(args.row_scratch_floats);
  const int64_t token_step = int64_t(gridDim.x) * blockDim.y;
  for (int64_t token = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; token < args.num_tokens;
       token += token_step) {
    write_unit<Src, kKind, kVec, kWide>(args, token, unit, scratch);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: launch plan (vector width, grid) and dispatch to the kernel instantiation.

struct FlashLaunchPlan {
  FlashArgs args{};
  int vec = 0;        // elements per unit
  bool wide = true;   // NVFP4: 16-byte source loads and 8-byte data stores
  bool empty = true;  // nothing to write: no launch
  dim3 grid;
  dim3 block;
  size_t shared_bytes = 0;  // dynamic shared memory of a launch (INT4 row scratch)
};

inline bool is_aligned(const void* p, int64_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(alignment) == 0;
}

inline bool is_multiple(int64_t x, int64_t alignment) { return x % alignment == 0; }

inline int source_size(SourceType t) { return t == SourceType::kFloat32 ? 4 : 2; }

// `alignment`-byte source accesses of one side: the row base and token stride must allow them
// (head and unit offsets are checked by the caller through head_size).
inline bool source_rows_aligned(const void* src, int64_t token_stride, int elem_size,
                                int64_t alignment) {
  return is_aligned(src, alignment) && is_multiple(token_stride * elem_size, alignment);
}

// `alignment`-byte accesses to unquantized / FP8 cache entries of one side.
inline bool cache_entries_aligned(const CacheSide& c, int elem_size, int64_t alignment) {
  return is_aligned(c.data, alignment) && is_multiple(c.block_stride * elem_size, alignment) &&
         is_multiple(c.token_stride * elem_size, alignment) &&
         is_multiple(c.head_stride * elem_size, alignment);
}

// Widest unit (elements) for which every access of the side is aligned; 1 always works.
// cache_size: bytes per cache element (1 for the quantized kinds).
inline int pick_vec(CacheKind kind, const CacheSide& c, const void* src, int64_t src_token_stride,
                    int src_size, int cache_size) {
  if (kind == CacheKind::kUnquantized && cache_size != src_size) {
    // A cast: kVec elements are loaded as min(16, kVec * src_size)-byte words and stored as
    // min(16, kVec * cache_size)-byte words (at most 32 bytes either way).
    for (int vec = kMaxVectorBytes / 2; vec > 1; vec /= 2) {
      const int in_word = std::min(kMaxVectorBytes, vec * src_size);
      const int out_word = std::min(kMaxVectorBytes, vec * cache_size);
      if (c.head_size % vec == 0 && source_rows_aligned(src, src_token_stride, src_size, in_word) &&
          cache_entries_aligned(c, cache_size, out_word)) {
        return vec;
      }
    }
    return 1;
  }
  if (kind == CacheKind::kUnquantized) {
    for (int bytes = kMaxVectorBytes; bytes > src_size; bytes /= 2) {
      if (is_multiple(int64_t(c.head_size) * src_size, bytes) &&
          source_rows_aligned(src, src_token_stride, src_size, bytes) &&
          cache_entries_aligned(c, src_size, bytes)) {
        return bytes / src_size;
      }
    }
    return 1;
  }
  // FP8: kVec elements are loaded as min(16, kVec * src_size)-byte words and stored as
  // min(16, kVec)-byte words.
  for (int vec = kMaxVectorBytes; vec > 1; vec /= 2) {
    const int in_word = std::min(kMaxVectorBytes, vec * src_size);
    const int out_word = std::min(kMaxVectorBytes, vec);
    if (c.head_size % vec == 0 && source_rows_aligned(src, src_token_stride, src_size, in_word) &&
        cache_entries_aligned(c, 1, out_word)) {
      return vec;
    }
  }
  return 1;
}

// NVFP4: 16-byte source loads and 8-byte data stores are aligned (head_size % 16 == 0 makes the
// head, group and data-entry offsets multiples of those).
inline bool nvfp4_wide_ok(const CacheSide& c, const void* src, int64_t src_token_stride,
                          int src_size) {
  return source_rows_aligned(src, src_token_stride, src_size, kMaxVectorBytes) &&
         is_aligned(c.data, kNvfp4GroupSize / 2) &&
         is_multiple(c.block_stride, kNvfp4GroupSize / 2);
}

inline FlashLaunchPlan plan_reshape_and_cache_flash(const ReshapeAndCacheParams& p) {
  FlashLaunchPlan plan;
  const int src_size = source_size(p.source_type);
  const int cache_size = p.cache_kind == CacheKind::kUnquantized ? source_size(p.cache_type) : 1;
  const CacheSide* caches[2] = {&p.key_cache, &p.value_cache};
  const void* srcs[2] = {p.key, p.value};
  const int64_t src_strides[2] = {p.key_token_stride, p.value_token_stride};

  if (is_row_kind(p.cache_kind)) {
    plan.vec = 1;  // unused: a unit is a whole row
  } else if (p.cache_kind == CacheKind::kNvfp4) {
    plan.vec = kNvfp4GroupSize;
    plan.wide = true;
    for (int i = 0; i < 2; ++i) {
      plan.wide = plan.wide && nvfp4_wide_ok(*caches[i], srcs[i], src_strides[i], src_size);
    }
  } else {
    plan.vec = kMaxVectorBytes;
    for (int i = 0; i < 2; ++i) {
      plan.vec = std::min(plan.vec, pick_vec(p.cache_kind, *caches[i], srcs[i], src_strides[i],
                                             src_size, cache_size));
    }
  }

  FlashArgs& a = plan.args;
  for (int i = 0; i < 2; ++i) {
    FlashSideArgs& s = a.side[i];
    s.cache = *caches[i];
    if (p.cache_kind == CacheKind::kNvfp4 && s.cache.head_size >= kNvfp4GroupSize) {
      s.nvfp4 = Nvfp4SideLayout(s.cache, p.block_size, p.num_heads);
    }
    s.src = static_cast<const uint8_t*>(srcs[i]);
    s.src_token_stride = src_strides[i];
    s.units_per_head =
        is_row_kind(p.cache_kind) ? row_lanes(p.cache_kind) : s.cache.head_size / plan.vec;
  }
  a.slot_mapping = p.slot_mapping;
  a.num_tokens = p.num_tokens;
  a.num_slots = p.num_blocks * p.block_size;
  a.block_size = p.block_size;
  a.nvfp4_scale_policy = p.nvfp4_scale_policy;
  a.key_sinks = p.key_sinks;
  a.key_bf16 = p.source_type == SourceType::kBFloat16;
  const int64_t units_k = int64_t(p.num_heads) * a.side[0].units_per_head;
  const int64_t units_total = units_k + int64_t(p.num_heads) * a.side[1].units_per_head;
  a.units_k = static_cast<int>(units_k);
  a.units_total = static_cast<int>(units_total);
  const bool int4 = p.cache_kind == CacheKind::kInt4PerTokenHead;
  a.row_scratch_floats = int4 ? std::max(p.key_cache.head_size, p.value_cache.head_size) + 1 : 0;

  plan.empty = p.num_tokens <= 0 || units_total <= 0 || a.num_slots <= 0;
  if (plan.empty) return plan;
  // INT4: as many threads as the row scratch fits in kRowScratchBytes.
  const int threads =
      int4 ? std::min(kThreadsPerBlock,
                      kRowScratchBytes / int(sizeof(float) * size_t(a.row_scratch_floats)))
           : kThreadsPerBlock;
  const int block_x = static_cast<int>(std::min<int64_t>(units_total, threads));
  const int block_y = std::max(1, threads / block_x);
  plan.shared_bytes = sizeof(float) * size_t(a.row_scratch_floats) * block_x * block_y;
  plan.block = dim3(block_x, block_y, 1);
  const int64_t grid_x = std::min<int64_t>((p.num_tokens + block_y - 1) / block_y, INT32_MAX);
  const int64_t grid_y = (units_total + block_x - 1) / block_x;
  plan.grid = dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y), 1);
  return plan;
}

// Names one kernel instantiation: source type, cache kind, elements per unit, wide NVFP4 access.
template <typename Src, CacheKind kKind, int kVec, bool kWide>
struct KernelTag {
  using Source = Src;
  static constexpr CacheKind kind = kKind;
  static constexpr int vec = kVec;
  static constexpr bool wide = kWide;
};

// Calls run(KernelTag<...>{}) for the instantiation that `plan` selects for `p`. The unquantized
// copy moves raw bytes, so float16 and bfloat16 share its instantiations; an unquantized cache of
// another float type than the source's takes CastOps<S, C>.
template <typename Runner>
void dispatch_flash_kernel(const ReshapeAndCacheParams& p, const FlashLaunchPlan& plan,
                           Runner&& run) {
  dispatch_source_and_kind(p.source_type, p.cache_kind, [&](auto source_tag, auto kind_tag) {
    constexpr SourceType S = decltype(source_tag)::value;
    constexpr CacheKind K = decltype(kind_tag)::value;
    if constexpr (K == CacheKind::kUnquantized) {
      if (p.cache_type != S) {
        return dispatch_source_type(p.cache_type, [&](auto cache_tag) {
          constexpr SourceType C = decltype(cache_tag)::value;
          if constexpr (C != S) {
            using Src = CastOps<S, C>;
            switch (plan.vec) {
              case 8:
                return run(KernelTag<Src, K, 8, true>{});
              case 4:
                return run(KernelTag<Src, K, 4, true>{});
              case 2:
                return run(KernelTag<Src, K, 2, true>{});
              default:
                return run(KernelTag<Src, K, 1, true>{});
            }
          }
        });
      }
      using Src =
          SourceOps<S == SourceType::kFloat32 ? SourceType::kFloat32 : SourceType::kFloat16>;
      switch (plan.vec * Src::kSize) {
        case 16:
          return run(KernelTag<Src, K, 16 / Src::kSize, true>{});
        case 8:
          return run(KernelTag<Src, K, 8 / Src::kSize, true>{});
        case 4:
          return run(KernelTag<Src, K, 4 / Src::kSize, true>{});
        default:  // element-wide accesses
          return run(KernelTag<Src, K, 1, true>{});
      }
    } else if constexpr (is_row_kind(K)) {
      return run(KernelTag<SourceOps<S>, K, 1, true>{});
    } else if constexpr (K == CacheKind::kNvfp4) {
      using Src = SourceOps<S>;
      if (plan.wide) return run(KernelTag<Src, K, kNvfp4GroupSize, true>{});
      return run(KernelTag<Src, K, kNvfp4GroupSize, false>{});
    } else {
      using Src = SourceOps<S>;
      switch (plan.vec) {
        case 16:
          return run(KernelTag<Src, K, 16, true>{});
        case 8:
          return run(KernelTag<Src, K, 8, true>{});
        case 4:
          return run(KernelTag<Src, K, 4, true>{});
        case 2:
          return run(KernelTag<Src, K, 2, true>{});
        default:
          return run(KernelTag<Src, K, 1, true>{});
      }
    }
  });
}

}  // namespace vllm_kv::gpu
