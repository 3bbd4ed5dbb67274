// CPU paged attention over every cache format (decode, prefill, chunked prefill). Framework-free:
// the torch glue validates the arguments, fills a PagedAttentionParams and passes in a
// parallel-for.
//
// Work item = (sequence, KV head, block of query tokens, split of the key range). Its rows are the
// query tokens of the block times the query heads of the KV head's group (GQA), so that each
// decoded page of K / V serves all of them. Pages are decoded one at a time into an fp32 tile of
// page size (L1 / L2 resident; a sequence's K / V is never materialised) with SIMD format decoders,
// and attended with an online softmax in fp32 (on AVX-512 BF16 builds, decode rows of formats
// exact in bf16 go through vdpbf16ps, the softmax weights rounded to bf16 for the values' sums,
// as in flash attention). Per-tensor or per-head scales are constant within
// an item: the K scale is folded into the query, the V scale into the output. Per-token-head rows
// (int8 / e4m3 values + their own inline fp32 scale) are decoded times that scale into the tiles.
// Long key ranges of few items are split (split-K); the splits' (max, sum, accumulator) partials
// are merged after. Keys stored before RoPE (rope_cos_sin / key_offset / sink_keys given) are
// decoded into the tile and rebuilt there (transform_keys), never fused.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_kernels.h"
#include "cache_kernels.h"
#include "cache_layout.h"
#include "cpu/attention_decode.h"
#include "cpu/attention_plan.h"
#include "cpu/attention_rows.h"
#include "cpu/attention_simd.h"
#include "int4_per_token_head.h"
#include "kv_quant_math.h"
#include "per_token_head.h"

namespace vllm_kv::cpu::attention {

// -------------------------------------------------------------------------------- the kernel

template <CacheKind K, SourceType C, SimdLevel L>
class PagedAttention {
 public:
  static constexpr int kLanes = attention::kLanes<L>;
  using V = VecF<L>;
  using Decoder = EntryDecoder<K, C, L>;

  explicit PagedAttention(const PagedAttentionParams& p)
      : p_(p),
        geo_(p),
        dim_k_(round_up(geo_.head_size)),
        dim_v_(round_up(geo_.head_size_v)),
        tokens_(round_up(p.block_size)),
        key_transform_(p.rope_cos_sin != nullptr || p.key_offset != nullptr ||
                       p.sink_keys != nullptr || p.key_hadamard),
        // Per-token-head rows are decoded (times their inline scales) into the tiles only, and
        // so are keys rebuilt from pre-RoPE ones (transform_keys).
        fused_(L != SimdLevel::kGeneric && !is_per_token_head(K) &&
               K != CacheKind::kInt4PerTokenHead && !key_transform_ &&
               geo_.head_size % kLanes == 0 && geo_.head_size_v % kLanes == 0),
        bf16_dot_(kBf16Dot && fused_ && p.io_type == SourceType::kBFloat16 &&
                  geo_.head_size % 32 == 0),
        bf16_v_(kBf16Dot && fused_ && geo_.head_size_v % 32 == 0),
        nvfp4_chunks_(K == CacheKind::kNvfp4 && bf16_dot_ && bf16_v_ &&
                      geo_.head_size == kChunkHeadSize && geo_.head_size_v == kChunkHeadSize &&
                      p.block_size % kChunkKeys == 0),
        k_page_bytes_(page_bytes(geo_.head_size)),
        v_page_bytes_(page_bytes(geo_.head_size_v)) {
    if constexpr (K == CacheKind::kNvfp4) {
      k_layout_ = Nvfp4SideLayout(p.key_cache, p.block_size, p.num_kv_heads);
      v_layout_ = Nvfp4SideLayout(p.value_cache, p.block_size, p.num_kv_heads);
      for (int g = 0; g < k_layout_.num_groups; ++g) {
        k_groups_.push_back(k_layout_.scale_group_offset(g, p.key_cache.scale_layout));
      }
      for (int g = 0; g < v_layout_.num_groups; ++g) {
        v_groups_.push_back(v_layout_.scale_group_offset(g, p.value_cache.scale_layout));
      }
      if (nvfp4_chunks_) {
        k_scale_select_ = chunk_scale_select(p.key_cache.scale_layout);
        v_scale_select_ = chunk_scale_select(p.value_cache.scale_layout);
        k_scale_rows_ = chunk_scale_rows(k_layout_);
        v_scale_rows_ = chunk_scale_rows(v_layout_);
      }
    }
  }

