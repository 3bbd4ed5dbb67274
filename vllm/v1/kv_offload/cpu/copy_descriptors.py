"""Copy descriptors of one CPU <-> GPU transfer: ``(source address, destination address,
size)`` triples (int64, bytes) that a batch copy function executes.

A side's tensor is ``[num_rows, row_bytes]`` bytes whose rows hold ``blocks_per_chunk`` pages
(``row_bytes // blocks_per_chunk`` bytes each; rows may be strided apart, as the shared
offload region's per-worker cells are). :class:`DescriptorFiller` writes a transfer's
descriptors group by group: one per (page, data reference) for the worker-private layout, one
per (page, canonical fragment) for the canonical host layout, where a store of replicated
pages keeps only the pages this worker writes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm.v1.kv_offload.base import CanonicalKVCacheRef
from vllm.v1.kv_offload.cpu.canonical_copy import (
    CopyPlan,
    build_copy_plan,
    canonical_page_ids,
)


def compute_sub_block_ptrs(
    block_ids: np.ndarray,
    blocks_per_chunk: int,
    output: np.ndarray,
    tensor: torch.Tensor,
    skip_count: int = 0,
) -> None:
    """Write into ``output`` the address of each page of ``block_ids`` in ``tensor``.

    Row ``b`` holds pages ``b * f .. b * f + f - 1`` (``f = blocks_per_chunk``), page ``j``
    of it at ``data_ptr + b * row_stride + j * (row_bytes // f)``. The first ``skip_count``
    pages of the first block are left out and the list is cut at ``len(output)`` pages.
    """
    if not 0 <= skip_count < blocks_per_chunk:
        raise ValueError(
            f"skip_count: expected 0 <= skip_count < {blocks_per_chunk}, got {skip_count}"
        )
    base = np.uint64(tensor.data_ptr())
    rows = block_ids.astype(np.uint64) * np.uint64(tensor.stride(0)) + base
    if blocks_per_chunk == 1:
        output[:] = rows[: len(output)]
        return
    page = tensor.shape[1] // blocks_per_chunk
    within = np.arange(blocks_per_chunk, dtype=np.uint64) * np.uint64(page)
    pages = (rows[:, None] + within[None, :]).ravel()
    output[:] = pages[skip_count : skip_count + len(output)]


def new_descriptor_buffers(
    num_copy_ops: int, pin_memory: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source-address, destination-address and size buffers (int64) for ``num_copy_ops``
    descriptors, page-locked when ``pin_memory`` (a device reads them asynchronously)."""
    return tuple(  # type: ignore[return-value]
        torch.empty(num_copy_ops, dtype=torch.int64, pin_memory=pin_memory) for _ in range(3)
    )


class DescriptorFiller:
    """Writes the descriptors of a transfer's KV-cache groups for one direction.

    ``src_tensors[i]`` / ``dst_tensors[i]``: tensor ``i`` on each side, rows of
    ``src_blocks_per_chunk`` / ``dst_blocks_per_chunk`` pages. ``layer_refs_per_group``: per
    group, the data references (tensor index, leading bytes of each page) it moves.
    ``canonical_layout``: the host pages are canonical pages and each reference's mapping
    gives its fragments (the host is the destination when ``gpu_to_cpu``).
    """

    def __init__(
        self,
        src_tensors: list[torch.Tensor],
        dst_tensors: list[torch.Tensor],
        src_blocks_per_chunk: int,
        dst_blocks_per_chunk: int,
        layer_refs_per_group: Sequence[Sequence[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
        canonical_layout: bool,
    ):
        self.src_tensors = src_tensors
        self.dst_tensors = dst_tensors
        self.src_blocks_per_chunk = src_blocks_per_chunk
        self.dst_blocks_per_chunk = dst_blocks_per_chunk
        self.layer_refs_per_group = layer_refs_per_group
        self.gpu_to_cpu = gpu_to_cpu
        # Per (group, ref): the fragments of its canonical page, fixed for the handler's life.
        self.copy_plans: list[list[CopyPlan]] | None = (
            [[build_copy_plan(ref, gpu_to_cpu) for ref in refs] for refs in layer_refs_per_group]
            if canonical_layout
            else None
        )

    def max_copy_ops(self, group_sizes: Sequence[int]) -> int:
        """Descriptors a transfer of ``group_sizes`` pages per group needs at most (exact for
        the private layout; a store of replicated canonical pages may need fewer)."""
        total = 0
        for g, (size, refs) in enumerate(zip(group_sizes, self.layer_refs_per_group, strict=True)):
            if self.copy_plans is None:
                total += size * len(refs)
            else:
                total += size * sum(plan.num_frags for plan in self.copy_plans[g])
        return total

    def fill_group(
        self,
        g_idx: int,
        group_src: np.ndarray,
        group_dst: np.ndarray,
        group_size: int,
        src_skip_count: int,
        dst_skip_count: int,
        all_src: np.ndarray,
        all_dst: np.ndarray,
        all_sizes: np.ndarray,
        op_idx: int,
    ) -> tuple[int, int]:
        """Write group ``g_idx``'s descriptors from ``op_idx`` on: ``group_size`` pages of the
        blocks ``group_src`` / ``group_dst``, skipping the first ``*_skip_count`` pages of the
        first block of each side. Returns the next free index and the bytes described."""
        num_bytes = 0
        src_bases = np.empty(group_size, dtype=np.uint64)
        dst_bases = np.empty(group_size, dtype=np.uint64)
        for r, ref in enumerate(self.layer_refs_per_group[g_idx]):
            t = ref.tensor_idx
            compute_sub_block_ptrs(
                group_src, self.src_blocks_per_chunk, src_bases, self.src_tensors[t], src_skip_count
            )
            compute_sub_block_ptrs(
                group_dst, self.dst_blocks_per_chunk, dst_bases, self.dst_tensors[t], dst_skip_count
            )
            if self.copy_plans is None:
                end = op_idx + group_size
                all_src[op_idx:end] = src_bases.view(np.int64)
                all_dst[op_idx:end] = dst_bases.view(np.int64)
                all_sizes[op_idx:end] = ref.page_size_bytes
                num_bytes += group_size * ref.page_size_bytes
                op_idx = end
                continue
            plan = self.copy_plans[g_idx][r]
            if plan.num_frags == 0:
                continue
            srcs, dsts = src_bases, dst_bases
            mapping = ref.mapping
            if self.gpu_to_cpu and mapping is not None and mapping.num_writers > 1:
                # Replicated workers take turns: the host page id (the same on every worker)
                # picks the one that writes it.
                ids = canonical_page_ids(
                    group_dst, self.dst_blocks_per_chunk, group_size, dst_skip_count
                )
                keep = ids % mapping.num_writers == mapping.writer_index
                srcs, dsts = srcs[keep], dsts[keep]
            n = len(srcs)
            end = op_idx + n * plan.num_frags
            shape = (n, plan.num_frags)
            all_src[op_idx:end] = (
                (srcs[:, None] + plan.frag_offsets_src[None, :]).reshape(-1).view(np.int64)
            )
            all_dst[op_idx:end] = (
                (dsts[:, None] + plan.frag_offsets_dst[None, :]).reshape(-1).view(np.int64)
            )
            all_sizes[op_idx:end].reshape(shape)[:] = plan.frag_sizes
            num_bytes += n * plan.total_bytes
            op_idx = end
        return op_idx, num_bytes
