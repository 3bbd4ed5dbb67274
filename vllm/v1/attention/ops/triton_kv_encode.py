"""Device-side encoders of the KV-cache formats for Triton kernels, integer-exact.

Each ``@triton.jit`` helper here is, operation for operation, the scalar arithmetic of
``csrc/kv_quant_math.h`` / ``csrc/per_token_head.h`` and of the pure-torch codecs in
:mod:`vllm.kv_quant`, so a Triton kernel produces the codecs' bytes both on a GPU and under
Triton's interpreter. Rounding is done on the fp32 bit patterns with uint32 arithmetic, never by
a float conversion, because the interpreter's conversions differ from the GPU's and from torch
(fp32 -> bf16 truncates; fp32 -> fp8 ignores ties, mantissa carries, saturation and subnormals).
The float operations left are single IEEE fp32 multiplies, divisions (``div_rn``: Triton's ``/``
is an approximate division on the GPU) and comparisons; kernels using these helpers must be
launched with ``enable_fp_fusion=False`` so that no multiply is contracted into an FMA.

Values are passed as uint32 bit patterns (``bits``) or fp32 tensors; codes come back as uint32.
"""

from __future__ import annotations

from vllm.kv_quant.nvfp4 import SCALE_SEARCH_4OVER6
from vllm.triton_utils import tl, triton

# Source / unquantized cache element types (csrc/cache_kernels.h SourceType).
SRC_FP32: int = 0
SRC_FP16: int = 1
SRC_BF16: int = 2

# Kernel constants: Triton kernels may only read globals that are constexpr.
F32_ABS_MASK = tl.constexpr(0x7FFFFFFF)
F32_INF_BITS = tl.constexpr(0x7F800000)
F32_NAN_BITS = tl.constexpr(0x7FC00000)
# The canonical FP8 NaN byte written for any NaN input (kFp8NanByte).
FP8_NAN_BYTE = tl.constexpr(0x7F)
F32_MIN_NORMAL_BITS = tl.constexpr(0x00800000)
F32_SIGN_BITS = tl.constexpr(0x80000000)
# write_nvfp4_groups SEARCH policies: 0 nearest (nvfp4), 1 neighbour search (nvfp4_mse),
# 2 amax / 6 or amax / 4 (nvfp4_4over6).
_POLICY_4OVER6 = 2
SEARCH_4OVER6 = tl.constexpr(_POLICY_4OVER6)


def search_policy(scale_search: bool | str) -> int:
    """The ``SEARCH`` policy of a format's ``scale_search`` setting (a plain int: the cases are
    planned without Triton too)."""
    return _POLICY_4OVER6 if scale_search == SCALE_SEARCH_4OVER6 else int(scale_search)


@triton.jit
def rne_shift_right(m, s):
    """``m / 2**s`` rounded to nearest, ties to even (uint32 ``m``, shift ``s`` in [1, 31])."""
    q = m >> s
    r = m - (q << s)
    half = (s * 0 + 1) << (s - 1)
    up = (r > half) | ((r == half) & ((q & 1) == 1))
    return q + up.to(tl.uint32)


@triton.jit
def round_scaled_to_int(abs_bits, SCALE_LOG2: tl.constexpr):
    """``rint(|x| * 2**SCALE_LOG2)`` (ties to even) for the non-negative fp32 ``|x|`` with bits
    ``abs_bits``, exact for results below 2**22 (larger inputs give garbage, never selected)."""
    e = abs_bits >> 23
    mant = abs_bits & 0x7FFFFF
    m24 = tl.where(e > 0, mant | 0x800000, mant)
    e_eff = tl.maximum(e, 1).to(tl.int32)
    # |x| * 2^k = m24 * 2^(e - 150 + k): shift m24 right by 150 - k - e.
    shift = tl.minimum(tl.maximum(150 - SCALE_LOG2 - e_eff, 1), 31).to(tl.uint32)
    return rne_shift_right(m24, shift)


