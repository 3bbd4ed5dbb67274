// Framework-free interface of the paged-attention kernels: the parameter block that the torch glue
// fills after validation. Included by C++ sources only (the CPU backend); no torch headers.
#pragma once

#include <cstdint>

#include "cache_kernels.h"
#include "packed_slot_read.h"

namespace vllm_kv {

// Vector instruction set of the CPU attention kernels. kGeneric is portable C++ (16-byte GCC
// vectors, scalar format decode); kAvx2 needs AVX2 + FMA + F16C; kAvx512 needs AVX-512F/BW/VL.
// Which levels exist is fixed when the extension is compiled (the -march target); kAuto picks the
// widest of them.
enum class SimdLevel { kAuto = -1, kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

// Paged attention over a cache written by reshape_and_cache_flash (same CacheSide description).
// Sequence i owns query rows query_start_loc[i] .. query_start_loc[i+1]-1: the last q_len_i of its
// seq_lens[i] tokens. block_table[i * block_table_stride + j] is the page of its positions
// j*block_size .. j*block_size + block_size-1.
struct PagedAttentionParams {
  void* out;  // [T, num_heads, head_size_v], io_type
  int64_t out_token_stride;
  int64_t out_head_stride;
  const void* query;  // [T, num_heads, head_size], io_type, last dim contiguous
  int64_t query_token_stride;
  int64_t query_head_stride;
  SourceType io_type;
  CacheKind cache_kind;
  SourceType cache_type;  // element type of an unquantized cache
  CacheSide key_cache;
  CacheSide value_cache;
  const int32_t* block_table;
  int64_t block_table_stride;
  const int32_t* seq_lens;         // [num_seqs]
  const int32_t* query_start_loc;  // [num_seqs + 1]
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int block_size;
  float scale;            // softmax scale applied to q.k
  int sliding_window;     // tokens; 0 = none
  float logits_soft_cap;  // 0 = none
  const float* sinks;     // fp32 [num_heads] logits, or nullptr
  bool causal;
  // Per-sequence override of `causal` (nonzero: causal), or nullptr: every sequence is `causal`.
  const int32_t* seq_causal;
  // ALiBi: score += alibi_slopes[head] * (key position - query position); nullptr = none.
  const float* alibi_slopes;
  // Whether the planner may split one item's key range across threads (then merge partials).
  bool key_split;
  // Keys stored before RoPE (optional, each nullptr when absent). The key at position t of
  // sequence s, KV head h is sink_keys[s][t][h] for t < num_sink_keys, else the cache's; then
  // rotated back by the fixed Hadamard rotation when key_hadamard (c * H x, c = 1/sqrt(D), the
  // butterflies of kv_quant/hadamard.py in the same order); plus key_offset[h]; then rotated by row
  // t of rope_cos_sin (cos of the rotary_dim / 2 pair frequencies, then their sin; neox pairs (i, i
  // + rotary_dim / 2), GPT-J pairs (2i, 2i + 1)).
  const float* rope_cos_sin;  // fp32 [max_positions, rotary_dim]
  int rotary_dim;
  bool rope_is_neox;
  const float* key_offset;  // fp32 [num_kv_heads, head_size]
  const float* sink_keys;   // fp32 [num_seqs, num_sink_keys, num_kv_heads, head_size]
  int num_sink_keys;
  bool key_hadamard;
  // cache_kind kPackedSlotKind: the format. key_cache and value_cache then both describe the one
  // packed cache (slot bytes per entry): keys are read in the format's key frame (the query given
  // in it), Octave values in their rotated frame (out is in it too).
  PackedSlotFormat packed;
};

}  // namespace vllm_kv
