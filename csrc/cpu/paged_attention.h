// CPU paged attention over every cache format (decode, prefill, chunked prefill). Framework-free:
// the torch glue validates the arguments, fills a PagedAttentionParams and passes a parallel-for.
//
// Work item = (sequence, KV head, block of query tokens, split of the key range). Its rows are the
// query tokens of the block times the query heads of the KV head's group (GQA), so that each
// decoded page of K / V serves all of them. Pages (in steps of PagePrefetch::step_keys keys) are
// decoded one at a time into an fp32 tile (L1 / L2 resident; a sequence's K / V is never
// materialised) with SIMD format decoders, and attended with an online softmax in fp32 (on AVX-512
// BF16 builds, decode rows of formats exact in bf16 go through vdpbf16ps, the softmax weights
// rounded to bf16 for the values' sums, as in flash attention). Per-tensor or per-head scales are
// constant within an item: the K scale is folded into the query, the V scale into the output.
// Per-token-head rows (int8 / e4m3 values + their own inline fp32 scale) take the bf16 dot in
// decode (the row scale on the score and on the softmax weight); elsewhere they are decoded times
// that scale into the tiles, and so are packed K+V slots (packed_slot_read.h, in the format's key /
// value frames). Long key ranges of few items are split (split-K); the splits' (max, sum,
// accumulator) partials are merged after. Keys stored before RoPE (rope_cos_sin / key_offset /
// sink_keys / key_hadamard) are rebuilt in fp32 (a rebuilt key is not exact in bf16) and scored in
// fp32: NVFP4 decode rows without the Hadamard rotation on the chunk path's lanes (keys; pages past
// the sink positions), others into the key tile in vector lanes (KeyRebuild); the values still
// decode in registers. The dispatch over kinds and SIMD levels is attention_dispatch.h.
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
#include "cpu/attention_bf16.h"
#include "cpu/attention_decode.h"
#include "cpu/attention_key_transform.h"
#include "cpu/attention_nvfp4_chunk.h"
#include "cpu/attention_plan.h"
#include "cpu/attention_prefetch.h"
#include "cpu/attention_prefill_bf16.h"
#include "cpu/attention_rows.h"
#include "cpu/attention_simd.h"
#include "cpu/attention_softmax.h"
#include "cpu/attention_tile.h"
#include "int4_per_token_head.h"
#include "kv_quant_math.h"
#include "per_token_head.h"

namespace vllm_kv::cpu::attention {

template <CacheKind K, SourceType C, SimdLevel L>
class PagedAttention {
 public:
  static constexpr int kLanes = attention::kLanes<L>;
  using V = VecF<L>;
  using Decoder = EntryDecoder<K, C, L>;
  using Tile = TileMath<L>;

