"""The written cache of the check and the reader interface: what a writer hands to a reader.

A :class:`PagedCache` is a FlashInfer-shaped paged cache plus everything needed to interpret
it; a :class:`CacheReader` reads it back. Writers live in :mod:`vllm.accuracy.cache_io`,
readers in :mod:`vllm.accuracy.codec_reader` and :mod:`vllm.accuracy.backend_reader`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm.accuracy.formats import CacheFormat
from vllm.kv_quant.scale_layout import ScaleLayout

__all__ = ["CacheReader", "PagedCache"]


@dataclass
class PagedCache:
    """A written paged cache plus everything a reader needs to interpret it.

    Attributes:
        fmt: the format the cache was written in.
        kv_cache: logical ``(B, 2, N, H, D')`` view (uint8 for quantized formats, else bf16);
            ``(B, H, N, slot_bytes)`` uint8 for a packed-slot format (K and V in one slot; the
            reference backend's shape, stored block, token, head, slot).
        slot_mapping: int64 ``[T]``, slot of each written token, in sample token order.
        block_tables: one int64 tensor of page ids per sequence.
        seq_lens: tokens of each sequence.
        k_scale, v_scale: fp32 ``[1]`` or ``[H]`` dequantization scales the reader uses.
        k_scale_layout, v_scale_layout: NVFP4 block-scale layouts the reader assumes.
        head_size, head_size_v: K and V head sizes in elements.
        writer: which writer produced the bytes (``op`` or ``reference``: the codec).
    """

    fmt: CacheFormat
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: list[torch.Tensor]
    seq_lens: tuple[int, ...]
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_scale_layout: ScaleLayout
    v_scale_layout: ScaleLayout
    head_size: int
    head_size_v: int
    writer: str

    @property
    def key_cache(self) -> torch.Tensor:
        """K side ``(B, N, H, D')``."""
        return self.kv_cache[:, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        """V side ``(B, N, H, D')``."""
        return self.kv_cache[:, 1]

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[2]

    def replace(self, **changes: object) -> PagedCache:
        """A copy with some fields replaced (the tensors are shared, not copied)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


class CacheReader(Protocol):
    """Reads a :class:`PagedCache` back."""

    name: str

    def read_kv(self, cache: PagedCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K ``[T, H, D]`` and V ``[T, H, Dv]`` (fp32) of the written tokens, in
        sample token order."""
        ...

    def attend(
        self, cache: PagedCache, query: torch.Tensor, query_lens: tuple[int, ...]
    ) -> torch.Tensor:
        """Paged attention output ``[sum(query_lens), Hq, Dv]`` (fp32): every query of a
        sequence attends to all of that sequence's cached tokens."""
        ...
