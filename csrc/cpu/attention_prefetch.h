// Software prefetch of the pages a CPU attention work item reads next. Pages come in block-table
// order, not address order, and a head's rows of a page are too few for the hardware prefetchers:
// a later page's rows are requested while this page is attended, so that their misses overlap its
// work. Items over all KV heads (decode) request the next page whole, a slice per head in parts
// spread over the head's work; items over some heads request those heads' rows kAheadPages pages
// ahead. Keys stored before RoPE also request the RoPE table's rows of that page's positions (as
// large as an NVFP4 page's keys).
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention_kernels.h"
#include "cache_kernels.h"
#include "cache_layout.h"
#include "cpu/attention_decode.h"
#include "int4_per_token_head.h"
#include "packed_slot_read.h"
#include "per_token_head.h"

namespace vllm_kv::cpu::attention {

template <CacheKind K, SourceType C>
class PagePrefetch {
 public:
  // Pages ahead of the one attended when items take some heads of a page.
  static constexpr int kAheadPages = 2;

  PagePrefetch(const PagedAttentionParams& p, int head_size, int head_size_v)
      : p_(p),
        head_size_(head_size),
        head_size_v_(head_size_v),
        k_page_bytes_(page_bytes(head_size)),
        // A packed page holds both sides: it is fetched once, with the keys.
        v_page_bytes_(K == kPackedSlotKind ? 0 : page_bytes(head_size_v)) {
    if constexpr (K == CacheKind::kNvfp4) {
      k_layout_ = Nvfp4SideLayout(p.key_cache, p.block_size, p.num_kv_heads);
      v_layout_ = Nvfp4SideLayout(p.value_cache, p.block_size, p.num_kv_heads);
    }
  }

  // A page to request: its block (-1: none), the position of its first key and its keys in range.
  struct Next {
    int64_t block;
    int position;
    int keys;
  };

  // Before attending the page at page_start (of a sequence's `pages`, keys up to key_end) with
  // heads [kv_begin, kv_end): the page to request, its heads' rows requested now unless the item
  // takes every head (then by slice()).
  Next start(const int32_t* pages, int page_start, int key_end, int kv_begin, int kv_end) const {
    const bool whole = kv_end - kv_begin == p_.num_kv_heads;
    const int ahead = page_start + (whole ? 1 : kAheadPages) * p_.block_size;
    const Next next{ahead < key_end ? pages[ahead / p_.block_size] : -1, ahead,
                    std::min(p_.block_size, key_end - ahead)};
    if (next.block >= 0 && !whole) {
      for (int h = kv_begin; h < kv_end; ++h) {
        rows(p_.key_cache, k_layout_, next.block, h, head_size_);
        rows(p_.value_cache, v_layout_, next.block, h, head_size_v_);
      }
      rope_rows(next, 0, 1);
    }
    return next;
  }

  // Before attending head kv_head of the page at page_start (an item taking its heads one by one):
  // that head's rows kAheadPages pages ahead (the whole page's where the head is every head).
  void head(const int32_t* pages, int page_start, int key_end, int kv_head) const {
    const Next next = start(pages, page_start, key_end, kv_head, kv_head + 1);
    for (int part = 0; part < kParts; ++part) slice(next, 0, 1, part);
  }

  // Parts of a head's slice (below), requested at points spread over that head's work.
  static constexpr int kParts = 4;

  // While attending head `slice` of `slices` (an item over every head): part `part` of kParts of
  // that slice of page `next`, both sides. The whole page at once, or a head's slice at once, is a
  // burst of misses that fills the miss queues and stalls this page's own loads.
  void slice(const Next& next, int slice, int slices, int part) const {
    if (next.block < 0 || slices != p_.num_kv_heads) return;
    const int piece = slice * kParts + part;
    const int pieces = slices * kParts;
    lines(static_cast<const char*>(p_.key_cache.data) +
              next.block * p_.key_cache.block_stride * kElementBytes,
          k_page_bytes_, piece, pieces);
    lines(static_cast<const char*>(p_.value_cache.data) +
              next.block * p_.value_cache.block_stride * kElementBytes,
          v_page_bytes_, piece, pieces);
    rope_rows(next, piece, pieces);
  }

 private:
  static constexpr int64_t kElementBytes = kCacheElementBytes<K, C>;

  // Prefetches go to L2 (prefetcht1), not L1: a page ahead of every head is larger than L1d, so
  // requesting it into L1 evicts the page being attended and stalls on the L1 miss queue. On x86
  // the instruction itself: GCC 12's dead-code elimination drops a loop of __builtin_prefetch
  // calls nested in another loop, as code without effects.
  static void line(const void* address) {
#if defined(__x86_64__)
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(address)));
#else
    __builtin_prefetch(address, /*rw=*/0, /*locality=*/2);
#endif
  }

  // Bytes of one page of a side (all heads; pages are dense in NHD and HND alike, unless HND heads
  // are spaced: prefetches then cover the first heads only, a hint that costs nothing more).
  int64_t page_bytes(int head_size) const {
    const int64_t last_dim = K == CacheKind::kNvfp4 ? head_size / 2 + head_size / kNvfp4GroupSize
                             : is_per_token_head(K) ? int64_t(head_size) + kPerTokenHeadScaleBytes
                             : K == CacheKind::kInt4PerTokenHead ? int4_row_bytes(head_size)
                             : K == kPackedSlotKind ? packed_slot_geometry(p_.packed).slot_bytes
                                                    : int64_t(head_size);
    return int64_t(p_.block_size) * p_.num_kv_heads * last_dim * kElementBytes;
  }

  // Slice `slice` of `slices` of the `bytes` bytes at `from`, a request per line.
  static void lines(const char* from, int64_t bytes, int slice, int slices) {
    const int64_t count = (bytes + 63) / 64;
    for (int64_t i = count * slice / slices; i < count * (slice + 1) / slices; ++i) {
      line(from + 64 * i);
    }
  }

  // Slice `slice` of `slices` of the RoPE table's rows of page `next`'s positions.
  void rope_rows(const Next& next, int slice, int slices) const {
    if (p_.rope_cos_sin == nullptr) return;
    const int64_t row_bytes = int64_t(p_.rotary_dim) * sizeof(float);
    lines(reinterpret_cast<const char*>(p_.rope_cos_sin) + next.position * row_bytes,
          next.keys * row_bytes, slice, slices);
  }

  // The rows of head `head` of page `block` (and NVFP4 scales).
  void rows(const CacheSide& side, const Nvfp4SideLayout& layout, int64_t block, int head,
            int dim) const {
    const auto* base = static_cast<const char*>(side.data);
    for (int t = 0; t < p_.block_size; ++t) {
      const char* row;
      int64_t bytes;
      if constexpr (K == CacheKind::kNvfp4) {
        row = base + layout.data_offset(block, t, head);
        bytes = dim / 2;
        line(base + layout.scale_base(block, t, head, side.scale_layout));
      } else {
        row = base + entry_offset(side, block, t, head) * kElementBytes;
        bytes =
            K == kPackedSlotKind ? packed_slot_geometry(p_.packed).slot_bytes : dim * kElementBytes;
      }
      for (int64_t b = 0; b < bytes; b += 64) line(row + b);
    }
  }

  const PagedAttentionParams& p_;
  int head_size_;
  int head_size_v_;
  int64_t k_page_bytes_;
  int64_t v_page_bytes_;
  Nvfp4SideLayout k_layout_{};
  Nvfp4SideLayout v_layout_{};
};

}  // namespace vllm_kv::cpu::attention
