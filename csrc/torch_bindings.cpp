// Schemas of the _C_cache_ops ops and of the _C ops upstream keeps there. The CPU kernels register
// in csrc/cpu/, the CUDA kernels in csrc/cuda/; the fake (meta) implementations for torch.compile
// live in vllm/_custom_ops.py.
#include <torch/library.h>

TORCH_LIBRARY(_C_cache_ops, m) {
  m.def(
      "reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, "
      "Tensor v_scale, str? k_scale_layout=None, str? v_scale_layout=None, "
      "Tensor(c!)? key_sinks=None, Tensor? key_sink_scale=None) -> ()");
  m.def(
      "swap_blocks(Tensor src, Tensor(a!) dst, int block_size_in_bytes, Tensor block_mapping) -> "
      "()");
  // Raw copies: bytes [src_ptrs[i], +sizes[i]) to dst_ptrs[i]; three int64 CPU vectors of
  // addresses and byte counts (host memory, or any memory the CUDA build's devices can reach).
  m.def(
      "swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, "
      "bool is_src_access_order_any=False) -> ()");
  // Upstream's test helper: FP8 bytes <-> float with the reference codec's arithmetic.
  m.def("convert_fp8(Tensor! dst_cache, Tensor src_cache, float scale, str kv_cache_dtype) -> ()");
  // Paged attention over a cache written by reshape_and_cache_flash (every format); simd picks
  // the CPU kernels' instruction set ("auto": the widest compiled). rope_cos_sin, key_offset,
  // sink_keys and key_hadamard rebuild keys stored before RoPE; alibi_slopes, per-sequence
  // seq_causal and key_split (may one item's keys be split across threads) as in
  // csrc/attention_kernels.h.
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, str kv_cache_dtype, "
      "Tensor k_scale, Tensor v_scale, float scale, int sliding_window, float logits_soft_cap, "
      "Tensor? sinks, bool causal, str? k_scale_layout=None, str? v_scale_layout=None, "
      "str simd=\"auto\", Tensor? rope_cos_sin=None, bool rope_is_neox=True, "
      "Tensor? key_offset=None, Tensor? sink_keys=None, bool key_hadamard=False, "
      "Tensor? alibi_slopes=None, Tensor? seq_causal=None, bool key_split=True) -> ()");
  m.def("paged_attention_simd_levels() -> str[]");
  // Paged attention over a packed K+V slot cache (TurboQuant, ultraquant_4bit, Octave: kv_cache
  // [num_blocks, block_size, H, slot bytes] uint8) in the format's frames: the query is given in
  // the key frame and out is written in the value frame (csrc/packed_slot_read.h). The format:
  // kv_cache_dtype's family, key_bits / value_bits / norm_correction (TurboQuant; Octave's value
  // bits), rope_dim (Octave block K) and codebook (TurboQuant Lloyd-Max keys; Octave).
  m.def(
      "packed_paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor query_start_loc, str kv_cache_dtype, int key_bits, int value_bits, "
      "bool norm_correction, int rope_dim, Tensor? codebook, float scale, int sliding_window, "
      "float logits_soft_cap, Tensor? sinks, bool causal, str simd=\"auto\", "
      "Tensor? alibi_slopes=None, Tensor? seq_causal=None, bool key_split=True) -> ()");
  // nvfp4_ds_mla records (352 bytes per token) of kv_c [T, 512] and k_pe [T, 64] bf16: the
  // compiled writer behind concat_and_cache_mla (vllm/_mla_cache_ops.py) for that dtype.
  m.def(
      "concat_and_cache_nvfp4_ds_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, "
      "Tensor slot_mapping) -> ()");
  // TurboQuant slots (docs/formats.md §6.3) of key / value [N, H, D] into kv_cache (num_blocks,
  // block_size, H, slot bytes) uint8: key_bits 8 stores the key as e4m3; 3 or 4 code key = y, the
  // rotated unit keys (fp32), with their key_norms and the Lloyd-Max midpoints.
  m.def(
      "turboquant_store(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor? key_norms, Tensor? midpoints, int key_bits, int value_bits) -> ()");
  // ultraquant_4bit slots (docs/formats.md §6.4) of key = the Hadamard-rotated keys (fp32) and
  // value [N, H, D] into kv_cache (num_blocks, block_size, H, slot bytes) uint8.
  m.def(
      "ultraquant_store(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "float constant_c) -> ()");
}

// Upstream's Octave store (its _C namespace, its schema): key / value [N, H, D] into cache
// (num_blocks, H, block_size, slot bytes) uint8, signs from octave_codec.sign_bits(D), fmt the V
// bits plus 16 for compact K (OctaveFormat.kernel_code); block K's rotary dims follow from the
// slot size.
TORCH_LIBRARY_FRAGMENT(_C, m) {
  m.def(
      "octave_cache_store(Tensor key, Tensor value, Tensor! cache, Tensor slot_mapping, "
      "Tensor k_signs, Tensor v_signs, int fmt) -> ()");
}
