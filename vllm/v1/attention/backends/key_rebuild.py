"""What a reader needs to rebuild a layer's keys: pre-RoPE storage and FP8 key sinks.

A layer whose :class:`~vllm.kv_quant.KeyTransform` stores keys before RoPE, or that keeps key
sinks (:mod:`vllm.kv_quant.key_sinks`), cannot be read by dotting the query with the
dequantized page rows: the key at position ``p`` of a sequence is

1. the sequence's FP8 sink row ``p`` when ``p < S``, else the dequantized page row;
2. when the keys are stored before RoPE: rotated back (Hadamard), plus the offset, turned by
   RoPE at ``p`` (:meth:`~vllm.kv_quant.KeyTransform.rebuild_key`).

:class:`KeyRebuild` gathers this per call; the reference reader applies it in torch
(:meth:`KeyRebuild.keys`); ``CPU_ATTN`` and ``TRITON_ATTN`` hand its tensors to their kernels,
which do the same in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.kv_quant.formats import KVCacheFormat
from vllm.kv_quant.key_sinks import key_sink_scale, read_key_sinks, write_key_sinks
from vllm.kv_quant.key_transform import KeyTransform

__all__ = ["KeyRebuild", "check_key_sinks", "write_layer_key_sinks"]


def _layer_parts(layer: Any) -> tuple[KeyTransform, torch.Tensor | None]:
    transform = getattr(layer, "key_transform", None) or KeyTransform()
    return transform, getattr(layer, "key_sinks", None)


def check_key_sinks(
    layer: Any,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    fmt: KVCacheFormat,
) -> None:
    """``ValueError`` unless the layer's sink store (if any) fits a cache of format ``fmt``
    (FP8 or NVFP4: one with a K scale) of ``num_blocks`` pages of ``block_size`` tokens,
    ``num_kv_heads`` heads of ``head_size``."""
    _, sinks = _layer_parts(layer)
    if sinks is None:
        return
    if not fmt.is_quantized or fmt.is_per_token_head:
        raise ValueError(
            f"key_sinks: expected an FP8 or NVFP4 cache (the sink rows use its K scale), got "
            f"{fmt.name!r}"
        )
    if sinks.dim() != 4 or sinks.dtype != torch.uint8:
        raise ValueError(
            f"key_sinks: expected a uint8 [num_blocks, S, H, D] tensor, got {sinks.dtype} "
            f"{list(sinks.shape)}"
        )
    rows = sinks.shape[1]
    expected = (num_blocks, rows, num_kv_heads, head_size)
    if tuple(sinks.shape) != expected or not 1 <= rows <= block_size:
        raise ValueError(
            f"key_sinks: expected shape {list(expected)} with 1 <= S <= block_size="
            f"{block_size}, got {list(sinks.shape)}"
        )


def write_layer_key_sinks(
    layer: Any, key: torch.Tensor, slot_mapping: torch.Tensor, block_size: int, is_nvfp4: bool
) -> None:
    """Fill the layer's sink rows (if any) from the keys a writer stores: the slots among the
    first ``S`` of their page, at the FP8 scale of the layer's K scale."""
    _, sinks = _layer_parts(layer)
    if sinks is not None:
        scale = key_sink_scale(layer._k_scale, is_nvfp4)
        write_key_sinks(sinks, key, slot_mapping, block_size, scale)


@dataclass(frozen=True)
class KeyRebuild:
    """``transform``: the layer's key transform; ``sinks``: fp32 ``[num_seqs, S, H, D]`` sink
    rows of the batch's sequences (stored form, K scale applied), or None."""

    transform: KeyTransform
    sinks: torch.Tensor | None

    @classmethod
    def of(
        cls,
        layer: Any,
        block_table: torch.Tensor,
        num_seqs: int,
        k_scale: torch.Tensor,
        is_nvfp4: bool,
    ) -> KeyRebuild | None:
        """The rebuild for one call (None when keys are read as stored): sink rows of each
        sequence's first page (``block_table[:num_seqs, 0]``) at the FP8 scale of ``k_scale``."""
        transform, store = _layer_parts(layer)
        if not transform.rebuilds_keys and store is None:
            return None
        sinks = None
        if store is not None:
            first_pages = block_table[:num_seqs, 0]
            sinks = read_key_sinks(store, first_pages, key_sink_scale(k_scale, is_nvfp4))
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
