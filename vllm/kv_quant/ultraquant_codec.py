"""Torch reference codec of the ``ultraquant_4bit`` cache: the ground truth the store, dequant
and decode kernels are compared with, bit for bit for the bytes (upstream's module path
``vllm.v1.attention.ops.ultraquant.reference`` re-exports it).

Encoding one vector ``x`` of ``D`` values (``D`` a multiple of 32):

1. K only: rotate, ``r = float32(x) @ H.T`` with ``H`` the normalised Sylvester Hadamard matrix
   (built in fp64, cast to fp32); V: ``r = float32(x)``;
2. per group of 32: ``s_raw = c * max|r|`` (fp32, ``c = 0.156``), snapped to the power of two
   ``s = 2^e`` nearest in the log domain: with ``s_raw = m * 2^E`` (``m`` in ``[1, 2)``),
   ``e = E + (m > sqrt(2))``, clamped to ``[-126, 127]``; scale byte ``e + 127``. A group
   whose ``s_raw`` is 0 or not finite (all zeros, or NaN/Inf inside) gets byte 0 and zero codes.
   Upstream computes ``e = floor(log2(s_raw) + 0.5)`` in fp32, which rounds up some ``m`` just
   below ``sqrt(2)`` (how many depends on ``E`` and on the device's ``log2``); this rule is that
   formula in exact arithmetic, the same on every device;
3. each value: the nearest E2M1 level of ``r / s`` (``torch.bucketize`` on the midpoints, so a
   tie takes the lower level; beyond ±6 saturates), written as its 4-bit code;
4. codes pack two per byte, the even element in the low nibble.

Decoding: ``code value * 2^(byte - 127)`` (0 for byte 0), in the rotated basis for K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm.kv_quant.hadamard import hadamard_matrix
from vllm.kv_quant.ultraquant import (
    DEFAULT_CONSTANT_C,
    FP4_BITS_TO_VALUE,
    GROUP_SIZE,
    MIDPOINTS_SORTED,
    SORTED_TO_BITS,
    UE8M0_BIAS,
    UE8M0_MAX_EXP,
    UE8M0_MIN_EXP,
)

__all__ = [
    "UltraQuantEncoded",
    "hadamard_matrix",
    "rotate_keys",
    "ultraquant_dequant",
    "ultraquant_encode",
    "ultraquant_encode_decode",
]

SQRT_HALF = math.sqrt(0.5)
"""``sqrt(1/2)``, irrational: no fp32 mantissa equals it, so the snap has no ties."""

_ZERO_SORTED_INDEX = MIDPOINTS_SORTED.index(-0.25) + 1
"""Sorted index of level 0 (code ``0b0000``), written for zero-scale groups."""

_BUCKETIZE_CHUNK = 2**30
"""Elements per ``torch.bucketize`` call: some backends index with int32 and fail at ``2**31``."""


def rotate_keys(x: torch.Tensor) -> torch.Tensor:
    """``float32(x) @ H.T`` (``[..., D]``, ``D`` a power of two): the key rotation, one torch
    matmul that the codec and the compiled store share, so both code the same rows."""
    return x.to(torch.float32) @ hadamard_matrix(x.shape[-1], x.device).T


def _snap_scales(s_raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2^e as fp32, UE8M0 byte)`` of each raw fp32 scale; 0 / non-finite → ``(0, 0)``."""
    is_zero = (s_raw <= 0) | ~torch.isfinite(s_raw)
    mantissa, exponent = torch.frexp(torch.where(is_zero, torch.ones_like(s_raw), s_raw))
    # s_raw = mantissa * 2^exponent with mantissa in [0.5, 1): the nearer power of two in the
    # log domain is 2^exponent once mantissa > sqrt(1/2), else 2^(exponent - 1).
    exp = (exponent - 1 + (mantissa > SQRT_HALF).to(torch.int32)).clamp(
        UE8M0_MIN_EXP, UE8M0_MAX_EXP
    )
    byte = torch.where(is_zero, 0, exp + UE8M0_BIAS).to(torch.uint8)
    scale = torch.where(is_zero, 0.0, torch.exp2(exp.to(torch.float32)))
    return scale, byte