@triton.jit
def as_bits(x):
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def from_bits(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp16_bits_to_f32_bits(h):
    """IEEE fp16 bits (uint32, low 16 bits) -> fp32 bits, exact (subnormals, Inf, NaN)."""
    sign = (h & 0x8000) << 16
    exponent = (h >> 10) & 0x1F
    mantissa = h & 0x3FF
    # Zero or subnormal: mantissa * 2^-24, exact in fp32.
    subnormal = as_bits(mantissa.to(tl.float32) * 5.9604644775390625e-08)
    normal = ((exponent + 112) << 23) | (mantissa << 13)
    inf_or_nan = 0x7F800000 | (mantissa << 13)
    magnitude = tl.where(exponent == 0, subnormal, normal)
    magnitude = tl.where(exponent == 0x1F, inf_or_nan, magnitude)
    return sign | magnitude


@triton.jit
def source_to_f32_bits(raw, SRC: tl.constexpr):
    """A loaded source element (int32 view of fp32, int16 view of fp16 / bf16) -> fp32 bits."""
    if SRC == 0:
        bits = raw.to(tl.uint32, bitcast=True)
    else:
        h = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
        bits = h << 16 if SRC == 2 else fp16_bits_to_f32_bits(h)
    return bits


@triton.jit
def f32_bits_to_bf16_bits(bits):
    """Round to nearest even on the upper 16 bits; a NaN stays a quiet NaN (float_to_bf16_bits)."""
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits >> 16) | 0x40
    return tl.where((bits & F32_ABS_MASK) > F32_INF_BITS, nan, rounded)


@triton.jit
def f32_bits_to_fp16_bits(bits):
    """Round to nearest even, subnormals kept, |x| >= 65520 -> Inf, NaN -> 0x7E00 with its sign
    (float_to_fp16_bits)."""
    sign = (bits >> 16) & 0x8000
    a = bits & F32_ABS_MASK
    normal = ((a + 0xFFF + ((a >> 13) & 1)) >> 13) - ((127 - 15) << 10)
    subnormal = round_scaled_to_int(a, 24)
    code = tl.where(a < 0x38800000, subnormal, normal)
    code = tl.where(a >= 0x477FF000, 0x7C00, code)
    code = tl.where(a > F32_INF_BITS, 0x7E00, code)
    return sign | code


@triton.jit
def f32_bits_to_source(bits, DST: tl.constexpr):
    """fp32 bits -> the bit pattern of an unquantized cache element (uint32), rounded like
    torch's ``.to()``."""
    if DST == 0:
        out = bits
    elif DST == 1:
        out = f32_bits_to_fp16_bits(bits)
    else:
        out = f32_bits_to_bf16_bits(bits)
    return out


@triton.jit
def f32_to_fp8(x, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, MAX_BITS: tl.constexpr,
               MAX_CODE: tl.constexpr):  # fmt: skip
    """fp32 -> FP8 byte (uint32): round to nearest even, saturate to +-max (Inf too), NaN ->
    0x7F (float_to_fp8_satfinite). ``MAX_BITS``: fp32 bits of the largest finite value."""
    BIAS: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    DROPPED: tl.constexpr = 23 - MAN_BITS
    MIN_NORMAL_BITS: tl.constexpr = (127 + 1 - BIAS) << 23
    bits = as_bits(x)
    sign = (bits >> 24) & 0x80
    a = bits & F32_ABS_MASK
    # Below the smallest normal: the magnitude in subnormal steps 2^(1 - BIAS - MAN_BITS).
    subnormal = round_scaled_to_int(a, BIAS - 1 + MAN_BITS)
    rounded = a + ((1 << (DROPPED - 1)) - 1) + ((a >> DROPPED) & 1)
    exponent = (rounded >> 23) - 127 + BIAS
    mantissa = (rounded >> DROPPED) & ((1 << MAN_BITS) - 1)
    normal = (exponent << MAN_BITS) | mantissa
    code = tl.where(a < MIN_NORMAL_BITS, subnormal, normal)
    code = tl.where(a >= MAX_BITS, MAX_CODE, code)
    return tl.where(a > F32_INF_BITS, FP8_NAN_BYTE, sign | code)


@triton.jit
def f32_to_e4m3(x):
    return f32_to_fp8(x, 4, 3, 0x43E00000, 0x7E)  # max 448


