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
* ``ultraquant_4bit`` sides (:mod:`vllm.kv_quant.ultraquant_codec`): the E2M1 level (from the
  16-entry table at the codebook pointer) times the group's power-of-two scale, one exact fp32
  product per element, in the key's rotated frame.
* Octave slots (:mod:`vllm.kv_quant.octave_codec`): ``LUT[code] * (scale / 64)`` per element
  (the 3-bit then the 4-bit codebook at the codebook pointer), keys and values in their rotated
  frames; K's first ``ROPE_DIM`` dims hold 4-bit codes, the rest 3-bit bit planes, one scale per
  ``K_SCALE_BLOCK`` dims.

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

ULTRAQUANT_FORMAT = 2
"""The fused kernel's ``FORMAT`` for ``ultraquant_4bit`` slots (the key and value sides)."""

OCTAVE_FORMAT = 3
"""The fused kernel's ``FORMAT`` for Octave slots (both views the whole slot)."""

# The same values as kernel constants (a plain int when Triton is not installed).
PACKED_TURBOQUANT = tl.constexpr(TURBOQUANT_FORMAT)
PACKED_INT4 = tl.constexpr(INT4_FORMAT)
PACKED_ULTRAQUANT = tl.constexpr(ULTRAQUANT_FORMAT)
PACKED_OCTAVE = tl.constexpr(OCTAVE_FORMAT)

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


@triton.jit
def ultraquant_tile(side_ptr, rows, row_ok, level_ptr, HEAD_SIZE: tl.constexpr,
                    D_PAD: tl.constexpr):  # fmt: skip
    """fp32 ``[N, D_PAD]`` of the ``ultraquant_4bit`` sides at byte offsets ``rows [N]`` of
    ``side_ptr`` (``HEAD_SIZE / 2`` code bytes, element ``2j`` in byte ``j``'s low nibble, then
    one UE8M0 byte per 32): level * 2^(byte - 127), the float whose exponent field is the byte
    (byte 0: +0)."""
    d = tl.arange(0, D_PAD)
    ok = row_ok[:, None] & (d < HEAD_SIZE)[None, :]
    byte = tl.load(side_ptr + rows[:, None] + (d // 2)[None, :], mask=ok, other=0).to(tl.int32)
    code = tl.where((d % 2 == 0)[None, :], byte & 15, byte >> 4)
    level = tl.load(level_ptr + code, mask=ok, other=0.0)
    exponent = tl.load(side_ptr + rows[:, None] + (HEAD_SIZE // 2 + d // 32)[None, :], mask=ok,
                       other=0).to(tl.int32)  # fmt: skip
    return level * (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def octave_codes(run_ptr, i, ok, N_CODES: tl.constexpr, BITS: tl.constexpr):
    """Codes ``i`` (int32) of a run of ``N_CODES`` Octave codes at ``run_ptr`` (per row): 4-bit
    words of 8 dims (byte ``j``: dim ``j`` low, ``j + 4`` high); 3-bit as a 2-bit plane (a word
    per 16 dims) of ``N_CODES / 4`` bytes, then a 1-bit plane (a word per 32 dims)."""
    if BITS == 4:
        byte = tl.load(run_ptr + (i // 8 * 4 + i % 4), mask=ok, other=0).to(tl.int32)
        return tl.where(i % 8 < 4, byte & 15, byte >> 4)
    low = tl.load(run_ptr + (i // 16 * 4 + i % 4), mask=ok, other=0).to(tl.int32)
    high = tl.load(run_ptr + (N_CODES // 4 + i // 32 * 4 + i % 4), mask=ok, other=0).to(tl.int32)
    return ((low >> (2 * ((i % 16) // 4))) & 3) + 4 * ((high >> ((i % 32) // 4)) & 1)


@triton.jit
def octave_tile(slot_ptr, rows, row_ok, lut_ptr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr,
                ROPE_DIM: tl.constexpr, K_SCALE_BLOCK: tl.constexpr, VALUE_BITS: tl.constexpr,
                IS_KEY: tl.constexpr):  # fmt: skip
    """fp32 ``[N, D_PAD]`` keys (``IS_KEY``) or values of the Octave slots at byte offsets
    ``rows [N]`` of ``slot_ptr``, rotated: ``LUT[code] * (fp16 scale / 64)``."""
    d = tl.arange(0, D_PAD)
    ok = row_ok[:, None] & (d < HEAD_SIZE)[None, :]
    row = slot_ptr + rows[:, None]
    K_NOPE: tl.constexpr = ROPE_DIM * 4 // 8
    OFF_V: tl.constexpr = K_NOPE + (HEAD_SIZE - ROPE_DIM) * 3 // 8
    OFF_SCALES: tl.constexpr = OFF_V + HEAD_SIZE * VALUE_BITS // 8
    if IS_KEY:
        rope = (d < ROPE_DIM)[None, :]
        wide = octave_codes(row, d[None, :], ok & rope, ROPE_DIM, 4)
        nope = octave_codes(row + K_NOPE, (d - ROPE_DIM)[None, :], ok & ~rope,
                            HEAD_SIZE - ROPE_DIM, 3)  # fmt: skip
        level = tl.where(rope, tl.load(lut_ptr + 8 + wide, mask=ok, other=0.0),
                         tl.load(lut_ptr + nope, mask=ok, other=0.0))  # fmt: skip
        scale = fp16_at(row + OFF_SCALES + 2 * (d // K_SCALE_BLOCK)[None, :], ok)
    else:
        code = octave_codes(row + OFF_V, d[None, :], ok, HEAD_SIZE, VALUE_BITS)
        level = tl.load(lut_ptr + (0 if VALUE_BITS == 3 else 8) + code, mask=ok, other=0.0)
        v_scale = slot_ptr + rows + OFF_SCALES + 2 * (HEAD_SIZE // K_SCALE_BLOCK)
        scale = fp16_at(v_scale, row_ok)[:, None]
    return level * (scale * 0.015625)  # scale / 64 exactly (fp16 values stay normal in fp32)
