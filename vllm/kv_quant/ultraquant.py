"""Byte layout and registry entry of the ``ultraquant_4bit`` KV cache (upstream v0.33's
``KVQuantMode.ULTRAQUANT_4BIT``).

One slot per (token, KV head) packs both sides, ``D`` the head size (elements), ``G = D / 32``:

- bytes ``[0, D/2)``: K codes, FP4 E2M1, element ``2j`` in byte ``j``'s low nibble;
- bytes ``[D/2, D/2 + G)``: K group scales, one UE8M0 byte each (``2^(byte - 127)``, 0 = zero);
- bytes ``[D/2 + G, D + G)``: V codes; bytes ``[D + G, D + 2G)``: V group scales.

So a slot is ``D + 2G`` bytes (272 at ``D = 256``, 136 at ``D = 128``). K is Hadamard-rotated
before quantization, V is not. The registry's rows are per side, so the row is half the slot and
the two-sided page math (``2 * block_size * H * row``) gives the packed page, as upstream's spec
does with ``state_content_bytes = slot_size(D)``. Its compiled writer is its own op
(``_C_cache_ops::ultraquant_store``, one packed K+V slot), not ``reshape_and_cache_flash``
(``cache_kind=None``): :func:`~vllm.kv_quant.formats.kernel_cache_kind` refuses it.
"""

from __future__ import annotations

import math

import torch

from vllm.kv_quant.formats import KVCacheFormat, register_format
from vllm.kv_quant.modes import KVQuantMode

__all__ = [
    "DEFAULT_CONSTANT_C",
    "FP4_BITS_TO_VALUE",
    "FP4_LEVELS_SORTED",
    "FP4_MAX",
    "GROUP_SIZE",
    "MIDPOINTS_SORTED",
    "SORTED_TO_BITS",
    "UE8M0_BIAS",
    "ULTRAQUANT_4BIT",
    "n_groups",
    "ue8m0_decode",
    "ue8m0_encode",
    "ultraquant_row_dim",
    "ultraquant_slot_size",
]

FP4_BITS_TO_VALUE: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
"""Value of each 4-bit E2M1 code (sign bit 3, exponent bits 2-1, mantissa bit 0)."""

FP4_LEVELS_SORTED: tuple[float, ...] = tuple(sorted(set(FP4_BITS_TO_VALUE)))
"""The 15 distinct E2M1 values, ascending (``-0`` folds into ``0``)."""

MIDPOINTS_SORTED: tuple[float, ...] = tuple(
    (lo + hi) / 2.0 for lo, hi in zip(FP4_LEVELS_SORTED[:-1], FP4_LEVELS_SORTED[1:], strict=True)
)
"""The 14 rounding boundaries between neighbouring levels; a value on a boundary takes the lower
level (``torch.bucketize`` with ``right=False``)."""

SORTED_TO_BITS: tuple[int, ...] = tuple(
    FP4_BITS_TO_VALUE.index(level) for level in FP4_LEVELS_SORTED
)
"""Sorted level index → its code; zero is written as ``0b0000`` (``+0``), never ``-0``."""

GROUP_SIZE = 32
"""Values per UE8M0 scale (the scaled-MFMA granule upstream targets)."""

FP4_MAX = 6.0
"""Largest E2M1 magnitude."""

DEFAULT_CONSTANT_C = 0.156
"""Scale constant: a group's raw scale is ``c * absmax`` before the power-of-two snap."""

UE8M0_BIAS = 127
"""UE8M0 exponent bias: byte ``e`` in ``[1, 254]`` is ``2^(e - 127)``; byte 0 is zero."""

UE8M0_MIN_EXP = -126
UE8M0_MAX_EXP = 127


def ue8m0_encode(s: float) -> int:
    """UE8M0 byte of one positive scale, as upstream's scalar helper: nearest power of two by
    Python's ``round`` (ties to even), 0 for ``s <= 0``, non-finite ``s`` or exponents below
    ``-126``, exponents above 127 clamped. The tensor codec rounds ties up and clamps small
    exponents to byte 1 instead (upstream's kernels follow the tensor codec)."""
    if s <= 0.0 or not math.isfinite(s):
        return 0
    exp = round(math.log2(s))
    if exp < UE8M0_MIN_EXP:
        return 0
    return min(exp, UE8M0_MAX_EXP) + UE8M0_BIAS


def ue8m0_decode(byte: int) -> float:
    """Scale of one UE8M0 byte; 0 decodes to ``0.0``."""
    if not 0 <= byte <= 255:
        raise ValueError(f"byte: expected a value in [0, 255], got {byte}")
    return 0.0 if byte == 0 else 2.0 ** (byte - UE8M0_BIAS)


def n_groups(head_dim: int, group_size: int | None = None) -> int:
    """Scale groups per head (one UE8M0 byte each per side)."""
    gs = GROUP_SIZE if group_size is None else group_size
    if gs <= 0 or head_dim <= 0 or head_dim % gs != 0:
        raise ValueError(
            f"head_dim: expected a positive multiple of group_size={gs}, got {head_dim}"
        )
    return head_dim // gs


def ultraquant_slot_size(head_dim: int, group_size: int | None = None) -> int:
    """Bytes of one packed K+V slot (one token, one KV head): ``D + 2 * D / 32``."""
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim: expected an even head size, got {head_dim}")
    return head_dim + 2 * n_groups(head_dim, group_size)


def ultraquant_row_dim(head_size: int) -> int:
    """Bytes per head per side in the registry's two-sided page math: half the slot."""
    return ultraquant_slot_size(head_size) // 2


ULTRAQUANT_4BIT = register_format(
    KVCacheFormat(
        name="ultraquant_4bit",
        accepted_names=("ultraquant_4bit",),
        storage_dtype=torch.uint8,
        quant_mode=KVQuantMode.ULTRAQUANT_4BIT,
        label="uq4",
        row_dim=ultraquant_row_dim,
        # reshape_and_cache_flash does not take it (its slots pack K and V): refused by name.
        cache_kind=None,
        has_kernel=False,
    )
)