  void run(const WorkItem& item, float* scratch) const {
    const int q_len = query_len(p_, item.seq);
    const int seq_len = p_.seq_lens[item.seq];
    // Position (in its sequence) of the item's first query token.
    const int first_q_pos = seq_len - q_len + item.q_begin;
    const int tokens = item.q_end - item.q_begin;
    const int heads = item.kv_end - item.kv_begin;
    const int head_rows = tokens * geo_.group;  // rows per KV head
    const int rows = heads * head_rows;
    // Decode in registers when each K / V vector serves one pass over few rows (decode); with
    // many query rows (prefill) a page decoded once into the tiles serves them all.
    const bool fused = fused_ && head_rows <= kMaxFusedRows;
    const bool bf16_dot = fused && bf16_dot_;
    const bool bf16_v = fused && bf16_v_;
    // Per-thread buffers, reused across items.
    thread_local std::vector<float> buffer;
    // (The bf16 query rows of the bf16 dot path take rows * dim_k_ / 2 floats; counted whole.)
    const int64_t need = int64_t(rows) * (2 * dim_k_ + dim_v_ + tokens_ + 2) +
                         int64_t(p_.block_size) * (dim_k_ + dim_v_);
    if (int64_t(buffer.size()) < need) buffer.assign(need, 0.0f);
    float* q = buffer.data();
    float* acc = q + int64_t(rows) * dim_k_;
    float* scores = acc + int64_t(rows) * dim_v_;
    float* m = scores + int64_t(rows) * tokens_;
    float* l = m + rows;
    float* k_tile = l + rows;
    float* v_tile = k_tile + int64_t(p_.block_size) * dim_k_;
    auto* q_bf16 = reinterpret_cast<uint16_t*>(v_tile + int64_t(p_.block_size) * dim_v_);
    const float neg_inf = -std::numeric_limits<float>::infinity();

    // Key range of each query token, within the item's.
    std::vector<std::pair<int, int>> ranges(tokens);
    for (int jt = 0; jt < tokens; ++jt) {
      const auto [begin, end] = key_range(p_, item.seq, seq_len, q_len, item.q_begin + jt);
      ranges[jt] = {std::max(begin, item.key_begin), std::min(end, item.key_end)};
    }
    // Query rows, pre-multiplied by the softmax scale and the K dequantization scale (unless
    // the keys are rebuilt: query_key_scale).
    for (int hh = 0; hh < heads; ++hh) {
      const int kv_head = item.kv_begin + hh;
      const float q_scale = p_.scale * query_key_scale(kv_head);
      for (int jt = 0; jt < tokens; ++jt) {
        const int64_t token = p_.query_start_loc[item.seq] + item.q_begin + jt;
        for (int g = 0; g < geo_.group; ++g) {
          const int r = hh * head_rows + jt * geo_.group + g;
          const int64_t base = token * p_.query_token_stride +
                               int64_t(kv_head * geo_.group + g) * p_.query_head_stride;
          float* row = q + int64_t(r) * dim_k_;
          load_query_row(p_.query, base, p_.io_type, q_scale, geo_.head_size, row);
          if (bf16_dot) {
            // The query as given (bf16); its scale is applied to the scores.
            std::memcpy(q_bf16 + int64_t(r) * dim_k_, static_cast<const uint16_t*>(p_.query) + base,
                        sizeof(uint16_t) * geo_.head_size);
          }
          std::fill(row + geo_.head_size, row + dim_k_, 0.0f);
          std::fill(acc + int64_t(r) * dim_v_, acc + int64_t(r + 1) * dim_v_, 0.0f);
          m[r] = neg_inf;
          l[r] = 0.0f;
        }
      }
    }
    // Zero tile padding so that padded lanes contribute nothing.
    for (int t = 0; t < p_.block_size; ++t) {
      std::fill(k_tile + int64_t(t) * dim_k_ + geo_.head_size, k_tile + int64_t(t + 1) * dim_k_,
                0.0f);
      std::fill(v_tile + int64_t(t) * dim_v_ + geo_.head_size_v, v_tile + int64_t(t + 1) * dim_v_,
                0.0f);
    }

    // Fused path: addresses of the page's rows (data, NVFP4 scales) of the current head.
    thread_local std::vector<const uint8_t*> row_refs;
    if (int64_t(row_refs.size()) < 4 * int64_t(p_.block_size)) row_refs.resize(4 * p_.block_size);
    const uint8_t** k_rows = row_refs.data();
    const uint8_t** k_scales = k_rows + p_.block_size;
    const uint8_t** v_rows = k_scales + p_.block_size;
    const uint8_t** v_scales = v_rows + p_.block_size;

    const int32_t* pages = p_.block_table + int64_t(item.seq) * p_.block_table_stride;
    for (int page_start = item.key_begin - item.key_begin % p_.block_size;
         page_start < item.key_end; page_start += p_.block_size) {
      const int lo = std::max(page_start, item.key_begin);
      const int hi = std::min(page_start + p_.block_size, item.key_end);
      const int64_t block = pages[page_start / p_.block_size];
      // Pages come in block-table order, not address order, and a head's rows of a page are
      // too few for the hardware prefetchers: request a later page's rows now so that their
      // misses overlap this page's work. Whole pages (all heads) are requested one page ahead,
      // a slice per head (below): the whole page at once would be a burst of misses that fills
      // the miss queues and stalls this page's own loads.
      const bool whole_pages = heads == p_.num_kv_heads;
      const int ahead = page_start + (whole_pages ? 1 : kPrefetchPages) * p_.block_size;
      const int64_t next = ahead < item.key_end ? pages[ahead / p_.block_size] : -1;
      if (next >= 0 && !whole_pages) {
        for (int h = item.kv_begin; h < item.kv_end; ++h) {
          prefetch_page(p_.key_cache, k_layout_, next, h, geo_.head_size);
          prefetch_page(p_.value_cache, v_layout_, next, h, geo_.head_size_v);
        }
      }
      // Whether any query token sees a key of this page (causal prefill skips the future).
      bool any = false;
      for (const auto& [b, e] : ranges) any |= std::max(b, lo) < std::min(e, hi);
      if (!any) continue;
      for (int hh = 0; hh < heads; ++hh) {
        const int kv_head = item.kv_begin + hh;
        const int h0 = hh * head_rows;
        if (next >= 0 && whole_pages) {
          prefetch_slice(p_.key_cache, next, k_page_bytes_, hh, heads);
          prefetch_slice(p_.value_cache, next, v_page_bytes_, hh, heads);
        }
#if defined(VLLM_KV_HAVE_AVX512_BF16)
        if constexpr (K == CacheKind::kNvfp4 && kBf16Dot) {
          if (bf16_dot && nvfp4_chunks_) {
            const float q_scale = p_.scale * side_scale(p_.key_cache, kv_head, K);
            for (int t0 = 0; t0 < p_.block_size; t0 += kChunkKeys) {
              if (std::max(page_start + t0, lo) >= std::min(page_start + t0 + kChunkKeys, hi)) {
                continue;
              }
              attend_nvfp4_chunk(block, page_start, t0, kv_head, ranges, first_q_pos, lo, hi,
                                 q_bf16 + int64_t(h0) * dim_k_, q_scale,
                                 scores + int64_t(h0) * tokens_, m + h0, l + h0,
                                 acc + int64_t(h0) * dim_v_);
            }
            continue;
          }
        }
#endif
        if (fused) {
          locate_page(p_.key_cache, k_layout_, block, lo - page_start, hi - page_start, kv_head,
                      k_rows, k_scales);
        } else {
          decode_page(p_.key_cache, k_layout_, k_groups_, block, lo - page_start, hi - page_start,
                      kv_head, geo_.head_size, dim_k_, k_tile);
          if (key_transform_) {
            transform_keys(item.seq, kv_head, page_start, lo - page_start, hi - page_start, k_tile);
          }
        }
        for (int jt = 0; jt < tokens; ++jt) {
          const int b = std::max(ranges[jt].first, lo) - page_start;
          const int e = std::min(ranges[jt].second, hi) - page_start;
          const int r0 = h0 + jt * geo_.group;
          if (b >= e) continue;
          score_rows(q + int64_t(r0) * dim_k_, fused ? nullptr : k_tile, k_rows, k_scales, b, e,
                     scores + int64_t(r0) * tokens_,
                     bf16_dot ? q_bf16 + int64_t(r0) * dim_k_ : nullptr,
                     p_.scale * query_key_scale(kv_head));
          finish_scores(scores + int64_t(r0) * tokens_, b, e, kv_head, first_q_pos + jt,
                        page_start);
          for (int g = 0; g < geo_.group; ++g) {
            softmax_step(scores + int64_t(r0 + g) * tokens_, b, e, m[r0 + g], l[r0 + g],
                         acc + int64_t(r0 + g) * dim_v_);
          }
        }
        if (fused) {
          locate_page(p_.value_cache, v_layout_, block, lo - page_start, hi - page_start, kv_head,
                      v_rows, v_scales);
        } else {
          decode_page(p_.value_cache, v_layout_, v_groups_, block, lo - page_start, hi - page_start,
                      kv_head, geo_.head_size_v, dim_v_, v_tile);
        }
        for (int jt = 0; jt < tokens; ++jt) {
          const int b = std::max(ranges[jt].first, lo) - page_start;
          const int e = std::min(ranges[jt].second, hi) - page_start;
          if (b >= e) continue;
          const int r0 = h0 + jt * geo_.group;
          accumulate_rows(scores + int64_t(r0) * tokens_, fused ? nullptr : v_tile, v_rows,
                          v_scales, b, e, acc + int64_t(r0) * dim_v_, bf16_v);
        }
      }
    }

    if (item.partial < 0) {
      finish_rows(p_, geo_, item.seq, item.kv_begin, item.kv_end, item.q_begin, item.q_end, m, l,
                  acc, dim_v_);
      return;
    }
    float* out = scratch + item.partial;
    const int row_floats = geo_.partial_row_floats();
    for (int r = 0; r < rows; ++r) {
      out[int64_t(r) * row_floats] = m[r];
      out[int64_t(r) * row_floats + 1] = l[r];
      std::memcpy(out + int64_t(r) * row_floats + 2, acc + int64_t(r) * dim_v_,
                  sizeof(float) * geo_.head_size_v);
    }
  }

 private:
  static int round_up(int n) { return (n + kLanes - 1) / kLanes * kLanes; }

  static constexpr int64_t kElementBytes =
      K == CacheKind::kUnquantized ? (C == SourceType::kFloat32 ? 4 : 2) : 1;

  // Cache rows whose values are exact in bf16 (bf16, FP8, NVFP4) go through vdpbf16ps (AVX-512
  // BF16 builds): keys dotted with a bf16 query (rounding differs from the fp32 path only in the
  // order of the fp32 sums), values weighted by the softmax weights rounded to bf16.
#if defined(VLLM_KV_HAVE_AVX512_BF16)
  static constexpr bool kBf16Dot = L == SimdLevel::kAvx512 && !is_per_token_head(K) &&
                                   K != CacheKind::kInt4PerTokenHead &&
                                   (K != CacheKind::kUnquantized || C == SourceType::kBFloat16);
#else
  static constexpr bool kBf16Dot = false;
#endif

  // Rows per KV head up to which an item decodes in registers (fused).
  static constexpr int kMaxFusedRows = 8;

  // The NVFP4 chunk path (attend_nvfp4_chunk): keys per chunk, the head size it takes (one
  // 64-byte row of codes per key) and its block-scale groups.
  static constexpr int kChunkKeys = 16;
  static constexpr int kChunkHeadSize = 128;
  static constexpr int kChunkGroups = kChunkHeadSize / kNvfp4GroupSize;
  // Byte offsets of the first eight scale-plane rows of a chunk, from its first.
  using ChunkScaleRows = std::array<int64_t, 8>;
  // Byte g * kChunkKeys + t: where the scale of (key t, group g) is among a chunk's scale-plane
  // rows (kChunkGroups bytes each, concatenated).
  using ChunkScaleSelect = std::array<uint8_t, kChunkGroups * kChunkKeys>;

  static ChunkScaleSelect chunk_scale_select(ScaleLayout layout) {
    ChunkScaleSelect select{};
    for (int g = 0; g < kChunkGroups; ++g) {
      for (int t = 0; t < kChunkKeys; ++t) {
        int row = t;
        int col = g;
        if (layout == ScaleLayout::kInterleave4) interleave4_position(t, g, kChunkGroups, row, col);
        select[g * kChunkKeys + t] = uint8_t(row * kChunkGroups + col);
      }
    }
    return select;
  }

