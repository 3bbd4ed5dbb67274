"""FlashInfer backend: cache shapes, stride orders and dtype × device validation.

This module does not import ``flashinfer`` and has no forward pass here: it tells the worker
how to view a raw buffer as the cache FlashInfer reads, and refuses, before any allocation,
configurations FlashInfer cannot serve.

Rules (``validate_configuration``):

- device: an NVIDIA GPU of compute capability 7.5 to 12.1 (upstream FlashInfer's range); on CPU
  FlashInfer cannot run at all: use ``ReferenceAttentionBackend`` (``"REFERENCE"``).
- model dtype float16 / bfloat16; unquantized caches must hold the model dtype.
- head sizes 64, 128, 256; kernel block sizes 16, 32, 64 (a page of a multiple of one of them is
  split into kernel pages); V head size equal to K's.
- FP8 KV (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``): sm_89 or newer (FP8 attention kernels).
- NVFP4 KV: read by FlashInfer's trtllm-gen kernels only, which are built for the sm_100 family
  (sm_100 / sm_103) and read HND pages with interleave4 block scales.
- on the sm_100 family FlashInfer uses trtllm-gen and needs the HND layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vllm.kv_quant.formats import (
    AUTO,
    BFLOAT16,
    FLOAT16,
    FP8_E4M3,
    FP8_E5M2,
    NVFP4,
    NVFP4_4OVER6,
    accepted_names_of,
    find_format,
)
from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    DeviceCapability,
    MultipleOf,
    as_device_capability,
    paged_kv_cache_shape,
)

if TYPE_CHECKING:
    from vllm.kv_quant.scale_layout import ScaleLayout

FP8_MIN_CAPABILITY = DeviceCapability(8, 9)
"""FP8 KV-cache attention needs Ada (sm_89), Hopper or Blackwell."""

TRTLLM_GEN_FAMILY_MAJOR = 10
"""trtllm-gen kernels (the only FlashInfer reader of NVFP4 KV caches) are built for sm_10x."""

MIN_CAPABILITY = DeviceCapability(7, 5)
MAX_CAPABILITY = DeviceCapability(12, 1)


class FlashInferBackend(AttentionBackend):
    """Paged K/V cache ``(num_blocks, 2, block_size, num_kv_heads, D')`` read by FlashInfer."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = accepted_names_of(
        AUTO, FLOAT16, BFLOAT16, FP8_E4M3, FP8_E5M2, NVFP4, NVFP4_4OVER6
    )
    supported_head_sizes: ClassVar[list[int]] = [64, 128, 256]
    supported_kernel_block_sizes: ClassVar[list[int | MultipleOf]] = [16, 32, 64]

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(num_blocks, 2, block_size, num_kv_heads, F(head_size) if nvfp4 else head_size)``
        in elements of the storage dtype (bytes for FP8 / NVFP4)."""
        return paged_kv_cache_shape(
            "FlashInferBackend", num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str
        )

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability | None) -> bool:
        return capability is not None and MIN_CAPABILITY <= capability <= MAX_CAPABILITY

    @classmethod
    def get_required_kv_cache_layout(
        cls, device_capability: DeviceCapability | tuple[int, int] | None = None
    ) -> str | None:
        capability = as_device_capability(device_capability)
        if capability is not None and capability.major == TRTLLM_GEN_FAMILY_MAJOR:
            return "HND"
        return None

    @classmethod
    def get_nvfp4_scale_layout(cls, block_size: int, head_size: int) -> ScaleLayout:
        """trtllm-gen reads NVFP4 block scales in the 4-token interleave (K and V) whatever the
        geometry (its validation admits only geometries that fit it)."""
        from vllm.kv_quant.scale_layout import ScaleLayout

        return ScaleLayout.INTERLEAVE4

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str,
        block_size: int,
        device_capability: DeviceCapability | tuple[int, int] | None,
        *,
        head_size_v: int | None = None,
        use_mla: bool = False,
        kv_cache_layout: str | None = None,
        **features: Any,
    ) -> list[str]:
        capability = as_device_capability(device_capability)
        if capability is None:
            return [
                "FlashInfer needs an NVIDIA GPU (CUDA, compute capability "
                f"{MIN_CAPABILITY.as_version_str()} to {MAX_CAPABILITY.as_version_str()}) and "
                "cannot serve a CPU device; use the reference backend "
                "(ReferenceAttentionBackend, registry name 'REFERENCE'), which reads every "
                "cache format on CPU"
            ]
        reasons = super().validate_configuration(
            head_size,
            dtype,
            kv_cache_dtype,
            block_size,
            capability,
            head_size_v=head_size_v,
            use_mla=use_mla,
            kv_cache_layout=kv_cache_layout,
            **features,
        )
        if not cls.supports_compute_capability(capability):
            # Replace the generic message with one that names the supported range.
            reasons = [r for r in reasons if not r.startswith(f"{cls.get_name()} does not run")]
            reasons.append(
                f"FlashInfer supports compute capability {MIN_CAPABILITY.as_version_str()} to "
                f"{MAX_CAPABILITY.as_version_str()}, got {capability.as_version_str()} "
                f"({capability})"
            )
        fmt = find_format(kv_cache_dtype)
        if fmt is not None and fmt.is_fp8 and capability < FP8_MIN_CAPABILITY:
            reasons.append(
                f"FP8 KV cache ({kv_cache_dtype}) needs FlashInfer's FP8 attention kernels, "
                f"which need compute capability {FP8_MIN_CAPABILITY.as_version_str()} "
                f"({FP8_MIN_CAPABILITY}) or newer, got {capability}"
            )
        if cls.is_kvcache_nvfp4(kv_cache_dtype) and capability.major != TRTLLM_GEN_FAMILY_MAJOR:
            reasons.append(
                f"NVFP4 KV cache is read only by FlashInfer's trtllm-gen attention kernels, "
                f"built for the sm_100 family (compute capability 10.x), got {capability}; "
                "use fp8 on this GPU, or the reference backend ('REFERENCE') to read NVFP4"
            )
        if (
            fmt is not None
            and not fmt.is_quantized
            and not fmt.is_auto
            and fmt.storage_dtype != dtype
        ):
            reasons.append(
                f"an unquantized KV cache must hold the model dtype for FlashInfer: "
                f"kv_cache_dtype {kv_cache_dtype!r} with model dtype {dtype}"
            )
        return reasons
