"""Read a :class:`~vllm.accuracy.paged_cache.PagedCache` through the reference attention backend.

Attention output comes from ``ReferenceAttentionImpl.forward`` (paged attention computed
straight from the cache bytes: it gathers the pages of each sequence through its block table
and dequantizes them with :mod:`vllm.kv_quant`), with ``causal=False`` so that every query sees
all of its sequence's keys. The dequantized K/V for the reconstruction metrics come from the
same reference codecs, gathered slot by slot (:class:`~vllm.accuracy.codec_reader.CodecReader`).
The packed-slot formats' attention is read by the backend too (their slots decoded by their
codecs, :mod:`vllm.kv_quant.slot_codecs`).
"""

from __future__ import annotations

import torch

from vllm.accuracy.codec_reader import CodecReader
from vllm.accuracy.paged_cache import PagedCache


def backend_status() -> tuple[bool, str]:
    """Whether the reference attention backend can be imported, and why not."""
    try:
        from vllm.v1.attention.backends.reference import ReferenceAttentionImpl  # noqa: F401
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"
    return True, "vllm.v1.attention.backends.reference"


class BackendReader:
    """A :class:`~vllm.accuracy.paged_cache.CacheReader` backed by ``ReferenceAttentionImpl``."""

    name = "backend"

    def __init__(self) -> None:
        self._codec = CodecReader()

    def read_kv(self, cache: PagedCache) -> tuple[torch.Tensor, torch.Tensor]:
        return self._codec.read_kv(cache)

    def attend(
        self, cache: PagedCache, query: torch.Tensor, query_lens: tuple[int, ...]
    ) -> torch.Tensor:
        from vllm.v1.attention.backends.abstract import AttentionLayerScales
        from vllm.v1.attention.backends.reference import (
            ReferenceAttentionImpl,
            ReferenceAttentionMetadata,
        )

        num_kv_heads = cache.kv_cache.shape[1 if cache.fmt.is_packed else 3]
        impl = ReferenceAttentionImpl(
            num_heads=query.shape[1],
            head_size=cache.head_size,
            num_kv_heads=num_kv_heads,
            kv_cache_dtype=cache.fmt.kv_cache_dtype,
            head_size_v=cache.head_size_v,
            k_scale_layout=cache.k_scale_layout,
            v_scale_layout=cache.v_scale_layout,
        )
        width = max(t.numel() for t in cache.block_tables)
        table = torch.zeros(len(cache.block_tables), width, dtype=torch.int64)
        for i, pages in enumerate(cache.block_tables):
            table[i, : pages.numel()] = pages.cpu()
        meta = ReferenceAttentionMetadata.build(
            cache.seq_lens,
            query_lens,
            table.to(cache.kv_cache.device),
            cache.block_size,
            causal=False,
        )
        layer = AttentionLayerScales(cache.k_scale, cache.v_scale)
        out = impl.forward(layer, query.to(torch.float32), None, None, cache.kv_cache, meta)
        return out.to(torch.float32)
