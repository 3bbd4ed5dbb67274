"""A worker's KV cache as the offloading code sees it: distinct page tensors, and per KV-cache
group the tensors its layers live in (re-exported by :mod:`vllm.v1.kv_offload.base`, upstream's
home of these records; here so page views need not import the interfaces)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CanonicalKVCacheTensor:
    """One KV-cache buffer as ``(num_blocks, ...)`` pages of ``page_size_bytes`` (padding
    included) each."""

    tensor: torch.Tensor
    page_size_bytes: int


@dataclass
class CanonicalKVCacheRef:
    """A group's use of ``tensors[tensor_idx]``; ``page_size_bytes`` is the layers' own
    (unpadded) page size."""

    tensor_idx: int
    page_size_bytes: int


@dataclass
class CanonicalKVCaches:
    """A worker's KV cache as distinct page tensors, and per KV-cache group the tensors its
    layers live in."""

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]]
