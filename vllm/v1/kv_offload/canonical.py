"""A worker's KV cache as the offloading code sees it: distinct page tensors, and per KV-cache
group the tensors its layers live in, with how a worker's page maps into a parallelism-free
(canonical) page (re-exported by :mod:`vllm.v1.kv_offload.base`, upstream's home of these
records; here so page views need not import the interfaces)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CanonicalKVCacheTensor:
    """One KV-cache buffer as ``(num_blocks, ...)`` pages of ``page_size_bytes`` (padding
    included) each."""

    tensor: torch.Tensor
    page_size_bytes: int


@dataclass(frozen=True)
class CopyRun:
    """``num_fragments`` fragments of ``fragment_size`` bytes: fragment ``i`` is at byte
    ``local_offset + i * local_stride`` of this worker's page and at byte
    ``canonical_offset + i * canonical_stride`` of the canonical page."""

    local_offset: int
    canonical_offset: int
    fragment_size: int
    num_fragments: int
    local_stride: int
    canonical_stride: int


@dataclass(frozen=True)
class CanonicalPageMapping:
    """Where this worker's page (``local_page_size_bytes``, unpadded) lies in the canonical
    page (``canonical_page_size_bytes``) that every parallel layout shares: ``runs`` cover the
    whole local page. ``num_writers`` workers hold the same bytes (replicated KV); the one at
    ``writer_index`` stores a page when :meth:`is_writer` says so, so they share the writes.
    ``parallelism_agnostic``: the canonical bytes are the same under any parallel layout with
    this block size. Lives in one process (never serialized)."""

    canonical_page_size_bytes: int
    local_page_size_bytes: int
    runs: tuple[CopyRun, ...]
    num_writers: int
    writer_index: int
    parallelism_agnostic: bool

    def is_writer(self, block_id: int) -> bool:
        """Whether this worker stores canonical page ``block_id`` (a host-side page id, the same
        on every worker): the replicas take turns by page id."""
        return block_id % self.num_writers == self.writer_index


@dataclass
class CanonicalKVCacheRef:
    """A group's use of ``tensors[tensor_idx]``; ``page_size_bytes`` is the layers' own
    (unpadded) page size; ``mapping`` places that page in the canonical page (``None``: no
    canonical placement known, so the canonical host layout cannot be used)."""

    tensor_idx: int
    page_size_bytes: int
    mapping: CanonicalPageMapping | None = None


@dataclass
class CanonicalKVCaches:
    """A worker's KV cache as distinct page tensors, and per KV-cache group the tensors its
    layers live in."""

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]]
