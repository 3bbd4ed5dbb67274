// Software prefetch of the pages a CPU attention work item reads next. Pages come in block-table
// order, not address order, and a head's rows of a page are too few for the hardware prefetchers:
// later keys' rows are requested while these are attended, so that their misses overlap this
// work. Items over all KV heads (decode) attend a page kStepKeys keys at a time and request the
// next step's rows while attending this one's, head by head, in parts spread over the head's
// work; items over some heads request those heads' rows kAheadSteps steps ahead. Keys stored
// before RoPE also request the RoPE table's rows of those keys' positions (as large as an NVFP4
// page's keys).
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
  // Steps ahead of the one attended when items take some heads of a page.
  static constexpr int kAheadSteps = 2;
  // Keys of a page attended at a time (all heads of an item, then the next keys): a step of a
  // page of 128 bf16 keys is as large as a page of 16, so that the rows requested a step ahead
  // stay in L2 beside those attended (a whole page ahead of 128 keys, 512 KiB, did not) and their
  // requests come in parts small enough for the miss queues.
  static constexpr int kStepKeys = 16;

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

  // Keys of a page attended at a time by an item over `heads` KV heads: kStepKeys where they
  // divide the page and the item takes every head (decode), else the page (an item over some
  // heads has many rows per head, prefill, whose per-step costs, a softmax step per row, would
  // grow with the steps).
  int step_keys(int heads) const {
    return heads == p_.num_kv_heads && p_.block_size % kStepKeys == 0 ? kStepKeys : p_.block_size;
  }

  // Keys to request: their page's block (-1: none), their first key's offset in the page and
  // position, how many there are in range, and which step of how many of the page they are.
  struct Next {
    int64_t block;
    int offset;
    int position;
    int keys;
    int step;
    int page_steps;
  };

  // Before attending the `keys` keys from position `at` (of a sequence's `pages`, keys up to
  // key_end; `keys` divides the page) with heads [kv_begin, kv_end): the keys to request, as
  // many and one such step on (kAheadSteps unless the item takes every head), their heads' rows
  // requested now unless the item takes every head (then by slice()).
  Next start(const int32_t* pages, int at, int keys, int key_end, int kv_begin, int kv_end) const {
    const bool whole = kv_end - kv_begin == p_.num_kv_heads;
    const int ahead = at + (whole ? 1 : kAheadSteps) * keys;
    const int offset = ahead % p_.block_size;
    const Next next{ahead < key_end ? pages[ahead / p_.block_size] : -1,
                    offset,
                    ahead,
                    std::min(keys, key_end - ahead),
                    offset / keys,
                    p_.block_size / keys};
    if (next.block >= 0 && !whole) {
      for (int h = kv_begin; h < kv_end; ++h) {
        rows(p_.key_cache, k_layout_, next, h, head_size_);
        if constexpr (K != kPackedSlotKind) rows(p_.value_cache, v_layout_, next, h, head_size_v_);
      }
      rope_rows(next, 0, 1);
    }
    return next;
  }

  // Before attending head kv_head of the page at page_start (an item taking its heads one by one):
  // that head's rows kAheadSteps pages ahead (the whole page's where the head is every head).
  void head(const int32_t* pages, int page_start, int key_end, int kv_head) const {
    const Next next = start(pages, page_start, p_.block_size, key_end, kv_head, kv_head + 1);
    for (int part = 0; part < kParts; ++part) slice(next, 0, 1, part);
  }

  // Parts of a head's slice (below), requested at points spread over that head's work.
  static constexpr int kParts = 4;

  // While attending head `slice` of `slices` (an item over every head): part `part` of kParts of
  // that slice of the step `next` (its share of the page's bytes: an NHD page holds a step's rows
  // of every head together; an HND page's heads stream by themselves), both sides. A step at once,
  // or a head's slice at once, is a burst of misses that fills the miss queues and stalls the
  // attended rows' own loads.
  void slice(const Next& next, int slice, int slices, int part) const {
    if (next.block < 0 || slices != p_.num_kv_heads) return;
    const int piece = (next.step * slices + slice) * kParts + part;
    const int pieces = next.page_steps * slices * kParts;
    page_lines(p_.key_cache, next.block, k_page_bytes_, piece, pieces);
    page_lines(p_.value_cache, next.block, v_page_bytes_, piece, pieces);
    rope_rows(next, slice * kParts + part, slices * kParts);
  }

 private:
  static constexpr int64_t kElementBytes = kCacheElementBytes<K, C>;

  // Prefetches go to L2 (prefetcht1), not L1: a step ahead of every head is larger than L1d, so
  // requesting it into L1 evicts the rows being attended and stalls on the L1 miss queue. On x86
  // the instruction itself: GCC 12's dead-code elimination drops a loop of __builtin_prefetch
  // calls nested in another loop, as code without effects.
  static void line(const void* address) {
#if defined(__x86_64__)
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(address)));
#else
    __builtin_prefetch(address, /*rw=*/0, /*locality=*/2);
