"""``ultraquant_full_dequant_kv``: reads a request's cached K/V back from an ``ultraquant_4bit``
paged cache (upstream's ``vllm.v1.attention.ops.ultraquant.triton_dequant`` entry point).

This implementation gathers the slots and decodes them with the torch reference
(:func:`.reference.ultraquant_dequant`); upstream's Triton kernel is not ported yet.
"""

from __future__ import annotations

import torch

from vllm.v1.attention.ops.ultraquant.format import (
    k_scales_offset,
    v_codes_offset,
    v_scales_offset,
)
from vllm.v1.attention.ops.ultraquant.reference import UltraQuantEncoded, ultraquant_dequant
from vllm.v1.attention.ops.ultraquant.triton_store import check_paged_cache

__all__ = ["ultraquant_full_dequant_kv"]


def ultraquant_full_dequant_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    alloc_len: int,
) -> None:
    """Decode positions ``[0, alloc_len)`` (tokens) of each of the ``B`` requests in
    ``block_table`` ``[B, max_blocks]`` into ``k_out``/``v_out`` ``[B, Hk, >= alloc_len, D]``
    (fp16/bf16/fp32, one rounding from the exact fp32 value). K comes back in the rotated
    basis it is stored in."""
    if k_out.dim() != 4 or v_out.shape != k_out.shape or v_out.dtype != k_out.dtype:
        raise ValueError(
            f"k_out: expected [B, Hk, S, D] with v_out alike, got {tuple(k_out.shape)} and "
            f"{tuple(v_out.shape)}"
        )
    b, hk, s, d = k_out.shape
    check_paged_cache(kv_cache, hk, d)
    block_size = kv_cache.shape[1]
    need_blocks = -(-alloc_len // block_size)
    if not 0 <= alloc_len <= s or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(
            f"block_table: expected [{b}, >= {need_blocks}] and alloc_len in [0, {s}], got "
            f"{tuple(block_table.shape)} and {alloc_len}"
        )
    if block_table.shape[1] < need_blocks:
        raise ValueError(
            f"block_table: expected >= {need_blocks} blocks per request, got {block_table.shape[1]}"
        )
    pos = torch.arange(alloc_len, device=kv_cache.device)
    blocks = block_table.to(kv_cache.device, torch.int64)[:, pos // block_size]
    slots = kv_cache[blocks, pos % block_size]  # [B, alloc_len, Hk, slot bytes]
    k_sc, v_co, v_sc = k_scales_offset(d), v_codes_offset(d), v_scales_offset(d)
    groups = v_co - k_sc
    for out, codes, scales in (
        (k_out, slots[..., :k_sc], slots[..., k_sc:v_co]),
        (v_out, slots[..., v_co:v_sc], slots[..., v_sc : v_sc + groups]),
    ):
        values = ultraquant_dequant(UltraQuantEncoded(codes, scales), d)
        out[:, :, :alloc_len] = values.transpose(1, 2).to(out.dtype)