  static ChunkScaleRows chunk_scale_rows(const Nvfp4SideLayout& layout) {
    ChunkScaleRows rows{};
    for (int r = 0; r < 8; ++r) rows[r] = r * layout.token_step * layout.num_groups;
    return rows;
  }

  // Pages prefetched ahead of the one being attended when items take some heads of a page.
  static constexpr int kPrefetchPages = 2;

  // Bytes of one page of a side (all heads; pages are dense in NHD and HND alike, unless HND heads
  // are spaced: prefetches then cover the first heads only, a hint that costs nothing more).
  int64_t page_bytes(int head_size) const {
    const int64_t last_dim = K == CacheKind::kNvfp4 ? head_size / 2 + head_size / kNvfp4GroupSize
                             : is_per_token_head(K) ? int64_t(head_size) + kPerTokenHeadScaleBytes
                             : K == CacheKind::kInt4PerTokenHead ? int4_row_bytes(head_size)
                                                                 : int64_t(head_size);
    return int64_t(p_.block_size) * p_.num_kv_heads * last_dim * kElementBytes;
  }

  // Requests slice `slice` of `slices` of the first `bytes` bytes of page `block` of a side (a
  // side's page is dense, NHD and HND alike), one request per line.
  void prefetch_slice(const CacheSide& side, int64_t block, int64_t bytes, int slice,
                      int slices) const {
    const char* page =
        static_cast<const char*>(side.data) + block * side.block_stride * kElementBytes;
    const int64_t lines = (bytes + 63) / 64;
    for (int64_t line = lines * slice / slices; line < lines * (slice + 1) / slices; ++line) {
      __builtin_prefetch(page + 64 * line);
    }
  }

  // Start loading the rows of head `head` of page `block` (and NVFP4 scales) into the cache.
  void prefetch_page(const CacheSide& side, const Nvfp4SideLayout& layout, int64_t block, int head,
                     int dim) const {
    const auto* base = static_cast<const char*>(side.data);
    for (int t = 0; t < p_.block_size; ++t) {
      const char* row;
      int64_t bytes;
      if constexpr (K == CacheKind::kNvfp4) {
        row = base + layout.data_offset(block, t, head);
        bytes = dim / 2;
        __builtin_prefetch(base + layout.scale_base(block, t, head, side.scale_layout));
      } else {
        row = base + entry_offset(side, block, t, head) * kElementBytes;
        bytes = dim * kElementBytes;
      }
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
    }
  }

  // The K scale folded into the query rows: 1 when the key tile holds rebuilt keys (they are
  // in real units, as the sink keys and the offset are given).
  float query_key_scale(int kv_head) const {
    return key_transform_ ? 1.0f : side_scale(p_.key_cache, kv_head, K);
  }

  // Rebuilds the keys of tile rows [t0, t1) (positions page_start + t of sequence `seq`, KV head
  // `head`, decoded by decode_page) from pre-RoPE keys: the sink key or the decoded key times the
  // K scale (the reference codec's value), plus the head's offset, then the forward RoPE rotation
  // of row `position` of rope_cos_sin. Scalar: this path is for correctness, not speed.
  // x <- c * H x in place (H the Sylvester Hadamard matrix, c = fp32(1 / sqrt(dim))): the
  // butterflies and the one multiply of kv_quant/hadamard.py, in its order, so that the result
  // is the reference rotation's to the bit.
  static void hadamard_row(float* x, int dim) {
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
    const float c = float(1.0 / std::sqrt(double(dim)));  // fp32(1 / sqrt(D)), as torch rounds it
    for (int d = 0; d < dim; ++d) x[d] *= c;
  }

  void transform_keys(int seq, int head, int page_start, int t0, int t1, float* tile) const {
    const int dim = geo_.head_size;
    const float k_scale = side_scale(p_.key_cache, head, K);
    const float* offset = p_.key_offset != nullptr ? p_.key_offset + int64_t(head) * dim : nullptr;
    const int half = p_.rotary_dim / 2;
    for (int t = t0; t < t1; ++t) {
      const int position = page_start + t;
      float* x = tile + int64_t(t) * dim_k_;
      if (position < p_.num_sink_keys) {
        const int64_t row = (int64_t(seq) * p_.num_sink_keys + position) * p_.num_kv_heads + head;
        std::memcpy(x, p_.sink_keys + row * dim, sizeof(float) * dim);
      } else {
        for (int d = 0; d < dim; ++d) x[d] *= k_scale;
      }
      if (p_.key_hadamard) hadamard_row(x, dim);
      if (offset != nullptr) {
        for (int d = 0; d < dim; ++d) x[d] += offset[d];
      }
      if (p_.rope_cos_sin == nullptr) continue;
      const float* cos = p_.rope_cos_sin + int64_t(position) * p_.rotary_dim;
      const float* sin = cos + half;
      for (int i = 0; i < half; ++i) {
        float& a = x[p_.rope_is_neox ? i : 2 * i];
        float& b = x[p_.rope_is_neox ? i + half : 2 * i + 1];
        const float a0 = a;
        const float b0 = b;
        a = a0 * cos[i] - b0 * sin[i];
        b = b0 * cos[i] + a0 * sin[i];
      }
    }
  }

  // Decodes tokens [t0, t1) of page `block`, head `head` into tile rows t0..t1-1.
  void decode_page(const CacheSide& side, const Nvfp4SideLayout& layout,
                   const std::vector<int64_t>& groups, int64_t block, int t0, int t1, int head,
                   int dim, int row_stride, float* tile) const {
    const auto* base = static_cast<const uint8_t*>(side.data);
    for (int t = t0; t < t1; ++t) {
      float* dst = tile + int64_t(t) * row_stride;
      if constexpr (K == CacheKind::kNvfp4) {
        Decoder::decode(base + layout.data_offset(block, t, head),
                        base + layout.scale_base(block, t, head, side.scale_layout), groups.data(),
                        dim, dst);
      } else {
        Decoder::decode(base + entry_offset(side, block, t, head) * kElementBytes, nullptr, nullptr,
                        dim, dst);
      }
    }
  }

  // Addresses of rows [t0, t1) of head `head` of page `block` (data; NVFP4 scale base).
  void locate_page(const CacheSide& side, const Nvfp4SideLayout& layout, int64_t block, int t0,
                   int t1, int head, const uint8_t** rows, const uint8_t** scales) const {
    const auto* base = static_cast<const uint8_t*>(side.data);
    for (int t = t0; t < t1; ++t) {
      if constexpr (K == CacheKind::kNvfp4) {
        rows[t] = base + layout.data_offset(block, t, head);
        scales[t] = base + layout.scale_base(block, t, head, side.scale_layout);
      } else {
        rows[t] = base + entry_offset(side, block, t, head) * kElementBytes;
      }
    }
  }

  // scores[g][t] = q_g . k_t for the group's rows g and tokens [b, e). K rows
  // come from the decoded tile, or (fused_) are decoded in registers from the cache.
  // q_bf16 (non-null only on the bf16 dot path): the group's query rows in bf16, unscaled;
  // q_scale: what q holds them multiplied by.
  void score_rows(const float* q, const float* k_tile, const uint8_t* const* k_rows,
                  const uint8_t* const* k_scales, int b, int e, float* scores,
                  [[maybe_unused]] const uint16_t* q_bf16, [[maybe_unused]] float q_scale) const {
    int g = 0;
#if defined(VLLM_KV_HAVE_AVX512_BF16)
    if constexpr (kBf16Dot) {
      if (q_bf16 != nullptr) {
        for (; g + 4 <= geo_.group; g += 4) {
          score_chunk_bf16<4>(q_bf16, k_rows, k_scales, b, e, scores, g, q_scale);
        }
        for (; g < geo_.group; ++g) {
          score_chunk_bf16<1>(q_bf16, k_rows, k_scales, b, e, scores, g, q_scale);
        }
      }
    }
#endif
    for (; g + 8 <= geo_.group; g += 8)
      score_chunk<8>(q, k_tile, k_rows, k_scales, b, e, scores, g);
    for (; g + 4 <= geo_.group; g += 4)
      score_chunk<4>(q, k_tile, k_rows, k_scales, b, e, scores, g);
    for (; g < geo_.group; ++g) score_chunk<1>(q, k_tile, k_rows, k_scales, b, e, scores, g);
  }