@triton.jit
def f32_to_e5m2(x):
    return f32_to_fp8(x, 5, 2, 0x47600000, 0x7B)  # max 57344


@triton.jit
def e4m3_to_f32(byte):
    """FP8 e4m3fn byte (uint32) -> fp32, exact; 0x7F / 0xFF are NaN."""
    sign = (byte & 0x80) << 24
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    subnormal = as_bits(mantissa.to(tl.float32) * 0.001953125)  # mantissa * 2^-9
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    magnitude = tl.where(exponent == 0, subnormal, normal)
    magnitude = tl.where((byte & 0x7F) == 0x7F, 0x7FC00000, magnitude)
    return from_bits(sign | magnitude)


@triton.jit
def f32_to_e2m1(v):
    """fp32 -> E2M1 code (bit 3 sign, bits 0-2 index into {0, .5, 1, 1.5, 2, 3, 4, 6}): round
    half to even on the grid, saturate to +-6, NaN -> 0 (float_to_e2m1)."""
    bits = as_bits(v)
    a = from_bits(bits & F32_ABS_MASK)  # a NaN fails every comparison: magnitude 0
    magnitude = (
        (a > 0.25).to(tl.uint32)
        + (a >= 0.75).to(tl.uint32)
        + (a > 1.25).to(tl.uint32)
        + (a >= 1.75).to(tl.uint32)
        + (a > 2.5).to(tl.uint32)
        + (a >= 3.5).to(tl.uint32)
        + (a > 5.0).to(tl.uint32)
    )
    sign = tl.where((bits & F32_ABS_MASK) > F32_INF_BITS, 0, (bits >> 28) & 0x8)
    return sign | magnitude


@triton.jit
def e2m1_to_f32(code):
    """E2M1 code (uint32) -> fp32; code 8 is -0.0 (the sign set as a bit: some Triton versions
    negate as ``0 - x``, which gives +0.0)."""
    m = code & 0x7
    magnitude = tl.where(
        m < 4,
        m.to(tl.float32) * 0.5,
        tl.where(m == 4, 2.0, tl.where(m == 5, 3.0, tl.where(m == 6, 4.0, 6.0))),
    )
    return from_bits(as_bits(magnitude) | ((code & 0x8) << 28))


@triton.jit
def f32_to_int8_rne_sat(y):
    """fp32 -> int8 byte (uint32, two's complement): clamp to [-127, 127], round half to even
    (float_to_int8_rne_sat; ``y`` is never NaN where the byte is kept)."""
    clamped = tl.minimum(tl.maximum(y, -127.0), 127.0)
    magnitude = round_scaled_to_int(as_bits(clamped) & F32_ABS_MASK, 0).to(tl.int32)
    signed = tl.where(clamped < 0.0, -magnitude, magnitude)
    return signed.to(tl.uint32, bitcast=True) & 0xFF


# --- Row writers: rows of a cache side (a token's heads), for the writer kernel. ---
# Offsets are [R] vectors of element offsets (one per row) and ``row_ok`` [R] masks whole rows,
# so one program stores a [R, D] tile: wide, coalesced accesses instead of a row per program.


@triton.jit
def write_plain_rows(src_ptr, src_off, dst_ptr, dst_off, row_ok, D: tl.constexpr,
                     D_PAD: tl.constexpr, SRC: tl.constexpr, DST: tl.constexpr):  # fmt: skip
    """Unquantized rows: bits copied when the dtypes agree, else widened and rounded to DST."""
    d = tl.arange(0, D_PAD)[None, :]
    mask = row_ok[:, None] & (d < D)
    raw = tl.load(src_ptr + src_off[:, None] + d, mask=mask, other=0)
    if SRC == DST:
        out = raw
    else:
        bits = f32_bits_to_source(source_to_f32_bits(raw, SRC), DST)
        if DST == 0:
            out = bits.to(tl.int32, bitcast=True)
        else:
            out = bits.to(tl.uint16).to(tl.int16, bitcast=True)
    tl.store(dst_ptr + dst_off[:, None] + d, out, mask=mask)


