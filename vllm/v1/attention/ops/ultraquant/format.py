"""Constants and slot offsets of the ``ultraquant_4bit`` cache at upstream's module path
(``vllm.v1.attention.ops.ultraquant.format``). The facts live in :mod:`vllm.kv_quant.ultraquant`;
this module adds upstream's per-field byte counts and offsets within one slot (bytes)."""

from __future__ import annotations

import torch

from vllm.kv_quant.ultraquant import (
    DEFAULT_CONSTANT_C,
    FP4_BITS_TO_VALUE,
    FP4_LEVELS_SORTED,
    FP4_MAX,
    GROUP_SIZE,
    MIDPOINTS_SORTED,
    SORTED_TO_BITS,
    UE8M0_BIAS,
    n_groups,
    ue8m0_decode,
    ue8m0_encode,
)
from vllm.kv_quant.ultraquant import ultraquant_slot_size as slot_size

__all__ = [
    "DEFAULT_CONSTANT_C",
    "FP4_BITS_TO_VALUE",
    "FP4_LEVELS_SORTED",
    "FP4_MAX",
    "GROUP_SIZE",
    "MIDPOINTS_SORTED",
    "SORTED_TO_BITS",
    "UE8M0_BIAS",
    "check_paged_cache",
    "get_constant_c",
    "get_group_size",
    "k_codes_bytes",
    "k_codes_offset",
    "k_scales_bytes",
    "k_scales_offset",
    "n_groups",
    "slot_size",
    "ue8m0_decode",
    "ue8m0_encode",
    "v_codes_bytes",
    "v_codes_offset",
    "v_scales_bytes",
    "v_scales_offset",
]


def get_constant_c() -> float:
    """The scale constant ``c`` (fixed)."""
    return DEFAULT_CONSTANT_C


def get_group_size() -> int:
    """Values per UE8M0 scale (fixed)."""
    return GROUP_SIZE


def k_codes_bytes(head_dim: int) -> int:
    """Bytes of one head's packed codes (two per byte); the same for V."""
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim: expected an even head size, got {head_dim}")
    return head_dim // 2


v_codes_bytes = k_codes_bytes


def k_scales_bytes(head_dim: int, group_size: int | None = None) -> int:
    """Bytes of one head's group scales (one UE8M0 byte per group); the same for V."""
    return n_groups(head_dim, group_size)


v_scales_bytes = k_scales_bytes


def k_codes_offset(head_dim: int, group_size: int | None = None) -> int:
    """K codes open the slot."""
    return 0


def k_scales_offset(head_dim: int, group_size: int | None = None) -> int:
    return k_codes_bytes(head_dim)


def v_codes_offset(head_dim: int, group_size: int | None = None) -> int:
    return k_codes_bytes(head_dim) + k_scales_bytes(head_dim, group_size)


def v_scales_offset(head_dim: int, group_size: int | None = None) -> int:
    return v_codes_offset(head_dim, group_size) + v_codes_bytes(head_dim)


def check_paged_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """``ValueError``/``TypeError`` unless ``kv_cache`` is a uint8 ``[num_blocks, block_size,
    num_kv_heads, >= slot_size(head_dim)]`` page tensor."""
    if kv_cache.dtype != torch.uint8:
        raise TypeError(f"kv_cache: expected dtype torch.uint8, got {kv_cache.dtype}")
    need = slot_size(head_dim)
    if kv_cache.dim() != 4 or kv_cache.shape[2] != num_kv_heads or kv_cache.shape[3] < need:
        raise ValueError(
            f"kv_cache: expected [num_blocks, block_size, {num_kv_heads}, >= {need}], got "
            f"{tuple(kv_cache.shape)}"
        )