  // The logits soft cap, then the ALiBi bias (each if any), on scores [b, e) (page offsets: keys
  // at positions page_start + t) of the group's rows of the query token at position q_pos.
  void finish_scores(float* scores, int b, int e, int kv_head, int q_pos, int page_start) const {
    if (p_.logits_soft_cap > 0.0f) {
      const float cap = p_.logits_soft_cap;
      for (int g = 0; g < geo_.group; ++g) {
        float* s = scores + int64_t(g) * tokens_;
        for (int t = b; t < e; ++t) s[t] = cap * std::tanh(s[t] / cap);
      }
    }
    if (p_.alibi_slopes == nullptr) return;
    for (int g = 0; g < geo_.group; ++g) {
      const float slope = p_.alibi_slopes[kv_head * geo_.group + g];
      float* s = scores + int64_t(g) * tokens_;
      for (int t = b; t < e; ++t) s[t] += slope * float(page_start + t - q_pos);
    }
  }

  // Vector d of key t: from the tile, or decoded from the cache when there is no tile (fused).
  V key_vector(const float* k_tile, const uint8_t* const* k_rows, const uint8_t* const* k_scales,
               int t, int d) const {
    if constexpr (L != SimdLevel::kGeneric) {
      if (k_tile == nullptr) return Decoder::vector(k_rows[t], k_scales[t], k_groups_.data(), d);
    }
    return load<L>(k_tile + int64_t(t) * dim_k_ + d);
  }

