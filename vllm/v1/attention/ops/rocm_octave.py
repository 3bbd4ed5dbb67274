"""Upstream v0.33's Octave reference module (``vllm.v1.attention.ops.rocm_octave``): the slot
geometry, rotations and pure-torch quantize / dequantize / attention its ROCm kernels are
checked against. The layout and codec live in :mod:`vllm.kv_quant.octave` and
:mod:`vllm.kv_quant.octave_codec`; this module gives them upstream's names and adds the paged
reference attention."""

from __future__ import annotations

from typing import Any

import torch

from vllm.kv_quant.octave import (
    HADAMARD_BLOCK,
    NOPE_BITS,
    ROPE_BITS,
    OctaveFormat,
    register_rope_dim,
    registered_rope_dim,
)
from vllm.kv_quant.octave_codec import (
    LUT,
    LUT_MULT,
    LUT_ONE,
    fwht_blocks,
    octave_decode,
    octave_encode,
    rotate,
    sign_bits,
    signs,
    unrotate,
    v_block,
)

__all__ = [
    "HADAMARD_BLOCK",
    "LUT",
    "LUT_MULT",
    "LUT_ONE",
    "NOPE_BITS",
    "ROPE_BITS",
    "OctaveFormat",
    "fwht_blocks",
    "reference_attention",
    "reference_dequantize",
    "reference_quantize",
    "register_rope_dim",
    "registered_rope_dim",
    "rope_dim_from_hf_config",
    "rotate",
    "sign_bits",
    "signs",
    "unrotate",
    "v_block",
]

reference_quantize = octave_encode
"""``(T, H, D)`` K and V → ``(T, H, slot_bytes)`` uint8 slots (upstream's name)."""

reference_dequantize = octave_decode
"""``(T, H, slot_bytes)`` slots → fp32 ``(K, V)``, optionally left rotated (upstream's name)."""


def rope_dim_from_hf_config(hf_text_config: Any, head_size: int) -> int:
    """Rotary dims of a head: ``head_size`` times the config's ``partial_rotary_factor`` (top
    level, else in ``rope_parameters``; 1.0 when neither has it)."""
    factor = getattr(hf_text_config, "partial_rotary_factor", None)
    if factor is None:
        params = getattr(hf_text_config, "rope_parameters", None) or {}
        factor = params.get("partial_rotary_factor", 1.0)
    return int(head_size * factor)


def reference_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    q_to_req: torch.Tensor,
    q_to_klen: torch.Tensor,
    fmt: OctaveFormat,
    scale: float,
) -> torch.Tensor:
    """fp32 attention of each query token ``i`` (``query [Q, Hq, D]``) over the first
    ``q_to_klen[i]`` tokens of request ``q_to_req[i]`` in the paged Octave ``cache (B, Hkv, N,
    slot_bytes)``; a query with no tokens gives zeros. ``Hq`` is a multiple of ``Hkv``."""
    num_q, num_heads, head_size = query.shape
    _, kv_heads, block_size, _ = cache.shape
    if num_heads % kv_heads:
        raise ValueError(
            f"query: expected a multiple of the cache's {kv_heads} KV heads, got {num_heads}"
        )
    group = num_heads // kv_heads
    out = torch.zeros(num_q, num_heads, head_size, dtype=torch.float32, device=query.device)
    for i in range(num_q):
        length = int(q_to_klen[i])
        if length <= 0:
            continue
        pos = torch.arange(length, device=cache.device)
        blocks = block_table[int(q_to_req[i]), pos // block_size].long()
        k, v = octave_decode(cache[blocks, :, pos % block_size], fmt)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", query[i].float(), k) * scale, dim=-1)
        out[i] = torch.einsum("ht,thd->hd", probs, v)
    return out