@triton.jit
def write_fp8_rows(src_ptr, src_off, dst_ptr, dst_off, row_ok, scale, D: tl.constexpr,
                   D_PAD: tl.constexpr, SRC: tl.constexpr, E5M2: tl.constexpr):  # fmt: skip
    """FP8 rows: ``fp8(x / scale)`` (``scale`` [R]), saturating, NaN -> 0x7F."""
    d = tl.arange(0, D_PAD)[None, :]
    mask = row_ok[:, None] & (d < D)
    raw = tl.load(src_ptr + src_off[:, None] + d, mask=mask, other=0)
    x = from_bits(source_to_f32_bits(raw, SRC))
    y = tl.math.div_rn(x, tl.zeros_like(x) + scale[:, None])
    code = f32_to_e5m2(y) if E5M2 else f32_to_e4m3(y)
    tl.store(dst_ptr + dst_off[:, None] + d, code.to(tl.uint8), mask=mask)


@triton.jit
def write_per_token_head_rows(src_ptr, src_off, dst_ptr, dst_off, row_ok, scale_ptr, scale_off,
                              D: tl.constexpr, D_PAD: tl.constexpr, SRC: tl.constexpr,
                              FP8: tl.constexpr, QMAX: tl.constexpr, FLOOR: tl.constexpr,
                              SCALE_INLINE: tl.constexpr, ROW_ALIGN: tl.constexpr):  # fmt: skip
    """Per-token-head rows: scale = max(finite amax / QMAX, FLOOR) (NaN for a row holding a
    NaN, whose bytes are 0), bytes = int8 / e4m3 of ``x * (1 / scale)``. The scale's fp32 bits
    go after the row, little-endian (SCALE_INLINE), or into an int32 view of a separate scale
    cache at ``scale_off``. ``ROW_ALIGN``: the byte alignment the host found for every row and
    inline scale (4: rows stored 4 bytes at a time, each scale one 4-byte store; 1: bytes)."""
    dst_rows = dst_off[:, None]
    if ROW_ALIGN % 4 == 0:
        dst_rows = tl.multiple_of(dst_rows, [4, 4])
    d = tl.arange(0, D_PAD)[None, :]
    mask = row_ok[:, None] & (d < D)
    bits = source_to_f32_bits(tl.load(src_ptr + src_off[:, None] + d, mask=mask, other=0), SRC)
    a = bits & F32_ABS_MASK
    has_nan = tl.max(tl.where(mask & (a > F32_INF_BITS), 1, 0), axis=1) > 0
    # |x| orders like its bits; Inf and NaN do not count.
    amax = from_bits(tl.max(tl.where(mask & (a < F32_INF_BITS), a, 0), axis=1))
    scale = tl.maximum(tl.math.div_rn(amax, tl.zeros_like(amax) + QMAX), FLOOR)
    inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
    y = from_bits(bits) * inv[:, None]
    code = f32_to_e4m3(y) if FP8 else f32_to_int8_rne_sat(y)
    code = tl.where(has_nan[:, None], 0, code)
    tl.store(dst_ptr + dst_rows + d, code.to(tl.uint8), mask=mask)
    scale_bits = tl.where(has_nan, F32_NAN_BITS, as_bits(scale))
    if SCALE_INLINE and ROW_ALIGN % 4 == 0:
        word = (dst_ptr + tl.multiple_of(dst_off + D, 4)).to(
            tl.pointer_type(tl.uint32), bitcast=True
        )
        tl.store(word, scale_bits, mask=row_ok)
    elif SCALE_INLINE:
        for b in tl.static_range(4):
            byte = ((scale_bits >> (8 * b)) & 0xFF).to(tl.uint8)
            tl.store(dst_ptr + dst_off + D + b, byte, mask=row_ok)
    else:
        tl.store(scale_ptr + scale_off, scale_bits.to(tl.int32, bitcast=True), mask=row_ok)


@triton.jit
def load_f32(src_ptr, offs, mask, SRC: tl.constexpr):
    return from_bits(source_to_f32_bits(tl.load(src_ptr + offs, mask=mask, other=0), SRC))


@triton.jit
def _nonzero(x):
    return tl.where(x == 0.0, 1.0, x)