  V value_vector(const float* v_tile, const uint8_t* const* v_rows, const uint8_t* const* v_scales,
                 int t, int d) const {
    if constexpr (L != SimdLevel::kGeneric) {
      if (v_tile == nullptr) return Decoder::vector(v_rows[t], v_scales[t], v_groups_.data(), d);
    }
    return load<L>(v_tile + int64_t(t) * dim_v_ + d);
  }

#if defined(VLLM_KV_HAVE_AVX512_BF16)
  // Elements [d, d + 32) of a cache row as bf16, exactly: bf16 rows as they are; FP8 by
  // fp8_to_bf16_x32; NVFP4 codes looked up in the kScaledE2M1 rows of the two groups' block
  // scales. groups: the side's group offsets.
  static __m512i row_bf16(const uint8_t* row, const uint8_t* scales, const int64_t* groups, int d) {
    if constexpr (K == CacheKind::kNvfp4) {
      // Word j: source byte j / 2 in both halves, shifted right by 4 for odd j, so that its low
      // nibble is code j; bit 4 picks the table half of the element's group.
      alignas(64) static constexpr auto kDuplicate = [] {
        std::array<uint8_t, 64> index{};
        for (int k = 0; k < 64; ++k) index[k] = uint8_t(k / 4);
        return index;
      }();
      alignas(64) static constexpr auto kShift = [] {
        std::array<uint16_t, 32> shift{};
        for (int j = 0; j < 32; ++j) shift[j] = uint16_t(j % 2 == 0 ? 0 : 4);
        return shift;
      }();
      const __m512i bytes =
          _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d / 2)));
      const __m512i words = _mm512_permutexvar_epi8(_mm512_load_si512(kDuplicate.data()), bytes);
      const __m512i shifted = _mm512_srlv_epi16(words, _mm512_load_si512(kShift.data()));
      const __m512i index = _mm512_ternarylogic_epi32(  // (shifted & 0xF) | half
          shifted, _mm512_set1_epi16(0x0F), _mm512_maskz_set1_epi16(0xFFFF0000u, 16), 0xEA);
      const uint8_t* first = kScaledE2M1.bits[scales[groups[d / kNvfp4GroupSize]]];
      const uint8_t* second = kScaledE2M1.bits[scales[groups[d / kNvfp4GroupSize + 1]]];
      const __m512i table = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(first))),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(second)), 1);
      return _mm512_permutexvar_epi16(index, table);
    } else if constexpr (K == CacheKind::kFp8E4M3 || K == CacheKind::kFp8E5M2) {
      return fp8_to_bf16_x32<K>(row + d);
    } else {
      return _mm512_loadu_si512(row + 2 * d);
    }
  }

  // score_chunk for bf16 keys and a bf16 query: pairs of bf16 products summed in fp32
  // (vdpbf16ps) straight from the cache, then times q_scale. Keys come kKeys per pass; each
  // pass's partial sums are folded right away (the first two levels of the transposing
  // reduction, see reduce_add_many), the last two levels once per kLanes keys.
  template <int kRows>
  void score_chunk_bf16(const uint16_t* q, const uint8_t* const* k_rows,
                        const uint8_t* const* k_scales, int b, int e, float* scores, int g0,
                        float q_scale) const {
    constexpr int kKeys = 4;
    constexpr int kPasses = kLanes / kKeys;
    static_assert(kLanes == 16, "folds below assume 16 lanes");
    const V scale = splat<L>(q_scale);
    for (int t0 = b - b % kLanes; t0 < e; t0 += kLanes) {
      V folded[kRows][kPasses];  // per pass: kKeys keys x 4 partial sums
      for (int pass = 0; pass < kPasses; ++pass) {
        const int first = t0 + kKeys * pass;
        const int lo = std::max(b, first);
        const int hi = std::min(e, first + kKeys);
        if (lo >= hi) {
          for (int i = 0; i < kRows; ++i) folded[i][pass] = V{};
          continue;
        }
        __m512 sum[kKeys][kRows];
        for (int x = 0; x < kKeys; ++x) {
          for (int i = 0; i < kRows; ++i) sum[x][i] = _mm512_setzero_ps();
        }
        for (int d = 0; d < geo_.head_size; d += 32) {
          __m512bh kv[kKeys];
          for (int x = 0; x < kKeys; ++x) {
            // Keys outside [lo, hi) read a valid row; their sums are dropped below.
            const int t = std::clamp(first + x, lo, hi - 1);
            kv[x] = (__m512bh)row_bf16(k_rows[t], k_scales[t], k_groups_.data(), d);
          }
          for (int i = 0; i < kRows; ++i) {
            const auto qv = (__m512bh)_mm512_loadu_si512(q + int64_t(g0 + i) * dim_k_ + d);
            for (int x = 0; x < kKeys; ++x) sum[x][i] = _mm512_dpbf16_ps(sum[x][i], qv, kv[x]);
          }
        }
        for (int x = 0; x < kKeys; ++x) {
          if (first + x >= lo && first + x < hi) continue;
          for (int i = 0; i < kRows; ++i) sum[x][i] = _mm512_setzero_ps();
        }
        for (int i = 0; i < kRows; ++i) {
          folded[i][pass] =
              fold<8>(fold<16>(V(sum[0][i]), V(sum[1][i])), fold<16>(V(sum[2][i]), V(sum[3][i])));
        }
      }
      const int tb = std::max(b, t0);
      const int te = std::min(e, t0 + kLanes);
      for (int i = 0; i < kRows; ++i) {
        float* row = scores + int64_t(g0 + i) * tokens_;
        const V s =
            fold<2>(fold<4>(folded[i][0], folded[i][1]), fold<4>(folded[i][2], folded[i][3])) *
            scale;
        if (tb == t0 && te == t0 + kLanes) {
          store<L>(row + t0, s);
        } else {
          for (int t = tb; t < te; ++t) row[t] = s[t - t0];
        }
      }
    }
  }

  // One level of the transposing reduction (fold_pair) over kLanes lanes: a and b hold
  // kLanes / kPartials keys of kPartials partial sums each.
  template <int kPartials>
  static V fold(V a, V b) {
    return fold_pair<kLanes, kPartials>(a, b, std::make_index_sequence<kLanes>{});
  }

  // accumulate_chunk by vdpbf16ps, keys in pairs: the V rows of keys t and t + 1, interleaved
  // element by element, meet the pair (w[g][t], w[g][t + 1]) rounded to bf16 (as flash attention
  // rounds its probabilities for the PV product); sums in fp32. A lone last key pairs with zeros.
  template <int kRows>
  void accumulate_chunk_bf16(const float* weights, const uint8_t* const* v_rows,
                             const uint8_t* const* v_scales, int b, int e, float* acc,
                             int g0) const {
    for (int tb = b; tb < e; tb += 16) {
      const int te = std::min(e, tb + 16);
      // Row i's weights of keys [tb, te) in bf16, zero past te: pair j is pairs[i][j].
      alignas(32) uint32_t pairs[kRows][8];
      const __mmask16 valid = __mmask16((1u << (te - tb)) - 1);
      for (int i = 0; i < kRows; ++i) {
        const __m512 w = _mm512_maskz_loadu_ps(valid, weights + int64_t(g0 + i) * tokens_ + tb);
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[i]), (__m256i)_mm512_cvtneps_pbh(w));
      }
      int d = 0;
      if constexpr (kRows <= 4) {  // two slices of 32 per pass: enough chains in flight
        for (; d + 64 <= geo_.head_size_v; d += 64) {
          accumulate_slices_bf16<kRows, 2>(pairs, v_rows, v_scales, tb, te, acc, g0, d);
        }
      }
      for (; d < geo_.head_size_v; d += 32) {
        accumulate_slices_bf16<kRows, 1>(pairs, v_rows, v_scales, tb, te, acc, g0, d);
      }
    }
  }

  // Elements [d, d + 32 kSlices) of the rows' accumulators over keys [tb, te) (see above).
  template <int kRows, int kSlices>
  void accumulate_slices_bf16(const uint32_t (*pairs)[8], const uint8_t* const* v_rows,
                              const uint8_t* const* v_scales, int tb, int te, float* acc, int g0,
                              int d) const {
    // Lane 2j of the interleave: element j (of the half) of key t; lane 2j + 1: of key t + 1.
    alignas(64) static constexpr uint16_t kFirst[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                        37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                        11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i first_half = _mm512_load_si512(kFirst);
    const __m512i second_half = _mm512_add_epi16(first_half, _mm512_set1_epi16(16));
    __m512 a[kSlices][2][kRows];
    for (int c = 0; c < kSlices; ++c) {
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < kRows; ++i) {
          a[c][h][i] = _mm512_loadu_ps(acc + int64_t(g0 + i) * dim_v_ + d + 32 * c + 16 * h);
        }
      }
    }
    for (int t = tb; t < te; t += 2) {
      const bool partner = t + 1 < te;
      __m512bh w[kRows];
      for (int i = 0; i < kRows; ++i)
        w[i] = (__m512bh)_mm512_set1_epi32(int(pairs[i][(t - tb) / 2]));
      for (int c = 0; c < kSlices; ++c) {
        const __m512i x = row_bf16(v_rows[t], v_scales[t], v_groups_.data(), d + 32 * c);
        const __m512i y =
            partner ? row_bf16(v_rows[t + 1], v_scales[t + 1], v_groups_.data(), d + 32 * c)
                    : _mm512_setzero_si512();
        const auto lo = (__m512bh)_mm512_permutex2var_epi16(x, first_half, y);
        const auto hi = (__m512bh)_mm512_permutex2var_epi16(x, second_half, y);
        for (int i = 0; i < kRows; ++i) {
          a[c][0][i] = _mm512_dpbf16_ps(a[c][0][i], lo, w[i]);
          a[c][1][i] = _mm512_dpbf16_ps(a[c][1][i], hi, w[i]);
        }
      }
    }
    for (int c = 0; c < kSlices; ++c) {
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < kRows; ++i) {
          _mm512_storeu_ps(acc + int64_t(g0 + i) * dim_v_ + d + 32 * c + 16 * h, a[c][h][i]);
        }
      }
    }
  }

  // acc + the vdpbf16ps of `values` with the bf16 pair at `pair` in every lane.
  static __m512 dot_pair(__m512 acc, __m512bh values, const void* pair) {
    int32_t bits;
    std::memcpy(&bits, pair, sizeof(bits));
    return _mm512_dpbf16_ps(acc, values, (__m512bh)_mm512_set1_epi32(bits));
  }

  // NVFP4 in chunks of kChunkKeys keys (head size kChunkHeadSize on both sides). E2M1 codes become
  // bf16 unscaled (exact) by one vpermw from a register, and the block scales are applied in fp32:
  // no per-group table is loaded and no lane sums are folded. Keys: the chunk's rows transposed
  // so that lanes are keys, each group's dot products multiplied by the keys' block scales.
  // Values: keys in pairs, interleaved element by element, against the softmax weight times the
  // key's block scale, rounded to bf16 (as the weights alone are on the other formats' path).

  // Where a side's key rows and scale-plane rows of one chunk of one head are.
  struct Nvfp4Chunk {
    const uint8_t* data;    // the chunk's first key row
    int64_t data_step;      // bytes between key rows
    const uint8_t* scales;  // the chunk's first scale-plane row (kChunkGroups bytes per row)
  };

  Nvfp4Chunk chunk_at(const CacheSide& side, const Nvfp4SideLayout& layout, int64_t block, int t0,
                      int head) const {
    const auto* base = static_cast<const uint8_t*>(side.data);
    // The scale plane's rows are the linear layout's entries, whatever the layout puts in them.
    return {base + layout.data_offset(block, t0, head), layout.token_step * layout.data_bytes,
            base + layout.scale_base(block, t0, head, ScaleLayout::kLinear)};
  }

  // scale[g] lane t: block scale of group g of key t, fp32 (exact). The chunk's kChunkKeys
  // scale-plane rows are gathered and permuted by `select` (chunk_scale_select).
  static void chunk_scales(const Nvfp4Chunk& chunk, const ChunkScaleRows& rows,
                           const ChunkScaleSelect& select, __m512 (&scale)[kChunkGroups]) {
    // (The masked and maskz forms of the intrinsics below: GCC 12 warns about the undefined
    // vectors of the plain ones.)
    const __m512i index = _mm512_load_si512(rows.data());
    const __m512i first =
        _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), 0xFF, index, chunk.scales, 1);
    const __m512i second = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), 0xFF, index,
                                                       chunk.scales + 8 * rows[1], 1);
    const __m512i low = _mm512_permutex2var_epi8(first, _mm512_load_si512(select.data()), second);
    const __m512i high =
        _mm512_permutex2var_epi8(first, _mm512_load_si512(select.data() + 64), second);
    const auto to_fp32 = [](__m128i bytes) {
      const __m256i half = Decoder::e4m3_as_fp16_bits(_mm256_cvtepu8_epi16(bytes));
      return _mm512_mul_ps(_mm512_maskz_cvtph_ps(0xFFFF, half), _mm512_set1_ps(256.0f));
    };
    scale[0] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, low, 0));
    scale[1] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, low, 1));
    scale[2] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, low, 2));
    scale[3] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, low, 3));
    scale[4] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, high, 0));
    scale[5] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, high, 1));
    scale[6] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, high, 2));
    scale[7] = to_fp32(_mm512_maskz_extracti32x4_epi32(0xF, high, 3));
  }

  // bf16 bits of the E2M1 values, twice: vpermw reads an index's low five bits, so bit 4 (left
  // over from the neighbouring nibble) may be anything.
  static __m512i e2m1_bf16_table() {
    alignas(64) static constexpr auto kTable = [] {
      std::array<uint16_t, 32> bits{};
      for (int i = 0; i < 32; ++i)
        bits[i] = uint16_t(std::bit_cast<uint32_t>(kE2M1Values[i % 16]) >> 16);
      return bits;
    }();
    return _mm512_load_si512(kTable.data());
  }

  // In place: r[j] lane t becomes r[t] lane j (a 16 x 16 transpose of 32-bit elements).
  static void transpose_16x16(__m512i (&r)[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    // r[4i + c], 128-bit lane b: column 4b + c of rows 4i .. 4i + 3.
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      const __m512i u = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
      const __m512i v = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
      const __m512i w = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
      const __m512i x = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
      t[c] = _mm512_shuffle_i32x4(u, v, 0x88);
      t[4 + c] = _mm512_shuffle_i32x4(u, v, 0xDD);
      t[8 + c] = _mm512_shuffle_i32x4(w, x, 0x88);
      t[12 + c] = _mm512_shuffle_i32x4(w, x, 0xDD);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
  }

  // scores[i][t] = q_i . k_t (times q_scale) for the chunk's keys t, kRows query rows (bf16, row
  // stride dim_k_). Byte p of every key row holds elements 2p, 2p + 1: after the transpose a
  // vpmultishiftqb puts both nibbles of byte p of each key where vpermw reads its index.
  template <int kRows>
  void score_nvfp4_chunk(const Nvfp4Chunk& chunk, const __m512 (&scale)[kChunkGroups],
                         const uint16_t* q, float q_scale, float* scores) const {
    // Per 64-bit lane (two keys): the bit offsets of byte k's low and high nibble of each key.
    alignas(64) static constexpr auto kNibbles = [] {
      std::array<std::array<uint8_t, 64>, 4> control{};
      for (int k = 0; k < 4; ++k) {
        for (int b = 0; b < 64; ++b) {
          const int key = (b / 4) % 2;
          const int high = (b / 2) % 2;
          control[k][b] = uint8_t(32 * key + 8 * k + 4 * high);
        }
      }
      return control;
    }();
    __m512i column[kChunkKeys];
    for (int t = 0; t < kChunkKeys; ++t) {
      column[t] = _mm512_loadu_si512(chunk.data + t * chunk.data_step);
    }
    transpose_16x16(column);  // column[j] lane t: bytes [4j, 4j + 4) of key t
    const __m512i table = e2m1_bf16_table();
    __m512 score[kRows];
    for (int i = 0; i < kRows; ++i) score[i] = _mm512_setzero_ps();
    // Unrolled whole: column[] stays in registers.
#pragma GCC unroll 8
    for (int g = 0; g < kChunkGroups; ++g) {
      __m512 sum[kRows];
      for (int i = 0; i < kRows; ++i) sum[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int p = g * kNvfp4GroupSize / 2; p < (g + 1) * kNvfp4GroupSize / 2; ++p) {
        const __m512i index =
            _mm512_multishift_epi64_epi8(_mm512_load_si512(kNibbles[p % 4].data()), column[p / 4]);
        const auto codes = (__m512bh)_mm512_permutexvar_epi16(index, table);
        for (int i = 0; i < kRows; ++i) sum[i] = dot_pair(sum[i], codes, q + i * dim_k_ + 2 * p);
      }
      for (int i = 0; i < kRows; ++i) score[i] = _mm512_fmadd_ps(sum[i], scale[g], score[i]);
    }
    for (int i = 0; i < kRows; ++i) {
      _mm512_storeu_ps(scores + int64_t(i) * tokens_,
                       _mm512_mul_ps(score[i], _mm512_set1_ps(q_scale)));
    }
  }

  // acc_i += sum_t w[i][t] v_t over the chunk's keys for kRows rows (weights: row stride tokens_;
  // valid[i]: the keys row i attends).
  template <int kRows>
  void accumulate_nvfp4_chunk(const Nvfp4Chunk& chunk, const __m512 (&scale)[kChunkGroups],
                              const __m512 (&weights)[kRows], const __mmask16* valid,
                              float* acc) const {
    // A key pair's values, element by element (dword j of a group: element j of the first key,
    // then of the second), in two steps. kGather: 64-bit lane q of a quad of groups holds byte q
    // of each of the four groups of the first key (bytes 0-3), then of the second (4-7), which
    // are elements 2q and 2q + 1 of each. kNibbles[k]: each word of lane q takes the nibble of
    // group k of the quad that it decodes (vpermw reads an index's low five bits; the fifth,
    // from the neighbouring nibble, is ignored by the doubled table).
    constexpr int kQuads = kChunkGroups / 4;
    alignas(64) static constexpr auto kGather = [] {
      std::array<std::array<uint8_t, 64>, kQuads> index{};
      for (int quad = 0; quad < kQuads; ++quad) {
        for (int b = 0; b < 64; ++b) {
          const int lane = b / 8;
          const int second = (b % 8) / 4;
          const int group = 4 * quad + b % 4;
          index[quad][b] = uint8_t(64 * second + 8 * group + lane);
        }
      }
      return index;
    }();
    alignas(64) static constexpr auto kNibbles = [] {
      std::array<std::array<uint8_t, 64>, 4> control{};
      for (int k = 0; k < 4; ++k) {
        for (int b = 0; b < 64; ++b) {
          const int word = (b / 2) % 4;  // element 2q (words 0, 1) or 2q + 1 (2, 3); key word % 2
          control[k][b] = uint8_t(8 * (4 * (word % 2) + k) + 4 * (word / 2));
        }
      }
      return control;
    }();
    // pairs[g][i][m]: row i's weights of keys 2m, 2m + 1 times their group-g scales, in bf16.
    alignas(32) uint32_t pairs[kChunkGroups][kRows][kChunkKeys / 2];
    __mmask16 keys = 0;
    for (int i = 0; i < kRows; ++i) {
      keys |= valid[i];
      // (Masked: a key outside valid[i] may have any scale byte, NaN included.)
      for (int g = 0; g < kChunkGroups; ++g) {
        _mm256_store_si256(
            reinterpret_cast<__m256i*>(pairs[g][i]),
            (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mul_ps(valid[i], weights[i], scale[g])));
      }
    }
    const __m512i table = e2m1_bf16_table();
    // kGroups groups (whole quads) per pass: each pair of key rows is loaded once for all of
    // them, and the kGroups * kRows accumulators are enough independent vdpbf16ps chains to hide
    // its latency.
    constexpr int kGroups = kRows >= 4 ? 4 : kChunkGroups;
    for (int g0 = 0; g0 < kChunkGroups; g0 += kGroups) {
      __m512 a[kGroups][kRows];
      for (int h = 0; h < kGroups; ++h) {
        for (int i = 0; i < kRows; ++i) {
          a[h][i] = _mm512_loadu_ps(acc + int64_t(i) * dim_v_ + (g0 + h) * kNvfp4GroupSize);
        }
      }
      for (int pair = 0; pair < kChunkKeys / 2; ++pair) {
        if (((keys >> (2 * pair)) & 3) == 0) continue;
        const __m512i x = _mm512_loadu_si512(chunk.data + 2 * pair * chunk.data_step);
        const __m512i y = _mm512_loadu_si512(chunk.data + (2 * pair + 1) * chunk.data_step);
        __m512i quads[kGroups / 4];
        for (int u = 0; u < kGroups / 4; ++u) {
          quads[u] = _mm512_permutex2var_epi8(x, _mm512_load_si512(kGather[g0 / 4 + u].data()), y);
        }
        for (int h = 0; h < kGroups; ++h) {
          const __m512i index =
              _mm512_multishift_epi64_epi8(_mm512_load_si512(kNibbles[h % 4].data()), quads[h / 4]);
          const auto values = (__m512bh)_mm512_permutexvar_epi16(index, table);
          for (int i = 0; i < kRows; ++i)
            a[h][i] = dot_pair(a[h][i], values, &pairs[g0 + h][i][pair]);
        }
      }
      for (int h = 0; h < kGroups; ++h) {
        for (int i = 0; i < kRows; ++i) {
          _mm512_storeu_ps(acc + int64_t(i) * dim_v_ + (g0 + h) * kNvfp4GroupSize, a[h][i]);
        }
      }
    }
  }

  // exp(x) for x <= 0 (-inf gives 0): 2^k * 2^f with t = x log2(e), k = round(t), f = t - k in
  // [-1/2, 1/2], 2^f by its degree-6 Taylor polynomial (relative error ~1e-7 plus t's rounding),
  // the product by vscalefps (t clamped at -200: 0 exactly).
  static __m512 exp_scalef(__m512 x) {
    const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _mm512_set1_ps(-200.0f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, k);
    // ln(2)^n / n!
    __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
  }

  // out[i] = op-reduction of the 16 lanes of v[i]. Four rows share one transposing tree.
  template <int kRows, typename Op>
  static void reduce_rows(const __m512 (&v)[kRows], Op op, float (&out)[kRows]) {
    if constexpr (kRows == 4) {
      // a: lanes 0-7 v[0]'s halves combined, 8-15 v[1]'s; b likewise for v[2], v[3]; c: 128-bit
      // lane r holds row r's four partials; then within each 128-bit lane.
      const __m512 a =
          op(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
      const __m512 b =
          op(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
      const __m512 c = op(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
      const __m512 d = op(c, _mm512_permute_ps(c, 0x4E));
      const __m512 e = op(d, _mm512_permute_ps(d, 0xB1));
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, e);
      for (int i = 0; i < 4; ++i) out[i] = lanes[4 * i];
    } else {
      for (int i = 0; i < kRows; ++i) {
        __m512 x = v[i];
        x = op(x, _mm512_shuffle_f32x4(x, x, 0x4E));
        x = op(x, _mm512_shuffle_f32x4(x, x, 0xB1));
        x = op(x, _mm512_permute_ps(x, 0x4E));
        x = op(x, _mm512_permute_ps(x, 0xB1));
        out[i] = _mm512_cvtss_f32(x);
      }
    }
  }

  // Online-softmax update of kRows rows with a chunk's scores (row stride tokens_; keys outside
  // valid[i] ignored): new maxima, sums, accumulators rescaled; weights[i] = exp(s - max) on
  // valid[i], 0 elsewhere. A row without a finite score keeps its state (weights 0), as
  // softmax_step does.
  template <int kRows>
  void softmax_chunk(const float* scores, const __mmask16* valid, float* m, float* l, float* acc,
                     __m512 (&weights)[kRows]) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    __m512 s[kRows];
    float top[kRows];
    for (int i = 0; i < kRows; ++i) {
      s[i] = _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), valid[i], scores + int64_t(i) * tokens_);
    }
    reduce_rows<kRows>(s, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }, top);
    for (int i = 0; i < kRows; ++i) {
      if (top[i] == neg_inf) {
        weights[i] = _mm512_setzero_ps();
        continue;
      }
      const float new_max = std::max(m[i], top[i]);
      weights[i] =
          _mm512_maskz_mov_ps(valid[i], exp_scalef(_mm512_sub_ps(s[i], _mm512_set1_ps(new_max))));
      if (new_max != m[i]) {
        const float correction = std::exp(m[i] - new_max);  // 0 for the first keys
        l[i] *= correction;
        float* a = acc + int64_t(i) * dim_v_;
        for (int d = 0; d < kChunkHeadSize; d += 16) {
          _mm512_storeu_ps(a + d,
                           _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_set1_ps(correction)));
        }
        m[i] = new_max;
      }
    }
    float sums[kRows];
    reduce_rows<kRows>(weights, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }, sums);
    for (int i = 0; i < kRows; ++i) l[i] += sums[i];
  }

  // One chunk (page tokens [t0, t0 + kChunkKeys)) of one KV head for the item's rows of that head:
  // scores, online softmax, values. q / scores / m / l / acc: the head's first row.
  void attend_nvfp4_chunk(int64_t block, int page_start, int t0, int kv_head,
                          const std::vector<std::pair<int, int>>& ranges, int first_q_pos, int lo,
                          int hi, const uint16_t* q, float q_scale, float* scores, float* m,
                          float* l, float* acc) const {
    const int rows = int(ranges.size()) * geo_.group;
    __m512 scale[kChunkGroups];
    const Nvfp4Chunk keys = chunk_at(p_.key_cache, k_layout_, block, t0, kv_head);
    chunk_scales(keys, k_scale_rows_, k_scale_select_, scale);
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      score_nvfp4_chunk<4>(keys, scale, q + int64_t(r) * dim_k_, q_scale,
                           scores + int64_t(r) * tokens_ + t0);
    }
    for (; r < rows; ++r) {
      score_nvfp4_chunk<1>(keys, scale, q + int64_t(r) * dim_k_, q_scale,
                           scores + int64_t(r) * tokens_ + t0);
    }
    __mmask16 valid[kMaxFusedRows];
    const int chunk_lo = std::max(lo, page_start + t0);
    const int chunk_hi = std::min(hi, page_start + t0 + kChunkKeys);
    for (int jt = 0; jt < int(ranges.size()); ++jt) {
      const int b = std::max(ranges[jt].first, chunk_lo) - page_start;
      const int e = std::min(ranges[jt].second, chunk_hi) - page_start;
      const int r0 = jt * geo_.group;
      const __mmask16 mask =
          b < e ? __mmask16(((1u << (e - t0)) - 1) & ~((1u << (b - t0)) - 1)) : __mmask16(0);
      for (int g = 0; g < geo_.group; ++g) valid[r0 + g] = mask;
      if (b < e) {
        finish_scores(scores + int64_t(r0) * tokens_, b, e, kv_head, first_q_pos + jt, page_start);
      }
    }
    const Nvfp4Chunk values = chunk_at(p_.value_cache, v_layout_, block, t0, kv_head);
    chunk_scales(values, v_scale_rows_, v_scale_select_, scale);
    for (r = 0; r + 4 <= rows; r += 4) {
      __m512 weights[4];
      softmax_chunk<4>(scores + int64_t(r) * tokens_ + t0, valid + r, m + r, l + r,
                       acc + int64_t(r) * dim_v_, weights);
      accumulate_nvfp4_chunk<4>(values, scale, weights, valid + r, acc + int64_t(r) * dim_v_);
    }
    for (; r < rows; ++r) {
      __m512 weights[1];
      softmax_chunk<1>(scores + int64_t(r) * tokens_ + t0, valid + r, m + r, l + r,
                       acc + int64_t(r) * dim_v_, weights);
      accumulate_nvfp4_chunk<1>(values, scale, weights, valid + r, acc + int64_t(r) * dim_v_);
    }
  }
