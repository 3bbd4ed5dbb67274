// Work planning of the CPU attention kernels: the items (sequence, KV heads, query block, key
// split) of one call and the merges of split items, before any kernel runs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "attention_kernels.h"

namespace vllm_kv::cpu::attention {

// ------------------------------------------------------------------------------ work planning

// One unit of parallel work: query tokens [q_begin, q_end) of sequence `seq` (indices among its
// q_len query tokens) for the query heads of KV heads [kv_begin, kv_end), over key positions
// [key_begin, key_end). partial >= 0: write (max, sum, accumulator) partials at that float offset
// of the scratch buffer instead of the output. Rows are ordered (KV head, query token, query head
// of the group).
struct WorkItem {
  int seq;
  int kv_begin;
  int kv_end;
  int q_begin;
  int q_end;
  int key_begin;
  int key_end;
  int64_t partial;
};

// The splits of one (sequence, KV head, query block) whose partials are merged afterwards.
struct MergeItem {
  int seq;
  int kv_begin;
  int kv_end;
  int q_begin;
  int q_end;
  int num_splits;
  int64_t partial;
};

struct AttentionPlan {
  std::vector<WorkItem> items;
  std::vector<MergeItem> merges;
  int64_t scratch_floats = 0;
};

// Shape facts of one call, derived from the parameters.
struct AttentionGeometry {
  int group;  // query heads per KV head
  int head_size;
  int head_size_v;

  explicit AttentionGeometry(const PagedAttentionParams& p)
      : group(p.num_heads / p.num_kv_heads),
        head_size(p.key_cache.head_size),
        head_size_v(p.value_cache.head_size) {}

  // Floats per row of a split's partial: max, sum, accumulator.
  int partial_row_floats() const { return head_size_v + 2; }
};

inline int query_len(const PagedAttentionParams& p, int seq) {
  return p.query_start_loc[seq + 1] - p.query_start_loc[seq];
}

inline bool is_causal(const PagedAttentionParams& p, int seq) {
  return p.seq_causal == nullptr ? p.causal : p.seq_causal[seq] != 0;
}

// Key positions [begin, end) that query token j (of q_len) of sequence `seq` (seq_len tokens)
// sees.
inline std::pair<int, int> key_range(const PagedAttentionParams& p, int seq, int seq_len, int q_len,
                                     int j) {
  const bool causal = is_causal(p, seq);
  const int pos = seq_len - q_len + j;
  int begin = 0;
  int end = seq_len;
  if (p.sliding_window > 0) {
    begin = std::max(0, pos - p.sliding_window + 1);
    if (!causal) end = std::min(seq_len, pos + p.sliding_window);
  }
  if (causal) end = pos + 1;
  return {begin, end};
}

// Key positions per split at least; shorter ranges are not worth a merge.
inline constexpr int kMinSplitKeys = 512;

// Items with at most this many rows per KV head (decode) take all KV heads: a page is then read
// whole (NHD: one dense region), which the hardware prefetchers stream, instead of one head's
// scattered rows per item. Their parallelism comes from split-K.
inline constexpr int kMaxRowsForAllHeads = 16;

inline int kv_heads_per_item(const PagedAttentionParams& p, const AttentionGeometry& geo,
                             int q_tokens) {
  return q_tokens * geo.group <= kMaxRowsForAllHeads ? p.num_kv_heads : 1;
}

// Query rows per KV head of an item: a page decoded (or packed, blocked prefill) once serves
// them all, so each row's share of that work shrinks with more; kMinItemRows where kItemRows
// would give threads fewer than four items each (more threads: their balance comes first).
inline constexpr int kItemRows = 256;
inline constexpr int kMinItemRows = 64;

// Items of (sequence x KV head x query block) with query blocks of `query_block` tokens.
inline int64_t count_base_items(const PagedAttentionParams& p, const AttentionGeometry& geo,
                                int query_block) {
  int64_t items = 0;
  for (int seq = 0; seq < p.num_seqs; ++seq) {
    const int q_len = query_len(p, seq);
    for (int q_begin = 0; q_begin < q_len; q_begin += query_block) {
      const int q_tokens = std::min(q_len, q_begin + query_block) - q_begin;
      items += p.num_kv_heads / kv_heads_per_item(p, geo, q_tokens);
    }
  }
  return items;
}

// Items for `num_threads` threads: (sequence x KV head x query block), each split into as many
// page-aligned key ranges as it takes to give every thread about four items.
inline AttentionPlan plan_attention(const PagedAttentionParams& p, int num_threads) {
  const AttentionGeometry geo(p);
  AttentionPlan plan;
  const int64_t wanted = 4 * int64_t(std::max(1, num_threads));
  int query_block = std::max(1, kItemRows / geo.group);
  int64_t base_items = count_base_items(p, geo, query_block);
  if (base_items < wanted) {
    query_block = std::max(1, kMinItemRows / geo.group);
    base_items = count_base_items(p, geo, query_block);
  }
  const int64_t splits_wanted = base_items == 0 ? 1 : (wanted + base_items - 1) / base_items;
  for (int seq = 0; seq < p.num_seqs; ++seq) {
    const int seq_len = p.seq_lens[seq];
    const int q_len = query_len(p, seq);
    for (int q_begin = 0; q_begin < q_len; q_begin += query_block) {
      const int q_end = std::min(q_len, q_begin + query_block);
      const int key_begin = key_range(p, seq, seq_len, q_len, q_begin).first;
      const int key_end = key_range(p, seq, seq_len, q_len, q_end - 1).second;
      const int span = key_end - key_begin;
      const int splits =
          p.key_split ? int(std::max<int64_t>(
                            1, std::min<int64_t>(splits_wanted,
                                                 span / std::max(kMinSplitKeys, p.block_size))))
                      : 1;
      const int heads = kv_heads_per_item(p, geo, q_end - q_begin);
      for (int kv_begin = 0; kv_begin < p.num_kv_heads; kv_begin += heads) {
        const int kv_end = kv_begin + heads;
        if (splits == 1) {
          plan.items.push_back({seq, kv_begin, kv_end, q_begin, q_end, key_begin, key_end, -1});
          continue;
        }
        const int64_t rows = int64_t(heads) * (q_end - q_begin) * geo.group;
        const int64_t stride = rows * geo.partial_row_floats();
        plan.merges.push_back({seq, kv_begin, kv_end, q_begin, q_end, splits, plan.scratch_floats});
        // Page-aligned boundaries, as even as the pages allow.
        const int first_page = key_begin / p.block_size;
        const int pages = (key_end - 1) / p.block_size - first_page + 1;
        for (int s = 0; s < splits; ++s) {
          const int b =
              s == 0 ? key_begin : (first_page + int(int64_t(pages) * s / splits)) * p.block_size;
          const int e = s == splits - 1
                            ? key_end
                            : (first_page + int(int64_t(pages) * (s + 1) / splits)) * p.block_size;
          plan.items.push_back({seq, kv_begin, kv_end, q_begin, q_end, b, e, plan.scratch_floats});
          plan.scratch_floats += stride;
        }
      }
    }
  }
  return plan;
}

}  // namespace vllm_kv::cpu::attention
