"""Read a :class:`~vllm.accuracy.paged_cache.PagedCache` back with the reference codecs.

Whole pages are dequantized with :mod:`vllm.kv_quant` and the written slots gathered (a
packed-slot format: the written slots decoded by its codec, :mod:`vllm.kv_quant.slot_codecs`);
attention is plain fp32 math over the gathered K/V (:mod:`vllm.accuracy.attention`).
"""

from __future__ import annotations

import torch

from vllm.accuracy.attention import attention_output
from vllm.accuracy.paged_cache import PagedCache
from vllm.kv_quant.scale_layout import ScaleLayout

__all__ = ["CodecReader", "dequantize_side"]


def dequantize_side(
    cache: PagedCache, side: torch.Tensor, scale: torch.Tensor, layout: ScaleLayout, head_size: int
) -> torch.Tensor:
    """Whole side ``(B, N, H, D')`` dequantized to fp32 ``(B, N, H, D)`` by the format's
    reference codec, trusting ``scale`` and ``layout`` (per-token-head rows: their inline
    scales)."""
    return cache.fmt.encoding.codec.read(side, scale, head_size, layout, torch.float32)


class CodecReader:
    """Dequantizes whole pages with :mod:`vllm.kv_quant` and gathers the written slots;
    attention is plain fp32 math over the gathered K/V."""

    name = "codec"

    def read_kv(self, cache: PagedCache) -> tuple[torch.Tensor, torch.Tensor]:
        n = cache.block_size
        page, row = cache.slot_mapping // n, cache.slot_mapping % n
        if cache.fmt.is_packed:
            slots = cache.kv_cache.transpose(1, 2)[page, row]  # (B, H, N, slot) -> [T, H, slot]
            return cache.fmt.slot_codec(cache.head_size).decode(slots)
        k = dequantize_side(
            cache, cache.key_cache, cache.k_scale, cache.k_scale_layout, cache.head_size
        )
        v = dequantize_side(
            cache, cache.value_cache, cache.v_scale, cache.v_scale_layout, cache.head_size_v
        )
        return k[page, row], v[page, row]

    def attend(
        self, cache: PagedCache, query: torch.Tensor, query_lens: tuple[int, ...]
    ) -> torch.Tensor:
        k, v = self.read_kv(cache)
        return attention_output(query, k, v, cache.seq_lens, query_lens)