#endif

  // Tokens are taken kLanes at a time: per token, a vector of partial dot products per row,
  // then one transposing reduction per row gives the kLanes scores (instead of a horizontal sum
  // per token and row). Two tokens per pass when the rows are few, so that enough independent
  // FMA chains are in flight.
  template <int kRows>
  void score_chunk(const float* q, const float* k_tile, const uint8_t* const* k_rows,
                   const uint8_t* const* k_scales, int b, int e, float* scores, int g0) const {
    constexpr int kTokens = kRows <= 4 ? 2 : 1;
    V part[kRows][kLanes];
    for (int t0 = b - b % kLanes; t0 < e; t0 += kLanes) {
      const int tb = std::max(b, t0);
      const int te = std::min(e, t0 + kLanes);
      const bool whole = tb == t0 && te == t0 + kLanes;
      if (!whole) {
        for (int i = 0; i < kRows; ++i) std::fill(part[i], part[i] + kLanes, V{});
      }
      int t = tb;
      for (; t + kTokens <= te; t += kTokens) {
        V sum[kTokens][kRows] = {};
        for (int d = 0; d < dim_k_; d += kLanes) {
          V kv[kTokens];
          for (int x = 0; x < kTokens; ++x) kv[x] = key_vector(k_tile, k_rows, k_scales, t + x, d);
          for (int i = 0; i < kRows; ++i) {
            const V qv = load<L>(q + int64_t(g0 + i) * dim_k_ + d);
            for (int x = 0; x < kTokens; ++x) sum[x][i] = fmadd<L>(qv, kv[x], sum[x][i]);
          }
        }
        for (int x = 0; x < kTokens; ++x) {
          for (int i = 0; i < kRows; ++i) part[i][t + x - t0] = sum[x][i];
        }
      }
      for (; t < te; ++t) {
        V sum[kRows] = {};
        for (int d = 0; d < dim_k_; d += kLanes) {
          const V kv = key_vector(k_tile, k_rows, k_scales, t, d);
          for (int i = 0; i < kRows; ++i) {
            sum[i] = fmadd<L>(load<L>(q + int64_t(g0 + i) * dim_k_ + d), kv, sum[i]);
          }
        }
        for (int i = 0; i < kRows; ++i) part[i][t - t0] = sum[i];
      }
      for (int i = 0; i < kRows; ++i) {
        // t0 + kLanes <= tokens_ (t0 < block_size, a multiple of kLanes): within the row.
        float* row = scores + int64_t(g0 + i) * tokens_;
        const V s = reduce_add_many<kLanes>(part[i]);
        if (whole) {
          store<L>(row + t0, s);
        } else {
          for (int tt = tb; tt < te; ++tt) row[tt] = s[tt - t0];
        }
      }
    }
  }

  // Online-softmax update of one row with the scores of keys [b, e) of a page: new max, rescale
  // of the running sum and accumulator, scores replaced by their weights exp(s - max). The
  // lanes outside [b, e) of the vectors touched are set to -inf first (weight 0).
  void softmax_step(float* s, int b, int e, float& m, float& l, float* acc) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int vb = b - b % kLanes;
    const int ve = (e + kLanes - 1) / kLanes * kLanes;
    std::fill(s + vb, s + b, neg_inf);
    std::fill(s + e, s + ve, neg_inf);
    V top = splat<L>(neg_inf);
    for (int t = vb; t < ve; t += kLanes) top = vmax<L>(top, load<L>(s + t));
    const float page_max = reduce_max<kLanes>(top);
    if (page_max == neg_inf) return;
    const float new_max = std::max(m, page_max);
    V sum = V{};
    for (int t = vb; t < ve; t += kLanes) {
      const V w = vexp<L>(load<L>(s + t) - new_max);
      store<L>(s + t, w);
      sum += w;
    }
    if (new_max != m) {
      const float correction = std::exp(m - new_max);  // 0 for the first keys
      l *= correction;
      const V c = splat<L>(correction);
      for (int d = 0; d < dim_v_; d += kLanes) store<L>(acc + d, load<L>(acc + d) * c);
      m = new_max;
    }
    l += reduce_add<kLanes>(sum);
  }

  // acc_g += sum_t w[g][t] * v_t for the group's rows; bf16: by the bf16 dot (fused V rows).
  void accumulate_rows(const float* weights, const float* v_tile, const uint8_t* const* v_rows,
                       const uint8_t* const* v_scales, int b, int e, float* acc,
                       [[maybe_unused]] bool bf16) const {
    int g = 0;
#if defined(VLLM_KV_HAVE_AVX512_BF16)
    if constexpr (kBf16Dot) {
      if (bf16) {
        for (; g + 4 <= geo_.group; g += 4) {
          accumulate_chunk_bf16<4>(weights, v_rows, v_scales, b, e, acc, g);
        }
        for (; g < geo_.group; ++g) {
          accumulate_chunk_bf16<1>(weights, v_rows, v_scales, b, e, acc, g);
        }
      }
    }
#endif
    for (; g + 8 <= geo_.group; g += 8) {
      accumulate_chunk<8>(weights, v_tile, v_rows, v_scales, b, e, acc, g);
    }
    for (; g + 4 <= geo_.group; g += 4) {
      accumulate_chunk<4>(weights, v_tile, v_rows, v_scales, b, e, acc, g);
    }
    for (; g < geo_.group; ++g)
      accumulate_chunk<1>(weights, v_tile, v_rows, v_scales, b, e, acc, g);
  }

  // Two vectors of the head dimension per pass when the rows are few: enough independent FMA
  // chains in flight.
  template <int kRows>
  void accumulate_chunk(const float* weights, const float* v_tile, const uint8_t* const* v_rows,
                        const uint8_t* const* v_scales, int b, int e, float* acc, int g0) const {
    constexpr int kVecs = kRows <= 4 ? 2 : 1;
    int d = 0;
    for (; d + kVecs * kLanes <= dim_v_; d += kVecs * kLanes) {
      V a[kVecs][kRows];
      for (int x = 0; x < kVecs; ++x) {
        for (int i = 0; i < kRows; ++i) {
          a[x][i] = load<L>(acc + int64_t(g0 + i) * dim_v_ + d + x * kLanes);
        }
      }
      for (int t = b; t < e; ++t) {
        V v[kVecs];
        for (int x = 0; x < kVecs; ++x) {
          v[x] = value_vector(v_tile, v_rows, v_scales, t, d + x * kLanes);
        }
        for (int i = 0; i < kRows; ++i) {
          const V w = splat<L>(weights[int64_t(g0 + i) * tokens_ + t]);
          for (int x = 0; x < kVecs; ++x) a[x][i] = fmadd<L>(w, v[x], a[x][i]);
        }
      }
      for (int x = 0; x < kVecs; ++x) {
        for (int i = 0; i < kRows; ++i) {
          store<L>(acc + int64_t(g0 + i) * dim_v_ + d + x * kLanes, a[x][i]);
        }
      }
    }
    for (; d < dim_v_; d += kLanes) {
      V a[kRows];
      for (int i = 0; i < kRows; ++i) a[i] = load<L>(acc + int64_t(g0 + i) * dim_v_ + d);
      for (int t = b; t < e; ++t) {
        const V v = value_vector(v_tile, v_rows, v_scales, t, d);
        for (int i = 0; i < kRows; ++i) {
          a[i] = fmadd<L>(splat<L>(weights[int64_t(g0 + i) * tokens_ + t]), v, a[i]);
        }
      }
      for (int i = 0; i < kRows; ++i) store<L>(acc + int64_t(g0 + i) * dim_v_ + d, a[i]);
    }
  }

  const PagedAttentionParams& p_;
  AttentionGeometry geo_;
  int dim_k_;   // head_size rounded up to whole vectors (tile and query row stride)
  int dim_v_;   // head_size_v rounded up (tile and accumulator row stride)
  int tokens_;  // block_size rounded up (score row stride)
  // rope_cos_sin, key_offset or sink_keys given: keys are rebuilt by transform_keys.
  bool key_transform_;
  // Decode in registers inside the dot products is possible (vector levels, head sizes of whole
  // vectors, keys as stored); otherwise pages are always decoded into the fp32 tiles first.
  bool fused_;
  // The bf16 dot path applies (kBf16Dot, a bf16 query, head size of whole 32-element vectors).
  bool bf16_dot_;
  // V rows are accumulated by the bf16 dot (kBf16Dot, head size of whole 32-element vectors).
  bool bf16_v_;
  // NVFP4 pages go through attend_nvfp4_chunk (bf16 dot on both sides, head size
  // kChunkHeadSize, pages of whole chunks).
  bool nvfp4_chunks_;
  alignas(64) ChunkScaleSelect k_scale_select_{};
  alignas(64) ChunkScaleSelect v_scale_select_{};
  alignas(64) ChunkScaleRows k_scale_rows_{};
  alignas(64) ChunkScaleRows v_scale_rows_{};
  int64_t k_page_bytes_;
  int64_t v_page_bytes_;
  Nvfp4SideLayout k_layout_{};
  Nvfp4SideLayout v_layout_{};
  std::vector<int64_t> k_groups_;
  std::vector<int64_t> v_groups_;
};