  explicit PagedAttention(const PagedAttentionParams& p)
      : p_(p),
        geo_(p),
        shape_{geo_.group,
               geo_.head_size,
               geo_.head_size_v,
               round_up(geo_.head_size),
               round_up(geo_.head_size_v),
               round_up(p.block_size)},
        key_transform_(p.rope_cos_sin != nullptr || p.key_offset != nullptr ||
                       p.sink_keys != nullptr || p.key_hadamard),
        // Per-token-head rows off the bf16 dot are decoded into the tiles only (scales per row).
        fused_v_(L != SimdLevel::kGeneric && K != CacheKind::kInt4PerTokenHead &&
                 K != kPackedSlotKind && geo_.head_size % kLanes == 0 &&
                 geo_.head_size_v % kLanes == 0 &&
                 (!is_per_token_head(K) || bf16_dot_fits(p, geo_))),
        // Keys rebuilt from pre-RoPE ones are decoded into the key tile only.
        fused_(fused_v_ && !key_transform_),
        bf16_dot_(kBf16Dot && fused_ && p.io_type == SourceType::kBFloat16 &&
                  geo_.head_size % 32 == 0),
        // A bf16 query's output tolerates weights rounded to bf16; fp32 / fp16 ones keep fp32.
        bf16_v_(kBf16Dot && fused_v_ && p.io_type == SourceType::kBFloat16 &&
                geo_.head_size_v % 32 == 0),
        blocked_(bf16_dot_ && bf16_v_ && geo_.head_size <= kMaxBlockedHeadSize &&
                 geo_.head_size_v <= kMaxBlockedHeadSize),
        nvfp4_chunks_(K == CacheKind::kNvfp4 && bf16_dot_ && bf16_v_ &&
                      nvfp4_chunks_fit(geo_.head_size, geo_.head_size_v, p.block_size)),
        rebuilt_chunks_(K == CacheKind::kNvfp4 && kBf16Dot && key_transform_ && bf16_v_ &&
                        nvfp4_chunks_fit(geo_.head_size, geo_.head_size_v, p.block_size) &&
                        nvfp4_rebuild_fits(p)),
        prefetch_(p, geo_.head_size, geo_.head_size_v) {
    if constexpr (K == CacheKind::kNvfp4) {
      k_layout_ = Nvfp4SideLayout(p.key_cache, p.block_size, p.num_kv_heads);
      v_layout_ = Nvfp4SideLayout(p.value_cache, p.block_size, p.num_kv_heads);
      for (int g = 0; g < k_layout_.num_groups; ++g) {
        k_groups_.push_back(k_layout_.scale_group_offset(g, p.key_cache.scale_layout));
      }
      for (int g = 0; g < v_layout_.num_groups; ++g) {
        v_groups_.push_back(v_layout_.scale_group_offset(g, p.value_cache.scale_layout));
      }
#if defined(VLLM_KV_HAVE_AVX512_BF16)
      if (nvfp4_chunks_ || rebuilt_chunks_) {
        chunks_ = Nvfp4ChunkAttention(shape_, p.key_cache, k_layout_, p.value_cache, v_layout_);
      }
#endif
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
    const bool fused_v = fused_v_ && head_rows <= kMaxFusedRows;
    const bool fused = fused_v && fused_;
    const bool bf16_dot = fused && bf16_dot_;
    const bool bf16_v = fused_v && bf16_v_;
    // Many rows per KV head (prefill) on the bf16 dot: pages packed once for all of them.
    const bool blocked = blocked_ && !fused;
    // Per-thread buffers, reused across items.
    thread_local std::vector<float> buffer;
    // (The bf16 query rows of the bf16 dot path take rows * shape_.dim_k / 2 floats; counted
    // whole.)
    const int score_stride = blocked ? span_tokens() : shape_.tokens;
    const int64_t need = int64_t(rows) * (2 * shape_.dim_k + shape_.dim_v + score_stride + 2) +
                         int64_t(p_.block_size) * (shape_.dim_k + shape_.dim_v + p_.rotary_dim);
    if (int64_t(buffer.size()) < need) buffer.assign(need, 0.0f);
    float* q = buffer.data();
    float* acc = q + int64_t(rows) * shape_.dim_k;
    float* scores = acc + int64_t(rows) * shape_.dim_v;
    float* m = scores + int64_t(rows) * score_stride;
    float* l = m + rows;
    float* k_tile = l + rows;
    float* v_tile = k_tile + int64_t(p_.block_size) * shape_.dim_k;
    // The page's RoPE table rows on chunk lanes (rebuilt_chunks_).
    float* rope_lanes = v_tile + int64_t(p_.block_size) * shape_.dim_v;
    auto* q_bf16 = reinterpret_cast<uint16_t*>(rope_lanes + int64_t(p_.block_size) * p_.rotary_dim);
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
          float* row = q + int64_t(r) * shape_.dim_k;
          load_query_row(p_.query, base, p_.io_type, q_scale, geo_.head_size, row);
          if (bf16_dot || blocked) {
            // The query as given (bf16); its scale is applied to the scores.
            std::memcpy(q_bf16 + int64_t(r) * shape_.dim_k,
                        static_cast<const uint16_t*>(p_.query) + base,
                        sizeof(uint16_t) * geo_.head_size);
          }
          std::fill(row + geo_.head_size, row + shape_.dim_k, 0.0f);
          std::fill(acc + int64_t(r) * shape_.dim_v, acc + int64_t(r + 1) * shape_.dim_v, 0.0f);
          m[r] = neg_inf;
          l[r] = 0.0f;
        }
      }
    }
    // Zero tile padding so that padded lanes contribute nothing.
    for (int t = 0; t < p_.block_size; ++t) {
      std::fill(k_tile + int64_t(t) * shape_.dim_k + geo_.head_size,
                k_tile + int64_t(t + 1) * shape_.dim_k, 0.0f);
      std::fill(v_tile + int64_t(t) * shape_.dim_v + geo_.head_size_v,
                v_tile + int64_t(t + 1) * shape_.dim_v, 0.0f);
    }