#endif
  }

  // Slice `slice` of `slices` of the `bytes` bytes at `from`, a request per line.
  static void lines(const char* from, int64_t bytes, int slice, int slices) {
    const int64_t count = (bytes + 63) / 64;
    for (int64_t i = count * slice / slices; i < count * (slice + 1) / slices; ++i) {
      line(from + 64 * i);
    }
  }

  // Slice `slice` of `slices` of the RoPE table's rows of the keys `next`.
  void rope_rows(const Next& next, int slice, int slices) const {
    if (p_.rope_cos_sin == nullptr) return;
    const int64_t row_bytes = int64_t(p_.rotary_dim) * sizeof(float);
    lines(reinterpret_cast<const char*>(p_.rope_cos_sin) + next.position * row_bytes,
          next.keys * row_bytes, slice, slices);
  }

  // Bytes of one (token, head) entry of a side (NVFP4: codes and block scales).
  int64_t entry_bytes(int head_size) const {
    const int64_t last_dim = K == CacheKind::kNvfp4 ? head_size / 2 + head_size / kNvfp4GroupSize
                             : is_per_token_head(K) ? int64_t(head_size) + kPerTokenHeadScaleBytes
                             : K == CacheKind::kInt4PerTokenHead ? int4_row_bytes(head_size)
                             : K == kPackedSlotKind ? packed_slot_geometry(p_.packed).slot_bytes
                                                    : int64_t(head_size);
    return last_dim * kElementBytes;
  }

  // Bytes of one page of a side (all heads; pages are dense in NHD and HND alike, unless HND heads
  // are spaced: prefetches then cover the first heads only, a hint that costs nothing more).
  int64_t page_bytes(int head_size) const {
    return int64_t(p_.block_size) * p_.num_kv_heads * entry_bytes(head_size);
  }

  // Slice `slice` of `slices` of page `block` of a side, `bytes` long.
  void page_lines(const CacheSide& side, int64_t block, int64_t bytes, int slice,
                  int slices) const {
    lines(static_cast<const char*>(side.data) + block * side.block_stride * kElementBytes, bytes,
          slice, slices);
  }

  // Rows of keys `next` of head `head` of a side (and NVFP4 scales).
  void rows(const CacheSide& side, const Nvfp4SideLayout& layout, const Next& next, int head,
            int dim) const {
    const auto* base = static_cast<const char*>(side.data);
    const int64_t entry = entry_bytes(dim);
    for (int t = next.offset; t < next.offset + next.keys; ++t) {
      const char* row;
      int64_t bytes;
      if constexpr (K == CacheKind::kNvfp4) {
        row = base + layout.data_offset(next.block, t, head);
        bytes = dim / 2;
        line(base + layout.scale_base(next.block, t, head, side.scale_layout));
      } else {
        row = base + entry_offset(side, next.block, t, head) * kElementBytes;
        bytes = entry;
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
