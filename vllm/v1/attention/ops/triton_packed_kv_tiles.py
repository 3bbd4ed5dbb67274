"""Triton decoders of the packed KV-cache formats that the fused attention kernel
(:mod:`vllm.v1.attention.ops.triton_packed_attention`) reads straight from their pages: one
tile of keys or values at a time, no decoded copy (``@triton.jit`` helpers, no kernels).

* TurboQuant slots (:mod:`vllm.kv_quant.turboquant.codec`): FP8 e4m3 keys as exact units
  (value * 2^-8, :func:`~.triton_kv_decode.fp8_units`) with the factor 2^8 per key; Lloyd-Max
  keys as their centroids in the rotated frame with the fp16 norm (divided by the centroid
  vector's length under norm correction) as the per-key factor, which the kernel multiplies
  into the scores once instead of into every element; values as ``code * scale + lo`` per
  element, the codec's two fp32 roundings (the kernel is launched without FMA contraction).
* ``int4_per_token_head`` rows (:mod:`vllm.kv_quant.int4_per_token_head`): ``code - zp`` as an
  exact small integer in the dot dtype and the row's scale (the scale word without its zero
  point bits) as the per-row factor.

Masked elements (keys outside the range, padding columns) are 0 in every tile, so a stale or
NaN byte never reaches a dot.
"""

from __future__ import annotations

from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_kv_decode import fp8_units

TURBOQUANT_FORMAT = 0
"""The fused kernel's ``FORMAT`` for TurboQuant slots (key and value in one row)."""

INT4_FORMAT = 1
"""The fused kernel's ``FORMAT`` for ``int4_per_token_head`` sides and their scale words."""

# The same values as kernel constants (a plain int when Triton is not installed).
PACKED_TURBOQUANT = tl.constexpr(TURBOQUANT_FORMAT)
PACKED_INT4 = tl.constexpr(INT4_FORMAT)

NORM_EPS = tl.constexpr(1e-16)
"""The codec's: added to the centroid vector's squared length under norm correction (an
all-zero code vector stays finite)."""


@triton.jit
def bit_codes(row_ptr, d, ok, BITS: tl.constexpr):
    """Codes ``d`` of a little-endian bit stream at ``row_ptr`` (code ``d`` in bits ``[BITS*d,
    BITS*d + BITS)``), int32; a code crossing a byte boundary reads both bytes."""
    bit = d * BITS
    first = bit >> 3
    shift = bit & 7
    lo = tl.load(row_ptr + first, mask=ok, other=0).to(tl.int32)
    hi = tl.load(row_ptr + first + 1, mask=ok & (shift + BITS > 8), other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> shift) & ((1 << BITS) - 1)


@triton.jit
def fp16_at(ptr, ok):
    """The fp32 value of the little-endian fp16 at ``ptr`` (2 bytes), exact; 0 where masked."""
    b0 = tl.load(ptr, mask=ok, other=0).to(tl.uint16)
    b1 = tl.load(ptr + 1, mask=ok, other=0).to(tl.uint16)
    return (b0 | (b1 << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def turboquant_key_tile(
    key_ptr,
    rows,
    row_ok,
    centroid_ptr,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    KEY_FP8: tl.constexpr,
    MSE_BITS: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
):
    """``(tile [N, D_PAD] fp32, factor [N] fp32)`` of the TurboQuant keys at byte offsets
    ``rows [N]`` of ``key_ptr`` (``row_ok`` masks them): the key is ``factor * tile`` (FP8:
    e4m3 units and 2^8; Lloyd-Max: centroids in the rotated frame and the norm, over the
    centroids' length under norm correction)."""
    d = tl.arange(0, D_PAD)
    ok = row_ok[:, None] & (d < HEAD_SIZE)[None, :]
    if KEY_FP8:
        byte = tl.load(key_ptr + rows[:, None] + d[None, :], mask=ok, other=0)
        tile = fp8_units(byte, False).to(tl.float32)
        factor = tl.where(row_ok, 256.0, 0.0)
    else:
        code = bit_codes(key_ptr + rows[:, None], d[None, :], ok, MSE_BITS)
        tile = tl.load(centroid_ptr + code, mask=ok, other=0.0)
        factor = fp16_at(key_ptr + rows + HEAD_SIZE * MSE_BITS // 8, row_ok)
        if NORM_CORRECTION:
            length = tl.sqrt_rn(tl.sum(tile * tile, axis=1) + NORM_EPS)
            factor = tl.math.div_rn(factor, length)
    return tile, factor


@triton.jit
def turboquant_value_tile(
    value_ptr,
    rows,
    row_ok,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    VALUE_BITS: tl.constexpr,
):
    """fp32 ``[N, D_PAD]`` values ``code * scale + lo`` (the codec's) of the TurboQuant value
    parts at byte offsets ``rows [N]`` of ``value_ptr``."""
    d = tl.arange(0, D_PAD)
    ok = row_ok[:, None] & (d < HEAD_SIZE)[None, :]
    code = bit_codes(value_ptr + rows[:, None], d[None, :], ok, VALUE_BITS).to(tl.float32)
    stats = value_ptr + rows + HEAD_SIZE * VALUE_BITS // 8
    return code * fp16_at(stats, row_ok)[:, None] + fp16_at(stats + 2, row_ok)[:, None]


@triton.jit
def int4_tile(
    data_ptr,
    word_ptr,
    rows,
    words,
    row_ok,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """``(tile [N, D_PAD] in DTYPE, scale [N] fp32)`` of the ``int4_per_token_head`` rows at
    byte offsets ``rows [N]`` of ``data_ptr`` and their int32 scale words at element offsets
    ``words [N]`` of ``word_ptr``: ``tile`` is ``code - zp`` (in -15..15, exact in any float
    dtype), byte ``j``'s low nibble element ``2j`` and high nibble ``2j + 1``; the value is
    ``tile * scale`` in the rotated domain."""
    half = tl.arange(0, D_PAD // 2)
    mask = row_ok[:, None] & (half < HEAD_SIZE // 2)[None, :]
    byte = tl.load(data_ptr + rows[:, None] + half[None, :], mask=mask, other=0).to(tl.int32)
    word = tl.load(word_ptr + words, mask=row_ok, other=0)
    code = (
        tl.reshape(tl.join(byte & 0xF, byte >> 4), [rows.shape[0], D_PAD]) - (word & 0xF)[:, None]
    )
    col = tl.arange(0, D_PAD)
    code = tl.where(row_ok[:, None] & (col < HEAD_SIZE)[None, :], code, 0)
    return code.to(tl.float32).to(DTYPE), (word & -16).to(tl.float32, bitcast=True)