    // Fused path: addresses of the page's (blocked prefill: span's) rows (data, NVFP4 scales).
    const int refs = blocked ? span_tokens() : p_.block_size;
    thread_local std::vector<const uint8_t*> row_refs;
    if (int64_t(row_refs.size()) < 4 * int64_t(refs)) row_refs.resize(4 * refs);
    const uint8_t** k_rows = row_refs.data();
    const uint8_t** k_scales = k_rows + refs;
    const uint8_t** v_rows = k_scales + refs;
    const uint8_t** v_scales = v_rows + refs;

    const int32_t* pages = p_.block_table + int64_t(item.seq) * p_.block_table_stride;
#if defined(VLLM_KV_HAVE_AVX512_BF16)
    if constexpr (kBf16Dot) {
      if (blocked) {
        attend_spans(item, pages, ranges, first_q_pos, q_bf16, scores, m, l, acc, k_rows, k_scales,
                     v_rows, v_scales);
      }
    }
#endif
    const int step = prefetch_.step_keys(heads);  // keys at a time: a page, or part (decode)
    for (int at = item.key_begin - item.key_begin % step; !blocked && at < item.key_end;
         at += step) {
      const int page_start = at - at % p_.block_size;
      const int lo = std::max(at, item.key_begin);
      const int hi = std::min(at + step, item.key_end);
      const int64_t block = pages[page_start / p_.block_size];
      const auto next = prefetch_.start(pages, at, step, item.key_end, item.kv_begin, item.kv_end);
      // Whether any query token sees a key of this step (causal prefill skips the future).
      bool any = false;
      for (const auto& [b, e] : ranges) any |= std::max(b, lo) < std::min(e, hi);
      if (!any) continue;
      // Decode rows of keys rebuilt on the NVFP4 chunk lanes (pages past the sink positions).
      [[maybe_unused]] const bool rebuilt_chunks =
          rebuilt_chunks_ && bf16_v && page_start >= p_.num_sink_keys;
#if defined(VLLM_KV_HAVE_AVX512_BF16)
      constexpr int kChunkKeys = Nvfp4ChunkAttention::kChunkKeys;
      for (int t0 = 0; rebuilt_chunks && p_.rope_cos_sin && t0 < p_.block_size; t0 += kChunkKeys) {
        const int t_lo = std::max(lo - page_start - t0, 0);
        const int t_hi = std::min(hi - page_start - t0, kChunkKeys);
        if (t_lo >= t_hi) continue;
        Nvfp4ChunkAttention::rope_lanes(p_, page_start + t0, t_lo, t_hi,
                                        rope_lanes + int64_t(t0) * p_.rotary_dim);
      }
#endif
      for (int hh = 0; hh < heads; ++hh) {
        const int kv_head = item.kv_begin + hh;
        const int h0 = hh * head_rows;
        const auto ahead = [&](int part) { prefetch_.slice(next, hh, heads, part); };
        ahead(0);
#if defined(VLLM_KV_HAVE_AVX512_BF16)
        if constexpr (K == CacheKind::kNvfp4 && kBf16Dot) {
          if ((bf16_dot && nvfp4_chunks_) || rebuilt_chunks) {
            // (An NVFP4 slice is small: requested whole.)
            for (int part = 1; part < PagePrefetch<K, C>::kParts; ++part) ahead(part);
            const float k_scale = side_scale(p_.key_cache, kv_head, K);
            const float q_scale = p_.scale * k_scale;
            Nvfp4ChunkAttention::RebuiltKeys rebuilt{
                q + int64_t(h0) * shape_.dim_k,
                k_scale,
                p_.key_offset != nullptr ? p_.key_offset + int64_t(kv_head) * geo_.head_size
                                         : nullptr,
                nullptr,
                p_.rotary_dim,
                p_.rope_is_neox};
            const auto finish = [&](float* s, int b, int e, int head, int q_pos, int start) {
              finish_scores(p_, geo_.group, shape_.tokens, s, b, e, head, q_pos, start);
            };
            for (int t0 = 0; t0 < p_.block_size; t0 += Nvfp4ChunkAttention::kChunkKeys) {
              if (std::max(page_start + t0, lo) >=
                  std::min(page_start + t0 + Nvfp4ChunkAttention::kChunkKeys, hi)) {
                continue;
              }
              if (p_.rope_cos_sin != nullptr)
                rebuilt.rope = rope_lanes + int64_t(t0) * p_.rotary_dim;
              chunks_.attend(block, page_start, t0, kv_head, ranges, first_q_pos, lo, hi,
                             q_bf16 + int64_t(h0) * shape_.dim_k, q_scale,
                             scores + int64_t(h0) * shape_.tokens, m + h0, l + h0,
                             acc + int64_t(h0) * shape_.dim_v, finish,
                             rebuilt_chunks ? &rebuilt : nullptr);
            }
            continue;
          }
        }
#endif
        if (fused) {
          locate_page(p_.key_cache, k_layout_, block, lo - page_start, hi - page_start, kv_head,
                      k_rows, k_scales);
        } else if (key_transform_) {
          rebuild_keys(item.seq, kv_head, block, page_start, lo, hi, k_rows, k_scales, k_tile);
        } else {
          decode_page(p_.key_cache, k_layout_, k_groups_, block, lo - page_start, hi - page_start,
                      kv_head, geo_.head_size, shape_.dim_k, k_tile);
        }
        // Keys [b, e) of the page (page offsets) that query token jt sees.
        const auto span = [&](int jt) {
          return std::pair{std::max(ranges[jt].first, lo) - page_start,
                           std::min(ranges[jt].second, hi) - page_start};
        };
        for (int jt = 0; jt < tokens; ++jt) {
          const auto [b, e] = span(jt);
          const int r0 = h0 + jt * geo_.group;
          if (b >= e) continue;
          score_rows(q + int64_t(r0) * shape_.dim_k, fused ? nullptr : k_tile, k_rows, k_scales, b,
                     e, scores + int64_t(r0) * shape_.tokens,
                     bf16_dot ? q_bf16 + int64_t(r0) * shape_.dim_k : nullptr,
                     p_.scale * query_key_scale(kv_head));
          finish_scores(p_, geo_.group, shape_.tokens, scores + int64_t(r0) * shape_.tokens, b, e,
                        kv_head, first_q_pos + jt, page_start);
        }
        ahead(1);
        for (int jt = 0; jt < tokens; ++jt) {
          const auto [b, e] = span(jt);
          const int64_t r0 = h0 + jt * geo_.group;
          softmax_rows<L>(shape_, scores + r0 * shape_.tokens, b, e, geo_.group, m + r0, l + r0,
                          acc + r0 * shape_.dim_v, bf16_v);
        }
        ahead(2);
        if (fused_v) {
          locate_page(p_.value_cache, v_layout_, block, lo - page_start, hi - page_start, kv_head,
                      v_rows, v_scales);
        } else {
          decode_page(p_.value_cache, v_layout_, v_groups_, block, lo - page_start, hi - page_start,
                      kv_head, geo_.head_size_v, shape_.dim_v, v_tile);
        }
        for (int jt = 0; jt < tokens; ++jt) {
          const auto [b, e] = span(jt);
          if (b >= e) continue;
          const int r0 = h0 + jt * geo_.group;
          accumulate_rows(scores + int64_t(r0) * shape_.tokens, fused_v ? nullptr : v_tile, v_rows,
                          v_scales, b, e, acc + int64_t(r0) * shape_.dim_v, bf16_v);
        }
        ahead(3);
      }
    }

