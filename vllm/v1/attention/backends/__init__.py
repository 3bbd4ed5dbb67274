"""Attention backends: the ``AttentionBackend`` base, FlashInfer (shapes, stride orders,
validation), a pure-torch reference backend that reads every cache format, the compiled CPU
backend (``CPU_ATTN``, the selector's first choice on the CPU), the Triton backend
(``TRITON_ATTN``, the GPU reader of every format where FlashInfer is absent) and a selector."""

from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionLayerScales,
    DeviceCapability,
    KVCacheScaleLayouts,
    MultipleOf,
    get_device_capability,
)
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionImpl,
    CPUAttentionMetadata,
)
from vllm.v1.attention.backends.flashinfer import FlashInferBackend
from vllm.v1.attention.backends.mla.common import MLACommonBackend
from vllm.v1.attention.backends.reference import (
    ReferenceAttentionBackend,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, get_attn_backend
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import (
    KV_CACHE_LAYOUTS,
    compute_compressed_slot_mapping,
    compute_slot_mapping,
    get_kv_cache_layout,
    kv_cache_layout,
    map_to_kernel_blocks,
    set_kv_cache_layout,
    split_kv_cache,
)

__all__ = [
    "KV_CACHE_LAYOUTS",
    "AttentionBackend",
    "AttentionBackendEnum",
    "AttentionImpl",
    "AttentionLayer",
    "AttentionLayerScales",
    "CPUAttentionBackend",
    "CPUAttentionImpl",
    "CPUAttentionMetadata",
    "DeviceCapability",
    "FlashInferBackend",
    "KVCacheScaleLayouts",
    "MLACommonBackend",
    "MultipleOf",
    "ReferenceAttentionBackend",
    "ReferenceAttentionImpl",
    "ReferenceAttentionMetadata",
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "TritonAttentionMetadata",
    "compute_compressed_slot_mapping",
    "compute_slot_mapping",
    "get_attn_backend",
    "get_device_capability",
    "get_kv_cache_layout",
    "kv_cache_layout",
    "map_to_kernel_blocks",
    "set_kv_cache_layout",
    "split_kv_cache",
]
