"""Sparse-MLA cache addressing: the flat token-row view of a paged latent cache and the block
alignment that keeps it exact (upstream v0.33's ``mla/sparse_utils`` KV-cache helpers; the
index-conversion kernels are not part of this library).

Sparse MLA kernels address a cache as one flat array of token rows: token ``t`` of block ``b``
is row ``b * block_stride_rows + t``. When other layers' pages sit between this layer's blocks
(a block-outermost layout), the block stride is larger than the block, so it must be a whole
number of rows; :func:`align_blocks_to_rows` asks the planner for such a stride.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

import numpy as np
import torch

from vllm.v1.kv_cache_interface import AttentionSpec

__all__ = ["align_blocks_to_rows", "flat_kv_row_view", "request_row_bounds"]

_SpecT = TypeVar("_SpecT", bound=AttentionSpec)


def request_row_bounds(req_idx: np.ndarray) -> np.ndarray:
    """Bounds of the runs of equal adjacent entries of ``req_idx`` (each row's request index):
    run ``r`` is rows ``[bounds[r], bounds[r + 1])``. Under prefill context parallelism a rank
    holds two adjacent chunk rows of one request; they get one KV region. ``ValueError`` when
    ``req_idx`` is empty or a request's rows are not adjacent."""
    rows = np.asarray(req_idx)
    if rows.ndim != 1 or rows.size == 0:
        raise ValueError(f"req_idx: expected a non-empty 1-D array, got shape {rows.shape}")
    bounds = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1], True])
    if bounds.size - 1 != np.unique(rows).size:
        raise ValueError(f"req_idx: expected the rows of each request to be adjacent, got {rows}")
    return bounds


def align_blocks_to_rows(spec: _SpecT, rows: int = 1) -> _SpecT:
    """``spec`` with its block stride aligned to ``rows`` token rows (bytes: ``rows`` times the
    spec's per-slot content), so a flat row view of the cache addresses every block exactly."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows: expected a positive int (token rows), got {rows!r}")
    return replace(spec, block_stride_alignment=rows * spec.state_content_size_bytes)


def flat_kv_row_view(kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """A ``[rows, head_dim]`` view of a ``[num_blocks, block_size, head_dim]`` paged cache and
    its block stride in rows: token ``t`` of block ``b`` is row ``b * stride_rows + t``. Rows
    between one block's last token and the next block (other layers' pages) are part of the
    view but never addressed. ``ValueError`` when the block stride is not a whole number of
    rows (flat indexing would then address the wrong bytes)."""
    if kv_cache.dim() != 3:
        raise ValueError(
            f"kv_cache: expected [num_blocks, block_size, head_dim], got shape "
            f"{tuple(kv_cache.shape)}"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int (tokens), got {block_size!r}")
    num_blocks, _, head_dim = kv_cache.shape
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != head_dim:
        raise ValueError(
            f"kv_cache: expected contiguous token rows of {head_dim} elements, got strides "
            f"{kv_cache.stride()}"
        )
    if kv_cache.stride(0) % head_dim != 0:
        raise ValueError(
            f"kv_cache: expected a block stride of whole {head_dim}-element rows, got "
            f"{kv_cache.stride(0)} elements"
        )
    stride_rows = kv_cache.stride(0) // head_dim
    num_rows = (num_blocks - 1) * stride_rows + block_size if num_blocks else 0
    rows = kv_cache.as_strided((num_rows, head_dim), (head_dim, 1))
    return rows, stride_rows