    if (item.partial < 0) {
      finish_rows(p_, geo_, item.seq, item.kv_begin, item.kv_end, item.q_begin, item.q_end, m, l,
                  acc, shape_.dim_v);
      return;
    }
    float* out = scratch + item.partial;
    const int row_floats = geo_.partial_row_floats();
    for (int r = 0; r < rows; ++r) {
      out[int64_t(r) * row_floats] = m[r];
      out[int64_t(r) * row_floats + 1] = l[r];
      std::memcpy(out + int64_t(r) * row_floats + 2, acc + int64_t(r) * shape_.dim_v,
                  sizeof(float) * geo_.head_size_v);
    }
  }

 private:
  static int round_up(int n) { return (n + kLanes - 1) / kLanes * kLanes; }

  static constexpr int64_t kElementBytes = kCacheElementBytes<K, C>;

  // Cache rows whose values are exact in bf16 (bf16, FP8, NVFP4) go through vdpbf16ps (AVX-512
  // BF16 builds): keys dotted with a bf16 query (rounding differs from the fp32 path only in the
  // order of the fp32 sums), values weighted by the softmax weights rounded to bf16.
#if defined(VLLM_KV_HAVE_AVX512_BF16)
  static constexpr bool kBf16Dot = L == SimdLevel::kAvx512 && K != CacheKind::kInt4PerTokenHead &&
                                   K != kPackedSlotKind &&
                                   (K != CacheKind::kUnquantized || C == SourceType::kBFloat16);
