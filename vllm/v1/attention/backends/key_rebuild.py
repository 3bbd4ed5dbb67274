"""What the attention impls need for an encoding's key transform: the key sink rows inside the
pages, and the keys a reader rebuilds (docs/design.md §5.6).

A layer whose encoding stores keys before RoPE, or keeps key sink rows
(:mod:`vllm.kv_quant.key_sinks`), cannot be read by dotting the query with the dequantized page
rows: the key at position ``p`` of a sequence is

1. the sequence's FP8 sink row ``p`` when ``p < S`` (from the sink rows of its first page,
   ``block_table[:, 0]``), else the dequantized page row;
2. when the keys are stored before RoPE: rotated back (Hadamard), plus the offset, turned by
   RoPE at ``p`` (:meth:`~vllm.kv_quant.KeyTransform.rebuild_key`).

:func:`key_sink_rows` views a cache's sink rows where they live, after each page's K and V rows
(docs/formats.md §5); :class:`KeyRebuild` gathers what one call needs; the reference reader
applies it in torch (:meth:`KeyRebuild.keys`), ``CPU_ATTN`` and ``TRITON_ATTN`` hand its
tensors to their kernels, which do the same in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.kv_quant.key_sinks import read_key_sinks
from vllm.kv_quant.key_transform import KeyTransform
from vllm.v1.attention.backends.utils import split_kv_cache

__all__ = ["KeyRebuild", "key_positions", "key_sink_rows"]


def key_sink_rows(
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    sink_tokens: int,
    num_kv_heads: int,
    head_size: int,
) -> torch.Tensor:
    """uint8 ``[num_blocks, S, H, D]`` view of the key sink rows of every page of ``kv_cache``
    (a ``(B, 2, N, H, D')`` cache or its ``(key_cache, value_cache)`` pair; one-byte storage):
    they start right after the page's K and V rows, in ``[S][H][D]`` order, and each page
    steps by the cache's page stride. ``ValueError`` when the pages are too small to hold them
    (a cache allocated without its sink rows)."""
    key_cache, value_cache = split_kv_cache(kv_cache)
    if key_cache.element_size() != 1:
        raise ValueError(
            f"kv_cache: expected one-byte storage for key sink rows, got {key_cache.dtype}"
        )
    num_blocks = key_cache.shape[0]
    kv_bytes = key_cache[0].numel() + value_cache[0].numel() if num_blocks else 0
    sink_bytes = sink_tokens * num_kv_heads * head_size
    page_stride = key_cache.stride(0)
    if num_blocks > 1 and page_stride < kv_bytes + sink_bytes:
        raise ValueError(
            f"kv_cache: expected pages of at least {kv_bytes + sink_bytes} bytes ({kv_bytes} of "
            f"K and V rows, then {sink_bytes} of key sink rows), got a page stride of "
            f"{page_stride} bytes"
        )
    storage = key_cache.view(torch.uint8) if key_cache.dtype != torch.uint8 else key_cache
    end = storage.storage_offset() + (num_blocks - 1) * page_stride + kv_bytes + sink_bytes
    if num_blocks and end > storage.untyped_storage().nbytes():
        raise ValueError(
            f"kv_cache: expected storage for {sink_bytes} bytes of key sink rows after the last "
            f"page's K and V rows, got {storage.untyped_storage().nbytes()} bytes in all"
        )
    return storage.as_strided(
        (num_blocks, sink_tokens, num_kv_heads, head_size),
        (page_stride, num_kv_heads * head_size, head_size, 1),
        storage.storage_offset() + kv_bytes,
    )


def key_positions(
    key: torch.Tensor, positions: torch.Tensor | None, encoding_id: str
) -> torch.Tensor:
    """Each row's position for keys stored before RoPE (encoding ``encoding_id``):
    ``positions [T]`` (``T`` at most the rows of ``key``; rows past ``T`` are padding, never
    written, given position 0), on ``key``'s device."""
    if positions is None:
        raise ValueError(
            f"positions: expected each key's position in its sequence (the encoding "
            f"{encoding_id!r} stores keys before RoPE), got None"
        )
    if positions.dim() != 1 or positions.shape[0] > key.shape[0]:
        raise ValueError(
            f"positions: expected [T] with T <= {key.shape[0]} (the rows of key), got "
            f"{list(positions.shape)}"
        )
    padding = key.shape[0] - positions.shape[0]
    if padding:
        positions = torch.cat([positions, positions.new_zeros(padding)])
    return positions.to(key.device)


@dataclass(frozen=True)
class KeyRebuild:
    """``transform``: the layer's key transform; ``sinks``: fp32 ``[num_seqs, S, H, D]`` sink
    rows of the batch's sequences (stored form, K scale applied), or None."""

    transform: KeyTransform
    sinks: torch.Tensor | None

    @classmethod
    def of(
        cls,
        transform: KeyTransform,
        sink_rows: torch.Tensor | None,
        block_table: torch.Tensor,
        num_seqs: int,
        sink_scale: torch.Tensor | None,
    ) -> KeyRebuild | None:
        """The rebuild for one call (None when keys are read as stored): the sink rows
        ``sink_rows`` (:func:`key_sink_rows`) of each sequence's first page
        (``block_table[:num_seqs, 0]``), dequantized at ``sink_scale``
        (:func:`~vllm.kv_quant.key_sink_scale`)."""
        if not transform.rebuilds_keys and sink_rows is None:
            return None
        sinks = None
        if sink_rows is not None:
            assert sink_scale is not None
            sinks = read_key_sinks(sink_rows, block_table[:num_seqs, 0], sink_scale)
        return cls(transform, sinks)

    def kernel_args(self) -> dict[str, Any]:
        """The compiled reader's arguments for this rebuild (``ops.paged_attention``)."""
        transform, args = self.transform, {}
        if transform.rope is not None:
            args["rope_cos_sin"] = transform.rope.cos_sin
            args["rope_is_neox"] = transform.rope.is_neox_style
            args["key_hadamard"] = transform.rotation is not None
            if transform.offset is not None:
                args["key_offset"] = transform.offset.contiguous()
        if self.sinks is not None:
            args["sink_keys"] = self.sinks.contiguous()
        return args

    def keys(self, key: torch.Tensor, seq: int, positions: torch.Tensor) -> torch.Tensor:
        """fp32 keys ``[n, H, D]`` of sequence ``seq`` at ``positions [n]`` from the dequantized
        page rows ``key`` (K scale applied)."""
        key = key.to(torch.float32)
        if self.sinks is not None:
            rows = self.sinks.shape[1]
            use = positions < rows
            if bool(use.any()):
                key = key.clone()
                key[use] = self.sinks[seq, positions[use]].to(key.device)
        if self.transform.rebuilds_keys:
            key = self.transform.rebuild_key(key, positions)
        return key
