// CUDA implementations of the _C_cache_ops ops and of _C::octave_cache_store (compiled only when
// torch has CUDA). The schemas are registered in csrc/torch_bindings.cpp; validation is shared with
// the CPU ops (csrc/cache_ops_torch.h); the kernels are torch-free (reshape_and_cache_flash.h).
// Only c10's CUDA stream/guard headers, not ATen/cuda/CUDAContext.h (which drags in cuBLAS and
// cuSPARSE): tools/check_glue_headers.py keeps it that way.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "cache_ops_torch.h"
#include "cuda/concat_and_cache_mla.h"
#include "cuda/convert_fp8.h"
#include "cuda/packed_slot_store.h"
#include "cuda/reshape_and_cache_flash.h"
#include "ds_mla_ops_torch.h"
#include "packed_slot_ops_torch.h"

namespace vllm_kv {
namespace {

void reshape_and_cache_flash_cuda(const at::Tensor& key, const at::Tensor& value,
                                  at::Tensor& key_cache, at::Tensor& value_cache,
                                  const at::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                                  const at::Tensor& k_scale, const at::Tensor& v_scale,
                                  const std::optional<std::string>& k_scale_layout,
                                  const std::optional<std::string>& v_scale_layout,
                                  const std::optional<at::Tensor>& key_sinks,
                                  const std::optional<at::Tensor>& key_sink_scale) {
  TORCH_CHECK(key.is_cuda(), "reshape_and_cache_flash: key: expected a CUDA tensor, got device ",
              key.device());
  const ReshapeAndCacheParams params = prepare_reshape_and_cache_flash(
      key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
      k_scale_layout, v_scale_layout, key_sinks, key_sink_scale);
  if (params.num_tokens == 0) return;
  const c10::cuda::CUDAGuard device_guard(key.device());
  launch_reshape_and_cache_flash(params, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void concat_and_cache_nvfp4_ds_mla_cuda(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                        at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.is_cuda(), "kv_cache: expected a CUDA tensor, got device ",
              kv_cache.device());
  const DsMlaWriteArgs args = prepare_ds_mla_write(kv_c, k_pe, kv_cache, slot_mapping);
  if (args.num_tokens == 0) return;
  const c10::cuda::CUDAGuard device_guard(kv_cache.device());
  launch_concat_and_cache_nvfp4_ds_mla(args, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void turboquant_store_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                           const at::Tensor& slot_mapping,
                           const std::optional<at::Tensor>& key_norms,
                           const std::optional<at::Tensor>& midpoints, int64_t key_bits,
                           int64_t value_bits) {
  TORCH_CHECK(kv_cache.is_cuda(), "kv_cache: expected a CUDA tensor, got device ",
              kv_cache.device());
  const TurboQuantWriteArgs args = prepare_turboquant_store(
      key, value, kv_cache, slot_mapping, key_norms, midpoints, key_bits, value_bits);
  if (args.num_tokens == 0 || args.num_heads == 0) return;
  const c10::cuda::CUDAGuard device_guard(kv_cache.device());
  launch_turboquant_store(args, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void ultraquant_store_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                           const at::Tensor& slot_mapping, double constant_c) {
  TORCH_CHECK(kv_cache.is_cuda(), "kv_cache: expected a CUDA tensor, got device ",
              kv_cache.device());
  const UltraQuantWriteArgs args =
      prepare_ultraquant_store(key, value, kv_cache, slot_mapping, constant_c);
  if (args.num_tokens == 0 || args.num_heads == 0) return;
  const c10::cuda::CUDAGuard device_guard(kv_cache.device());
  launch_ultraquant_store(args, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void octave_cache_store_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& cache,
                             const at::Tensor& slot_mapping, const at::Tensor& k_signs,
                             const at::Tensor& v_signs, int64_t fmt) {
  TORCH_CHECK(cache.is_cuda(), "cache: expected a CUDA tensor, got device ", cache.device());
  const OctaveWriteArgs args =
      prepare_octave_store(key, value, cache, slot_mapping, k_signs, v_signs, fmt);
  if (args.num_tokens == 0 || args.num_heads == 0) return;
  const c10::cuda::CUDAGuard device_guard(cache.device());
  launch_octave_store(args, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Copies whole pages: for each row (s, d) of block_mapping, block_size_in_bytes bytes from
// src.data_ptr() + s * block_size_in_bytes to dst.data_ptr() + d * block_size_in_bytes, one
// cudaMemcpyAsync each on the current stream of the CUDA side (as upstream vLLM's swap_blocks).
void swap_blocks_cuda(const at::Tensor& src, at::Tensor& dst, int64_t block_size_in_bytes,
                      const at::Tensor& block_mapping) {
  check_swap_blocks_args(src, dst, block_size_in_bytes, block_mapping);
  const at::Device src_device = src.device();
  const at::Device dst_device = dst.device();
  cudaMemcpyKind memcpy_kind = cudaMemcpyDefault;
  if (src_device.is_cuda() && dst_device.is_cuda()) {
    TORCH_CHECK(src_device == dst_device,
                "swap_blocks: src and dst: expected the same CUDA device for a device-to-device "
                "copy, got src on ",
                src_device, " and dst on ", dst_device);
    memcpy_kind = cudaMemcpyDeviceToDevice;
  } else if (src_device.is_cuda() && dst_device.is_cpu()) {
    memcpy_kind = cudaMemcpyDeviceToHost;
  } else if (src_device.is_cpu() && dst_device.is_cuda()) {
    memcpy_kind = cudaMemcpyHostToDevice;
  } else {
    TORCH_CHECK(false,
                "swap_blocks (CUDA): src and dst: expected CUDA->CUDA, CUDA->CPU or CPU->CUDA, "
                "got src on ",
                src_device, " and dst on ", dst_device);
  }
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0) return;

  const c10::cuda::CUDAGuard device_guard(src_device.is_cuda() ? src_device : dst_device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const char* src_ptr = static_cast<const char*>(src.data_ptr());
  char* dst_ptr = static_cast<char*>(dst.data_ptr());
  const auto mapping = block_mapping.accessor<int64_t, 2>();  // CPU int64 [n, 2], checked above
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t src_offset = mapping[i][0] * block_size_in_bytes;
    const int64_t dst_offset = mapping[i][1] * block_size_in_bytes;
    C10_CUDA_CHECK(cudaMemcpyAsync(dst_ptr + dst_offset, src_ptr + src_offset,
                                   static_cast<size_t>(block_size_in_bytes), memcpy_kind, stream));
  }
}

// swap_blocks_batch in a CUDA build: with a device, one cudaMemcpyAsync per descriptor on the
// current stream, cudaMemcpyDefault letting unified addressing tell host from device memory
// (stream order always holds, so is_src_access_order_any needs no special case); on a machine
// without a device every address is host memory.
void swap_blocks_batch_cuda(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                            const at::Tensor& sizes, bool /*is_src_access_order_any*/) {
  check_swap_blocks_batch_args(src_ptrs, dst_ptrs, sizes);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();  // clear the sticky "no device" error for later calls
    swap_blocks_batch_on_host(src_ptrs, dst_ptrs, sizes);
    return;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* src = src_ptrs.data_ptr<int64_t>();
  const int64_t* dst = dst_ptrs.data_ptr<int64_t>();
  const int64_t* size = sizes.data_ptr<int64_t>();
  for (int64_t i = 0; i < src_ptrs.size(0); ++i) {
    if (size[i] == 0) continue;
    C10_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(dst[i]),
                                   reinterpret_cast<const void*>(src[i]),
                                   static_cast<size_t>(size[i]), cudaMemcpyDefault, stream));
  }
}

void convert_fp8_cuda(at::Tensor& dst_cache, const at::Tensor& src_cache, double scale,
                      const std::string& kv_cache_dtype) {
  TORCH_CHECK(dst_cache.is_cuda(), "dst_cache: expected device ", src_cache.device(),
              " (src_cache's device), got ", dst_cache.device());
  const c10::cuda::CUDAGuard device_guard(dst_cache.device());
  run_convert_fp8(dst_cache, src_cache, scale, kv_cache_dtype, [](const ConvertFp8Params& p) {
    launch_convert_fp8(p, c10::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace vllm_kv

TORCH_LIBRARY_IMPL(_C_cache_ops, CUDA, m) {
  m.impl("reshape_and_cache_flash", &vllm_kv::reshape_and_cache_flash_cuda);
  m.impl("swap_blocks", &vllm_kv::swap_blocks_cuda);
  m.impl("convert_fp8", &vllm_kv::convert_fp8_cuda);
  m.impl("concat_and_cache_nvfp4_ds_mla", &vllm_kv::concat_and_cache_nvfp4_ds_mla_cuda);
  m.impl("turboquant_store", &vllm_kv::turboquant_store_cuda);
  m.impl("ultraquant_store", &vllm_kv::ultraquant_store_cuda);
}

TORCH_LIBRARY_IMPL(_C, CUDA, m) { m.impl("octave_cache_store", &vllm_kv::octave_cache_store_cuda); }

// The descriptors are CPU tensors whatever memory they address, so the op dispatches on CPU.
TORCH_LIBRARY_IMPL(_C_cache_ops, CPU, m) {
  m.impl("swap_blocks_batch", &vllm_kv::swap_blocks_batch_cuda);
}