#else
  static constexpr bool kBf16Dot = false;
#endif

  // Both sides of a call take the bf16 dot (a bf16 query, head sizes of whole 32-element vectors):
  // what a per-token-head call needs to decode in registers.
  static bool bf16_dot_fits(const PagedAttentionParams& p, const AttentionGeometry& geo) {
    return kBf16Dot && p.io_type == SourceType::kBFloat16 && geo.head_size % 32 == 0 &&
           geo.head_size_v % 32 == 0;
  }

#if defined(VLLM_KV_HAVE_AVX512_BF16)
  static constexpr int kMaxBlockedHeadSize = Bf16PrefillPage<K>::kMaxHeadSize;
#else
  static constexpr int kMaxBlockedHeadSize = 0;
#endif

  // Blocked prefill keys per span: consecutive pages packed together, so that one pack and one
  // online-softmax step per row serve several pages' keys.
  static constexpr int kSpanKeys = 256;

  // Keys of a span (whole pages, one at least) and its score row stride.
  int span_keys() const { return std::max(1, kSpanKeys / p_.block_size) * p_.block_size; }
  int span_tokens() const { return round_up(span_keys()); }

#if defined(VLLM_KV_HAVE_AVX512_BF16)
  // Prefill rows on the bf16 dot (blocked): per KV head of the item, each span of consecutive
  // pages (kSpanKeys keys) packed once into the panels and attended by all the head's rows. Score
  // rows are span_tokens() apart; rows / scales: the span's row addresses.
  void attend_spans(const WorkItem& item, const int32_t* pages,
                    const std::vector<std::pair<int, int>>& ranges, int first_q_pos,
                    const uint16_t* q_bf16, float* scores, float* m, float* l, float* acc,
                    const uint8_t** k_rows, const uint8_t** k_scales, const uint8_t** v_rows,
                    const uint8_t** v_scales) const {
    thread_local Bf16PrefillPage<K> prefill;
    RowShape shape = shape_;
    shape.tokens = span_tokens();
    prefill.reshape(shape);
    const int span = span_keys();
    const int head_rows = int(ranges.size()) * geo_.group;
    for (int hh = 0; hh < item.kv_end - item.kv_begin; ++hh) {
      const int kv_head = item.kv_begin + hh;
      const int h0 = hh * head_rows;
      for (int start = item.key_begin - item.key_begin % p_.block_size; start < item.key_end;
           start += span) {
        const int lo = std::max(start, item.key_begin);
        const int hi = std::min(start + span, item.key_end);
        bool any = false;  // (causal prefill skips the future)
        for (const auto& [b, e] : ranges) any |= std::max(b, lo) < std::min(e, hi);
        if (!any) continue;
        for (int page_start = start; page_start < hi; page_start += p_.block_size) {
          const int64_t block = pages[page_start / p_.block_size];
          prefetch_.head(pages, page_start, item.key_end, kv_head);
          const int t0 = std::max(lo - page_start, 0);
          const int t1 = std::min(hi - page_start, p_.block_size);
          const int at = page_start - start;
          locate_page(p_.key_cache, k_layout_, block, t0, t1, kv_head, k_rows + at, k_scales + at);
          locate_page(p_.value_cache, v_layout_, block, t0, t1, kv_head, v_rows + at,
                      v_scales + at);
        }
        prefill.pack(k_rows, k_scales, k_groups_.data(), v_rows, v_scales, v_groups_.data(),
                     lo - start, hi - start);
        const auto finish = [&](float* s, int b, int e, int q_pos) {
          finish_scores(p_, geo_.group, shape.tokens, s, b, e, kv_head, q_pos, start);
        };
        prefill.attend(ranges, lo - start, hi - start, start, first_q_pos,
                       q_bf16 + int64_t(h0) * shape_.dim_k, p_.scale * query_key_scale(kv_head),
                       scores + int64_t(h0) * shape.tokens, m + h0, l + h0,
                       acc + int64_t(h0) * shape_.dim_v, finish);
      }
    }
  }