// Runs the attention of `p` with instruction set `level` (kAuto: the widest compiled) over the
// items of `plan`. parallel_for(begin, end, grain, fn) runs fn on sub-ranges of [begin, end) in
// parallel. scratch holds plan.scratch_floats floats.
template <typename ParallelFor>
void paged_attention(const PagedAttentionParams& p, const AttentionPlan& plan, float* scratch,
                     SimdLevel level, const ParallelFor& parallel_for) {
  if (level == SimdLevel::kAuto) level = widest_simd_level();
  const auto run = [&](auto kind_tag, auto type_tag, auto level_tag) {
    const PagedAttention<decltype(kind_tag)::value, decltype(type_tag)::value,
                         decltype(level_tag)::value>
        kernel(p);
    parallel_for(0, int64_t(plan.items.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) kernel.run(plan.items[i], scratch);
    });
  };
  const auto with_level = [&](auto kind_tag, auto type_tag) {
    switch (level) {
#if defined(VLLM_KV_HAVE_AVX512)
      case SimdLevel::kAvx512:
        return run(kind_tag, type_tag, std::integral_constant<SimdLevel, SimdLevel::kAvx512>{});
#endif
#if defined(VLLM_KV_HAVE_AVX2)
      case SimdLevel::kAvx2:
        return run(kind_tag, type_tag, std::integral_constant<SimdLevel, SimdLevel::kAvx2>{});
#endif
      default:
        return run(kind_tag, type_tag, std::integral_constant<SimdLevel, SimdLevel::kGeneric>{});
    }
  };
  using F32 = std::integral_constant<SourceType, SourceType::kFloat32>;
  switch (p.cache_kind) {
    case CacheKind::kFp8E4M3:
      with_level(std::integral_constant<CacheKind, CacheKind::kFp8E4M3>{}, F32{});
      break;
    case CacheKind::kFp8E5M2:
      with_level(std::integral_constant<CacheKind, CacheKind::kFp8E5M2>{}, F32{});
      break;
    case CacheKind::kNvfp4:
      with_level(std::integral_constant<CacheKind, CacheKind::kNvfp4>{}, F32{});
      break;
    case CacheKind::kInt8PerTokenHead:
      with_level(std::integral_constant<CacheKind, CacheKind::kInt8PerTokenHead>{}, F32{});
      break;
    case CacheKind::kFp8PerTokenHead:
      with_level(std::integral_constant<CacheKind, CacheKind::kFp8PerTokenHead>{}, F32{});
      break;
    case CacheKind::kInt4PerTokenHead:
      with_level(std::integral_constant<CacheKind, CacheKind::kInt4PerTokenHead>{}, F32{});
      break;
    case CacheKind::kUnquantized: {
      using U = std::integral_constant<CacheKind, CacheKind::kUnquantized>;
      switch (p.cache_type) {
        case SourceType::kFloat32:
          with_level(U{}, F32{});
          break;
        case SourceType::kFloat16:
          with_level(U{}, std::integral_constant<SourceType, SourceType::kFloat16>{});
          break;
        case SourceType::kBFloat16:
          with_level(U{}, std::integral_constant<SourceType, SourceType::kBFloat16>{});
          break;
      }
      break;
    }
  }
  parallel_for(0, int64_t(plan.merges.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) merge_partials(p, plan.merges[i], scratch);
  });
}

}  // namespace vllm_kv::cpu::attention