@triton.jit
def nvfp4_candidate_error(src_ptr, group_off, gmask, c, inv, SRC: tl.constexpr):
    """Squared error of each group under block-scale byte ``c`` (nvfp4_candidate_error): every
    op one rounded fp32 op, summed strictly in element order."""
    c_f = e4m3_to_f32(c)
    # A zero scale byte gives multiplier 0 (divided by 1 only to keep 1 / 0 out of the lanes).
    mult = tl.where(c_f == 0.0, 0.0, tl.math.div_rn(tl.zeros_like(c_f) + inv, _nonzero(c_f)))
    err = tl.zeros_like(c_f)
    for i in range(16):  # a loop, not unrolled: 3 candidates x 16 loads bloat the code
        x = load_f32(src_ptr, group_off + i, gmask, SRC)
        q = e2m1_to_f32(f32_to_e2m1(x * mult))
        diff = q * c_f - x * inv
        err = err + diff * diff
    return err


@triton.jit
def nvfp4_nearest_or_searched(src_ptr, src_off, group_ok, amax, amax_bits, has_nan, inv,
                              SRC: tl.constexpr, SEARCH: tl.constexpr):  # fmt: skip
    """Scale byte and multiplier of nvfp4 (sf = e4m3((amax * inv) / 6), 0x7F for a NaN group)
    or, with SEARCH (nvfp4_mse), the best of sf, sf - 1, sf + 1 by squared group error."""
    block_scale = tl.math.div_rn(amax * inv, tl.zeros_like(amax) + 6.0)
    block_scale = tl.where(has_nan, from_bits(amax_bits * 0 + F32_NAN_BITS), block_scale)
    sf = f32_to_e4m3(block_scale)
    if SEARCH:
        plain = has_nan | (amax_bits == F32_INF_BITS) | (amax_bits == 0)
        best = sf
        best_err = nvfp4_candidate_error(src_ptr, src_off, group_ok, sf, inv, SRC)
        err_m = nvfp4_candidate_error(src_ptr, src_off, group_ok, sf - 1, inv, SRC)
        take = (sf >= 1) & (err_m < best_err)  # strictly smaller: ties keep the earlier
        best = tl.where(take, sf - 1, best)
        best_err = tl.where(take, err_m, best_err)
        err_p = nvfp4_candidate_error(src_ptr, src_off, group_ok, sf + 1, inv, SRC)
        take = (sf + 1 <= 0x7E) & (err_p < best_err)
        best = tl.where(take, sf + 1, best)
        sf = tl.where(plain, sf, best)
    sf_f = e4m3_to_f32(sf)
    mult = tl.where(sf_f == 0.0, 0.0, tl.math.div_rn(tl.zeros_like(sf_f) + inv, _nonzero(sf_f)))
    return sf, mult


@triton.jit
def rcp_ftz(v):
    """``1 / v`` in fp32 with subnormal inputs and results flushed to signed zero (the
    reciprocal of upstream's 4over6 writer, vllm.kv_quant.nvfp4._rcp_ftz)."""
    bits = as_bits(v)
    tiny = (bits & F32_ABS_MASK) < F32_MIN_NORMAL_BITS
    r = tl.math.div_rn(tl.zeros_like(v) + 1.0, tl.where(tiny, 1.0, v))
    r = tl.where(tiny, from_bits((bits & F32_SIGN_BITS) | F32_INF_BITS), r)
    r_bits = as_bits(r)
    return tl.where(
        (r_bits & F32_ABS_MASK) < F32_MIN_NORMAL_BITS, from_bits(r_bits & F32_SIGN_BITS), r
    )