#endif

  // The K scale folded into the query rows: 1 when the key tile holds rebuilt keys (they are
  // in real units, as the sink keys and the offset are given).
  float query_key_scale(int kv_head) const {
    return key_transform_ ? 1.0f : side_scale(p_.key_cache, kv_head, K);
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
      } else if constexpr (K == kPackedSlotKind) {
        // Both sides are the one packed cache: the side says which half of the slot to read.
        const uint8_t* slot = base + entry_offset(side, block, t, head);
        if (&side == &p_.key_cache) {
          read_packed_key(p_.packed, slot, dst);
        } else {
          read_packed_value(p_.packed, slot, dst);
        }
      } else {
        Decoder::decode(base + entry_offset(side, block, t, head) * kElementBytes, nullptr, nullptr,
                        dim, dst);
      }
    }
  }

  // Keys [lo, hi) of page `block` (from page_start) of KV head `kv_head` rebuilt into the key
  // tile (KeyRebuild), decoded in registers where the fused decoder gives the codec's values.
  void rebuild_keys(int seq, int kv_head, int64_t block, int page_start, int lo, int hi,
                    const uint8_t** k_rows, const uint8_t** k_scales, float* k_tile) const {
    const int t0 = lo - page_start;
    const int t1 = hi - page_start;
    const bool in_registers = KeyRebuild<L>::in_registers(p_);
    const bool fused = in_registers && fused_v_ && !is_per_token_head(K);
    if (fused) {
      locate_page(p_.key_cache, k_layout_, block, t0, t1, kv_head, k_rows, k_scales);
    } else {
      decode_page(p_.key_cache, k_layout_, k_groups_, block, t0, t1, kv_head, geo_.head_size,
                  shape_.dim_k, k_tile);
    }
    if (!in_registers) {
      KeyRebuild<L>::scalar_rows(p_, seq, kv_head, page_start, t0, t1, k_tile, shape_.dim_k);
      return;
    }
    const float* tile = fused ? nullptr : k_tile;
    const auto key = [&](int t, int d) { return key_vector(tile, k_rows, k_scales, t, d); };
    KeyRebuild<L>::register_rows(p_, seq, kv_head, page_start, t0, t1, key, k_tile, shape_.dim_k);
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
        using Dot = Bf16Dot<K>;
        for (; g + 4 <= geo_.group; g += 4) {
          Dot::template score_chunk<4>(shape_, q_bf16, k_rows, k_scales, k_groups_.data(), b, e,
                                       scores, g, q_scale);
        }
        for (; g < geo_.group; ++g) {
          Dot::template score_chunk<1>(shape_, q_bf16, k_rows, k_scales, k_groups_.data(), b, e,
                                       scores, g, q_scale);
        }
      }
    }
