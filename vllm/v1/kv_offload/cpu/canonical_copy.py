"""Copy plans of the canonical (parallelism-free) host layout.

With ``canonical_layout`` a host page is not one worker's page but the canonical page every
parallel layout shares (:class:`~vllm.v1.kv_offload.base.CanonicalPageMapping`): each worker
scatters its fragments into it on a store and gathers them back on a load, so pages stored
under one tensor-parallel size load under another. Workers holding the same bytes (replicated
KV) take turns storing a page, keyed by its host page id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from vllm.v1.kv_offload.canonical import CanonicalKVCacheRef, CanonicalPageMapping


class CopyPlan(NamedTuple):
    """One data reference's fragments, in one direction: fragment ``i`` copies
    ``frag_sizes[i]`` bytes from byte ``frag_offsets_src[i]`` of a source page to byte
    ``frag_offsets_dst[i]`` of the destination page; ``total_bytes`` per page."""

    frag_offsets_src: np.ndarray
    frag_offsets_dst: np.ndarray
    frag_sizes: np.ndarray
    total_bytes: int

    @property
    def num_frags(self) -> int:
        return len(self.frag_sizes)


def _mapping_of(ref: CanonicalKVCacheRef) -> CanonicalPageMapping:
    if ref.mapping is None:
        raise ValueError(
            f"ref: expected a CanonicalKVCacheRef with a mapping for the canonical layout, "
            f"got {ref}"
        )
    return ref.mapping


def build_copy_plan(ref: CanonicalKVCacheRef, gpu_to_cpu: bool) -> CopyPlan:
    """The fragments of ``ref``'s mapping runs, local page -> canonical page when
    ``gpu_to_cpu`` (a store), canonical -> local otherwise (bytes)."""
    local: list[int] = []
    canonical: list[int] = []
    sizes: list[int] = []
    for run in _mapping_of(ref).runs:
        for i in range(run.num_fragments):
            local.append(run.local_offset + i * run.local_stride)
            canonical.append(run.canonical_offset + i * run.canonical_stride)
            sizes.append(run.fragment_size)
    src, dst = (local, canonical) if gpu_to_cpu else (canonical, local)
    return CopyPlan(
        frag_offsets_src=np.asarray(src, dtype=np.uint64),
        frag_offsets_dst=np.asarray(dst, dtype=np.uint64),
        frag_sizes=np.asarray(sizes, dtype=np.int64),
        total_bytes=sum(sizes),
    )


def canonical_page_ids(
    block_ids: np.ndarray, blocks_per_chunk: int, count: int, skip_count: int
) -> np.ndarray:
    """Host page ids of ``count`` pages of the chunks ``block_ids`` (``blocks_per_chunk``
    pages each), leaving out the first ``skip_count`` pages: the same numbering on every
    worker, so it keys :meth:`CanonicalPageMapping.is_writer`."""
    pages = (block_ids[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).reshape(-1)
    return pages[skip_count : skip_count + count]


def canonical_block_sizes(
    layer_refs_per_group: Sequence[Sequence[CanonicalKVCacheRef]], num_tensors: int
) -> list[int]:
    """Canonical page size (bytes per GPU block) of each of ``num_tensors`` tensors: the
    largest canonical page of the references to it; every tensor must be referenced, with a
    mapping."""
    sizes = [0] * num_tensors
    for refs in layer_refs_per_group:
        for ref in refs:
            if not 0 <= ref.tensor_idx < num_tensors:
                raise ValueError(
                    f"layer_refs_per_group: expected tensor indices in [0, {num_tensors}), "
                    f"got {ref.tensor_idx}"
                )
            page = _mapping_of(ref).canonical_page_size_bytes
            sizes[ref.tensor_idx] = max(sizes[ref.tensor_idx], page)
    unused = [i for i, size in enumerate(sizes) if size <= 0]
    if unused:
        raise ValueError(
            f"layer_refs_per_group: expected a canonical page for every tensor, got none for "
            f"tensors {unused}"
        )
    return sizes


class UnitPlan(NamedTuple):
    """A copy plan in units of ``unit`` bytes: per page, unit ``src_units[i]`` of the source
    page goes to unit ``dst_units[i]`` of the destination page."""

    unit: int
    src_units: np.ndarray
    dst_units: np.ndarray


def unit_plan(plan: CopyPlan, *alignments: int) -> UnitPlan:
    """``plan`` in the largest unit dividing its offsets and sizes and ``alignments`` (row
    strides, page sizes: bytes)."""
    unit = math.gcd(
        *alignments,
        *(int(x) for x in plan.frag_offsets_src),
        *(int(x) for x in plan.frag_offsets_dst),
        *(int(x) for x in plan.frag_sizes),
    )
    counts = plan.frag_sizes // unit
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    sides = []
    for offsets in (plan.frag_offsets_src, plan.frag_offsets_dst):
        sides.append(np.repeat(offsets.astype(np.int64) // unit, counts) + within)
    return UnitPlan(unit, sides[0], sides[1])


def whole_page_plan(num_bytes: int) -> CopyPlan:
    """The plan of a worker-private layout: the first ``num_bytes`` of each page, as is."""
    zero = np.zeros(1, dtype=np.uint64)
    return CopyPlan(zero, zero, np.array([num_bytes], dtype=np.int64), num_bytes)
