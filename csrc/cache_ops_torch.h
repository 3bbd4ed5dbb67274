// Torch glue shared by the CPU and CUDA registrations of the cache ops: host-side validation of
// every device-independent precondition (docs/design.md §6, §10). Each check is a TORCH_CHECK whose
// message names the argument, the expected and the actual value; nothing is written before all
// checks pass. Device-specific value checks (slot range, scale values) are done by the CPU op only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "attention_kernels.h"
#include "cache_kernels.h"
#include "convert_fp8.h"

namespace vllm_kv {

// Python-style dtype names for messages ("uint8", "float8_e4m3fn"; not "Byte").
std::string dtype_str(at::ScalarType t);

// docs/design.md §3: the Fp8KVCacheDataType of a kv_cache_dtype string; unknown strings (nvfp4
// included) fail with "kv_cache_dtype: unknown KV-cache dtype '<s>'; expected one of
// <the accepted names>".
Fp8KVCacheDataType get_fp8_kv_cache_data_type(const std::string& kv_cache_dtype);

// The cache kind of a kv_cache_dtype string: nvfp4 is routed before the fp8 dispatch.
CacheKind get_cache_kind(const std::string& kv_cache_dtype);

// Validates the arguments of reshape_and_cache_flash (dtypes, devices, shapes, strides, head
// sizes, NVFP4 and interleave4 divisibility, scale shapes, the optional key sink rows and their
// scale) and returns the kernel parameter block pointing into the given tensors. Does not read
// device memory. A layout left unnamed is default_scale_layout(block_size, head size of that
// side); an unnamed V follows a named K.
ReshapeAndCacheParams prepare_reshape_and_cache_flash(
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const std::string& kv_cache_dtype, const at::Tensor& k_scale, const at::Tensor& v_scale,
    const std::optional<std::string>& k_scale_layout,
    const std::optional<std::string>& v_scale_layout, const std::optional<at::Tensor>& key_sinks,
    const std::optional<at::Tensor>& key_sink_scale);

// Validates the arguments of paged_attention (dtypes, devices, shapes, strides, GQA, head sizes,
// NVFP4 and interleave4 divisibility, scale and metadata shapes, the optional pre-RoPE key
// tensors rope_cos_sin / key_offset / sink_keys, alibi_slopes, seq_causal) and returns the kernel
// parameter block pointing into the given tensors. Does not read tensor values: the per-sequence
// checks (lengths, page ids, seq_len <= max_positions of rope_cos_sin) are the device op's. With
// `packed` (parse_packed_slot_format), key_cache and value_cache are the one packed cache
// [B, N, H, slot bytes] and kv_cache_dtype only names it in errors.
PagedAttentionParams prepare_paged_attention(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, const std::string& kv_cache_dtype, const at::Tensor& k_scale,
    const at::Tensor& v_scale, double scale, int64_t sliding_window, double logits_soft_cap,
    const std::optional<at::Tensor>& sinks, bool causal,
    const std::optional<std::string>& k_scale_layout,
    const std::optional<std::string>& v_scale_layout, const std::optional<at::Tensor>& rope_cos_sin,
    bool rope_is_neox, const std::optional<at::Tensor>& key_offset,
    const std::optional<at::Tensor>& sink_keys, bool key_hadamard,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& seq_causal,
    bool key_split, const PackedSlotFormat* packed = nullptr);

// The packed K+V slot format that packed_paged_attention's arguments describe for heads of
// head_size (kv_cache_dtype's family, bit widths, rope_dim, codebook: fp32 contiguous, on the
// cache's device), checked; the codebook pointer stays valid while the tensor lives.
PackedSlotFormat parse_packed_slot_format(const std::string& kv_cache_dtype, int64_t head_size,
                                          int64_t key_bits, int64_t value_bits,
                                          bool norm_correction, int64_t rope_dim,
                                          const std::optional<at::Tensor>& codebook);

// Validates the arguments of swap_blocks: block_mapping is an int64 CPU [n, 2] tensor of
// (src page, dst page) ids, block_size_in_bytes > 0, and every id addresses a whole page inside
// the storage of src / dst starting at their data_ptr.
void check_swap_blocks_args(const at::Tensor& src, const at::Tensor& dst,
                            int64_t block_size_in_bytes, const at::Tensor& block_mapping);

// Validates the descriptors of swap_blocks_batch: src_ptrs, dst_ptrs and sizes are int64 CPU
// vectors of one length, sizes are >= 0 and an address is nonzero wherever its size is not.
void check_swap_blocks_batch_args(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                                  const at::Tensor& sizes);

// Copies the descriptors between host addresses (memmove each), in parallel over descriptors.
void swap_blocks_batch_on_host(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                               const at::Tensor& sizes);

// convert_fp8 (docs/design.md §6): validates every argument (kv_cache_dtype, devices, the dtype
// pair that decides the direction, shapes, the scale, overlap), then calls `convert` once with
// contiguous buffers: src_cache is made contiguous if it is not, and a non-contiguous dst_cache
// is written through a contiguous buffer copied back afterwards. Nothing is written before every
// check has passed. On CUDA the caller sets the device guard; copies use the current stream.
void run_convert_fp8(at::Tensor& dst_cache, const at::Tensor& src_cache, double scale,
                     const std::string& kv_cache_dtype,
                     const std::function<void(const ConvertFp8Params&)>& convert);

}  // namespace vllm_kv