#endif
    const auto keys = [&](int t, int d) { return key_vector(k_tile, k_rows, k_scales, t, d); };
    for (; g + 8 <= geo_.group; g += 8)
      Tile::template score_chunk<8>(shape_, keys, q, b, e, scores, g);
    for (; g + 4 <= geo_.group; g += 4)
      Tile::template score_chunk<4>(shape_, keys, q, b, e, scores, g);
    for (; g < geo_.group; ++g) Tile::template score_chunk<1>(shape_, keys, q, b, e, scores, g);
  }

  // Vector d of key t: from the tile, or decoded from the cache when there is no tile (fused).
  V key_vector(const float* k_tile, const uint8_t* const* k_rows, const uint8_t* const* k_scales,
               int t, int d) const {
    if constexpr (L != SimdLevel::kGeneric) {
      if (k_tile == nullptr) return Decoder::vector(k_rows[t], k_scales[t], k_groups_.data(), d);
    }
    return load<L>(k_tile + int64_t(t) * shape_.dim_k + d);
  }

  V value_vector(const float* v_tile, const uint8_t* const* v_rows, const uint8_t* const* v_scales,
                 int t, int d) const {
    if constexpr (L != SimdLevel::kGeneric) {
      if (v_tile == nullptr) return Decoder::vector(v_rows[t], v_scales[t], v_groups_.data(), d);
    }
    return load<L>(v_tile + int64_t(t) * shape_.dim_v + d);
  }

  // acc_g += sum_t w[g][t] * v_t for the group's rows; bf16: by the bf16 dot (fused V rows).
  void accumulate_rows(const float* weights, const float* v_tile, const uint8_t* const* v_rows,
                       const uint8_t* const* v_scales, int b, int e, float* acc,
                       [[maybe_unused]] bool bf16) const {
    int g = 0;
#if defined(VLLM_KV_HAVE_AVX512_BF16)
    if constexpr (kBf16Dot) {
      if (bf16) {
        using Dot = Bf16Dot<K>;
        for (; g + 4 <= geo_.group; g += 4) {
          Dot::template accumulate_chunk<4>(shape_, weights, v_rows, v_scales, v_groups_.data(), b,
                                            e, acc, g);
        }
        for (; g < geo_.group; ++g) {
          Dot::template accumulate_chunk<1>(shape_, weights, v_rows, v_scales, v_groups_.data(), b,
                                            e, acc, g);
        }
      }
    }
#endif
    const auto values = [&](int t, int d) { return value_vector(v_tile, v_rows, v_scales, t, d); };
    for (; g + 8 <= geo_.group; g += 8) {
      Tile::template accumulate_chunk<8>(shape_, values, weights, b, e, acc, g);
    }
    for (; g + 4 <= geo_.group; g += 4) {
      Tile::template accumulate_chunk<4>(shape_, values, weights, b, e, acc, g);
    }
    for (; g < geo_.group; ++g)
      Tile::template accumulate_chunk<1>(shape_, values, weights, b, e, acc, g);
  }

  const PagedAttentionParams& p_;
  AttentionGeometry geo_;
  RowShape shape_;
  // rope_cos_sin, key_offset, sink_keys or key_hadamard given: keys are rebuilt (KeyRebuild).
  bool key_transform_;
  // Decode in registers inside the dot products is possible (vector levels, head sizes of whole
  // vectors): for the values; for the keys too (fused_) when they are read as stored. Otherwise
  // pages are decoded into the fp32 tiles first.
  bool fused_v_;
  bool fused_;
  // K rows are dotted (bf16_dot_), V rows accumulated (bf16_v_) by the bf16 dot: kBf16Dot, a
  // bf16 query, head size of whole 32-element vectors.
  bool bf16_dot_;
  bool bf16_v_;
  // Prefill rows take the bf16 dot over packed pages (Bf16PrefillPage).
  bool blocked_;
  // NVFP4 pages go through chunks_ (bf16 dot on both sides, Nvfp4ChunkAttention::fits); those of
  // rebuilt keys too (rebuilt_chunks_: their scores in fp32, RebuiltKeys).
  bool nvfp4_chunks_;
  bool rebuilt_chunks_;
#if defined(VLLM_KV_HAVE_AVX512_BF16)
  Nvfp4ChunkAttention chunks_;
#endif
  PagePrefetch<K, C> prefetch_;
  Nvfp4SideLayout k_layout_{};
  Nvfp4SideLayout v_layout_{};
  std::vector<int64_t> k_groups_;
  std::vector<int64_t> v_groups_;
};

}  // namespace vllm_kv::cpu::attention