def _sorted_index(x: torch.Tensor) -> torch.Tensor:
    """Index in the ascending E2M1 levels nearest each fp32 value (ties to the lower level)."""
    bounds = torch.tensor(MIDPOINTS_SORTED, dtype=torch.float32, device=x.device)
    if x.numel() < 2 * _BUCKETIZE_CHUNK:
        return torch.bucketize(x, bounds)
    flat = x.reshape(-1)
    parts = [torch.bucketize(c, bounds) for c in flat.split(_BUCKETIZE_CHUNK)]
    return torch.cat(parts).reshape(x.shape)


@dataclass
class UltraQuantEncoded:
    """One tensor ``[..., D]`` encoded along its last axis.

    ``codes_packed``: uint8 ``[..., D / 2]``, two E2M1 codes a byte (even element low nibble);
    ``scale_bytes``: uint8 ``[..., D / 32]``, one UE8M0 byte per group.
    """

    codes_packed: torch.Tensor
    scale_bytes: torch.Tensor

    @property
    def scales_fp32(self) -> torch.Tensor:
        """The group scales as fp32 (``2^(byte - 127)``, 0 for byte 0)."""
        b = self.scale_bytes.to(torch.int32)
        return torch.where(b == 0, 0.0, torch.exp2((b - UE8M0_BIAS).to(torch.float32)))


def ultraquant_encode(
    x: torch.Tensor, *, rotate: bool = True, constant_c: float | None = None
) -> UltraQuantEncoded:
    """Encode ``x`` (``[..., D]``, any float dtype; ``D`` a multiple of 32) to FP4 codes and UE8M0
    group scales; ``rotate`` applies the Hadamard rotation first (K yes, V no)."""
    if x.dim() == 0 or x.shape[-1] % GROUP_SIZE != 0:
        raise ValueError(
            f"x: expected a last dim that is a multiple of {GROUP_SIZE}, got shape {tuple(x.shape)}"
        )
    d = x.shape[-1]
    c = DEFAULT_CONSTANT_C if constant_c is None else constant_c
    r = rotate_keys(x) if rotate else x.to(torch.float32)
    groups = r.reshape(*x.shape[:-1], d // GROUP_SIZE, GROUP_SIZE)
    scale, scale_bytes = _snap_scales(groups.abs().amax(dim=-1) * c)
    scale = scale.unsqueeze(-1)
    idx = _sorted_index(groups / torch.where(scale == 0, 1.0, scale))
    idx = torch.where(scale == 0, _ZERO_SORTED_INDEX, idx)
    codes = torch.tensor(SORTED_TO_BITS, dtype=torch.uint8, device=x.device)[idx]
    codes = codes.reshape(*x.shape[:-1], d)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return UltraQuantEncoded(codes_packed=packed, scale_bytes=scale_bytes)


def ultraquant_dequant(encoded: UltraQuantEncoded, head_dim: int) -> torch.Tensor:
    """fp32 values of ``encoded`` (``[..., head_dim]``), still rotated if encoded rotated."""
    packed = encoded.codes_packed
    if head_dim != 2 * packed.shape[-1]:
        raise ValueError(
            f"head_dim: expected twice the packed width {2 * packed.shape[-1]}, got {head_dim}"
        )
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], head_dim)
    table = torch.tensor(FP4_BITS_TO_VALUE, dtype=torch.float32, device=packed.device)
    values = table[codes.long()].reshape(*packed.shape[:-1], -1, GROUP_SIZE)
    return (values * encoded.scales_fp32.unsqueeze(-1)).reshape(*packed.shape[:-1], head_dim)


def ultraquant_encode_decode(
    x: torch.Tensor, *, rotate: bool = True, constant_c: float | None = None
) -> torch.Tensor:
    """Encode then decode ``x`` (fp32 result, rotated basis when ``rotate``)."""
    return ultraquant_dequant(
        ultraquant_encode(x, rotate=rotate, constant_c=constant_c), x.shape[-1]
    )