@triton.jit
def nvfp4_4over6_candidate(even, odd, amax, inv, inv_rcp, DENOM: tl.constexpr):
    """Scale byte, multiplier and squared group error of block scale ``amax / DENOM`` for
    nvfp4_4over6 (vllm.kv_quant.nvfp4._quantize_4over6): the error sums the pairs
    ``(d_2k^2 + d_2k+1^2)`` in order k = 0..7, one rounded fp32 op each."""
    sf = f32_to_e4m3(inv * (amax * rcp_ftz(tl.zeros_like(amax) + DENOM)))
    sf_f = e4m3_to_f32(sf)
    mult = tl.where(sf_f == 0.0, 0.0, rcp_ftz(sf_f * inv_rcp))
    deq = tl.where(mult == 0.0, 0.0, rcp_ftz(mult))[:, None]
    xe = from_bits(even)
    xo = from_bits(odd)
    de = e2m1_to_f32(f32_to_e2m1(xe * mult[:, None])) * deq - xe
    do = e2m1_to_f32(f32_to_e2m1(xo * mult[:, None])) * deq - xo
    pair = de * de + do * do
    j = tl.arange(0, 8)[None, :]
    err = tl.zeros_like(amax)
    for k in tl.static_range(8):  # sequential: no tree reduction
        err = err + tl.sum(tl.where(j == k, pair, 0.0), axis=1)
    return sf, mult, err


@triton.jit
def write_nvfp4_groups(src_ptr, src_off, dst_ptr, data_off, scale_off, group_ok, scale,
                       SRC: tl.constexpr, SEARCH: tl.constexpr):  # fmt: skip
    """NVFP4 16-element groups, one per row: ``src_off`` (source elements), ``data_off`` (8
    data bytes), ``scale_off`` (the block-scale byte, at its linear or interleave4 place) and
    the global ``scale`` are [R] vectors. Block-scale byte sf = e4m3((amax * inv) / 6) with
    inv = 1 / scale (0x7F and zero data for a group holding a NaN), codes E2M1(x * (inv / sf)),
    even element in the low nibble. SEARCH (nvfp4_mse): the best of sf, sf - 1, sf + 1 by
    squared group error. SEARCH_4OVER6 (nvfp4_4over6): sf = e4m3(inv * (amax * rcp(d))) for
    d = 6 and 4, multiplier rcp(float(sf) * rcp(inv)); amax / 4 only where its error is lower."""
    mask = group_ok[:, None] & (tl.arange(0, 16) < 16)[None, :]
    raw = tl.load(src_ptr + src_off[:, None] + tl.arange(0, 16)[None, :], mask=mask, other=0)
    # One contiguous load per group, split into its even and odd elements.
    even, odd = tl.split(tl.reshape(source_to_f32_bits(raw, SRC), [raw.shape[0], 8, 2]))
    ae = even & F32_ABS_MASK
    ao = odd & F32_ABS_MASK
    has_nan = (tl.max(tl.where((ae > F32_INF_BITS) | (ao > F32_INF_BITS), 1, 0), axis=1)) > 0
    amax_bits = tl.maximum(
        tl.max(tl.where(ae > F32_INF_BITS, 0, ae), axis=1),
        tl.max(tl.where(ao > F32_INF_BITS, 0, ao), axis=1),
    )
    inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
    amax = from_bits(amax_bits)
    if SEARCH == SEARCH_4OVER6:
        amax = tl.where(has_nan, from_bits(amax_bits * 0 + F32_NAN_BITS), amax)
        inv_rcp = rcp_ftz(inv)
        sf, mult, err6 = nvfp4_4over6_candidate(even, odd, amax, inv, inv_rcp, 6.0)
        sf4, mult4, err4 = nvfp4_4over6_candidate(even, odd, amax, inv, inv_rcp, 4.0)
        use4 = err4 < err6  # strictly: ties (and NaN errors) keep amax / 6
        sf = tl.where(use4, sf4, sf)
        mult = tl.where(use4, mult4, mult)
    else:
        sf, mult = nvfp4_nearest_or_searched(src_ptr, src_off, group_ok, amax, amax_bits,
                                             has_nan, inv, SRC, SEARCH)  # fmt: skip
    lo = f32_to_e2m1(from_bits(even) * mult[:, None])
    hi = f32_to_e2m1(from_bits(odd) * mult[:, None])
    packed = tl.where((sf == FP8_NAN_BYTE)[:, None], 0, (hi << 4) | lo)
    j = tl.arange(0, 8)[None, :]
    tl.store(dst_ptr + data_off[:, None] + j, packed.to(tl.uint8), mask=group_ok[:, None] & (j < 8))
    tl.store(dst_ptr + scale_off, sf.to(tl.uint8), mask=group_ok)
