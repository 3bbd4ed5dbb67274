"""Triton decoders of the paged KV-cache formats (``@triton.jit`` helpers, no kernels).

:func:`load_kv_tile` reads a tile of one cache side straight from its pages as exact values
WITHOUT their scales; the attention kernel applies every scale once per score, probability
or output row instead of once per element (a few integer operations per element keep the
quantized reads memory-bound). With a softmax weight of 1 each output element is still the
reference codec's value of :mod:`vllm.kv_quant`, bit for bit:

* unquantized fp16 / fp32: loaded and widened; bf16: read as int16 bits, shifted into the high
  half of an fp32 (exact, and right under Triton's interpreter, whose bf16 is wrong);
* FP8 e4m3 / e5m2 (per-tensor or per-head scale): :func:`fp8_units`, the bytes' bits moved
  into exact fp16 (e4m3 times 2^-8); the kernel multiplies the scores by ``k_scale * 2^8`` and
  the output by ``v_scale * 2^8`` (``fp32(q) * scale`` rounded once, as ``dequantize_fp8``);
* per-token-head INT8 / FP8: the integer without an int-to-float conversion, for fp16 dots as
  an fp16 (its bits under 2^10's exponent, minus 1152), else as an fp32 (under 2^23's, minus
  2^23 + 128), or the e4m3 :func:`fp8_units`; the row's fp32
  scale (:func:`load_row_scale`: 4 inline little-endian bytes after the row, this library's
  layout, or upstream's separate ``k_scale_cache``; times 2^8 for e4m3) multiplies the key's
  scores and the value's probabilities (``p * scale`` then times the value: one rounding, as
  the codec);
* NVFP4: :func:`nvfp4_tile` gives ``E2M1[q] * sf * 2^-14`` (code and e4m3 block scale) in
  fp16, exact (and in bf16 / fp32), so a whole head goes into ONE dot; ``2^14`` times the
  global scale multiplies the scores and the output once (``(E2M1[q] * sf) * gs`` rounded
  once, as ``dequantize_nvfp4``).
"""

from __future__ import annotations

from vllm.kv_quant.formats import CacheKind
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_kv_encode import from_bits, source_to_f32_bits

NVFP4_UNIT = tl.constexpr(16384.0)
""":func:`nvfp4_tile` gives ``E2M1[q] * sf`` times ``1 / NVFP4_UNIT``."""

# The kernels' FORMAT: the registry's row encoding (CacheKind, the values the C++ kernels and
# the writer use), by name. Unquantized pages are read in their own dtype, bf16 ones as int16
# bits (BF16_PAGES).
KIND_UNQUANTIZED = tl.constexpr(CacheKind.UNQUANTIZED.value)
KIND_FP8_E4M3 = tl.constexpr(CacheKind.FP8_E4M3.value)
KIND_FP8_E5M2 = tl.constexpr(CacheKind.FP8_E5M2.value)
KIND_NVFP4 = tl.constexpr(CacheKind.NVFP4.value)
KIND_INT8_PER_TOKEN_HEAD = tl.constexpr(CacheKind.INT8_PER_TOKEN_HEAD.value)
KIND_FP8_PER_TOKEN_HEAD = tl.constexpr(CacheKind.FP8_PER_TOKEN_HEAD.value)


@triton.jit
def fp8_units(byte, E5M2: tl.constexpr):
    """Exact fp16 of FP8 bytes in a few integer operations, no fp8 type (sm_80 has none): an
    e5m2 byte is the high byte of an fp16 (its value); e4m3's sign, exponent and mantissa bits
    moved into an fp16 give its value times 2^-8 (the kernel puts the 2^8 back with the scale,
    once), its NaN bytes 0x7F / 0xFF NaN."""
    if E5M2:
        return (byte.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
    # The byte sign-extended to 16 bits and shifted by 7 has its sign in bits 15 and 14 and
    # the rest in 13..7: masking bit 14 off (0xBF80, -16512 as int16) leaves the fp16 bits.
    # Bits 13..7 are all ones for the NaN bytes alone, so adding 0x80 to them carries into bit
    # 14 for those only: or-ed in, it makes the exponent all ones over a non-zero mantissa, an
    # fp16 NaN, without a compare and select per element.
    u = byte.to(tl.int8, bitcast=True).to(tl.int16) << 7
    nan_bit = ((u & 0x3F80) + 0x80) & 0x4000
    return ((u & -16512) | nan_bit).to(tl.float16, bitcast=True)


@triton.jit
def load_row_scale(scale_ptr, offset, mask, SCALE_INLINE: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """Per-token-head scales: fp32 from 4 little-endian bytes at ``scale_ptr + offset``
    (``SCALE_INLINE``) or an fp32 load from a scale cache. ``ROW_ALIGN``: the byte alignment
    the host found for every row and inline scale (4: each scale is one fp32 load; 1: four
    byte loads)."""
    if SCALE_INLINE and ROW_ALIGN % 4 == 0:
        word = scale_ptr + tl.multiple_of(offset, 4)
        return tl.load(word.to(tl.pointer_type(tl.float32), bitcast=True), mask=mask, other=0.0)
    if SCALE_INLINE:
        p = scale_ptr + offset
        bits = tl.load(p, mask=mask, other=0).to(tl.uint32)
        bits |= tl.load(p + 1, mask=mask, other=0).to(tl.uint32) << 8
        bits |= tl.load(p + 2, mask=mask, other=0).to(tl.uint32) << 16
        bits |= tl.load(p + 3, mask=mask, other=0).to(tl.uint32) << 24
        return bits.to(tl.float32, bitcast=True)
    return tl.load(scale_ptr + offset, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def nvfp4_block_scales(
    aux_ptr,
    page,
    tok,
    head,
    group,
    mask,
    stride_page,
    stride_tok,
    stride_head,
    INTERLEAVE4: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
):
    """fp16 e4m3 block scales times 2^-8 (:func:`fp8_units`) of 16-element ``group`` of
    (``page``, ``tok``) of KV head ``head``, read from the page's scale view at their linear or
    interleave4 place (row ``(t/4)*4 + s/(S/4)``, column ``(s % (S/4))*4 + t%4``). Masked
    scales are 0."""
    if INTERLEAVE4:
        quarter: tl.constexpr = HEAD_SIZE // 64
        srow = (tok // 4) * 4 + group // quarter
        scol = (group % quarter) * 4 + tok % 4
    else:
        srow = tok
        scol = group
    aux = page * stride_page + srow * stride_tok + head * stride_head + scol
    return fp8_units(tl.load(aux_ptr + aux, mask=mask, other=0), False)


@triton.jit
def nvfp4_tile(
    data_ptr,
    aux_ptr,
    page,
    tok,
    head,
    key_mask,
    stride_page,
    stride_tok,
    stride_head,
    aux_stride_page,
    aux_stride_tok,
    aux_stride_head,
    INTERLEAVE4: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """fp16 ``E2M1[q] * sf * 2^-14`` (:data:`NVFP4_UNIT` = 2^14 puts it back), ``[N,
    D_PAD]``, of the NVFP4 rows (``page``, ``tok``: ``[N]``, ``key_mask``) of KV head
    ``head``. Exact: ``E2M1[q] * sf`` is a multiple of 2^-10 with at most 6 significant bits
    and below 2688, so times 2^-14 it is an fp16 (a subnormal below 2^-14, which fp16
    multiplies keep) and again a bf16 / fp32; the kernel puts a whole head into one dot and
    applies ``2^14`` and the global scale afterwards. Masked elements are 0.

    Each byte of the data view is loaded once (contiguous along the row) and split into its
    low (even element) and high nibble; each 4-bit code's bits moved into an fp16's sign,
    exponent and mantissa give ``E2M1 * 2^-14`` in a few integer operations, and one fp16
    multiply by the block scale (an exact fp16 too) gives the tile, two elements per
    instruction."""
    GROUPS: tl.constexpr = D_PAD // 16
    half = tl.arange(0, D_PAD // 2)
    row = page * stride_page + tok * stride_tok + head * stride_head
    mask = key_mask[:, None] & (half[None, :] < HEAD_SIZE // 2)
    byte = tl.load(data_ptr + row[:, None] + half[None, :], mask=mask, other=0).to(tl.int32)
    code = tl.reshape(tl.join(byte & 0xF, byte >> 4), [page.shape[0], D_PAD])
    units = (((code & 8) << 12) | ((code & 7) << 9)).to(tl.uint16).to(tl.float16, bitcast=True)
    group = tl.arange(0, GROUPS)
    scales = nvfp4_block_scales(
        aux_ptr,
        page[:, None],
        tok[:, None],
        head,
        group[None, :],
        key_mask[:, None] & (group[None, :] < HEAD_SIZE // 16),
        aux_stride_page,
        aux_stride_tok,
        aux_stride_head,
        INTERLEAVE4,
        HEAD_SIZE,
    )
    # units are E2M1 * 2^-14 and scales sf * 2^-8 (fp16): 2^8 puts the scales back, exactly.
    scales = scales * 256.0
    tile = tl.reshape(units, [page.shape[0], GROUPS, 16]) * scales[:, :, None]
    return tl.reshape(tile, [page.shape[0], D_PAD])


@triton.jit
def load_kv_tile(
    cache_ptr,
    page,
    tok,
    head,
    dim,
    key_mask,
    dim_mask,
    stride_page,
    stride_tok,
    stride_head,
    FORMAT: tl.constexpr,
    BF16_PAGES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
):
    """Values of one cache side (any format but NVFP4, see :func:`nvfp4_tile`) at
    (``page``, ``tok``) x ``dim`` of KV head ``head``, without their scales (the kernel
    applies them to the scores / the probabilities / the output, not per element), exact, for
    a dot in ``DOT_DTYPE`` (the query's dtype, or fp32): FP8 and per-token-head FP8 as fp16
    units (:func:`fp8_units`, e4m3 times 2^-8); per-token-head INT8 as the integer, in fp16 for
    fp16 dots, else in fp32 (both to be multiplied by the row's :func:`load_row_scale`); bf16
    pages for bf16 dots (never under the interpreter, whose bf16 is wrong) as their bits; the
    rest in fp32.

    ``page`` (int64) / ``tok`` and ``dim`` broadcast against each other (e.g. ``[1, N]`` and
    ``[D, 1]`` for a transposed key tile); ``key_mask`` / ``dim_mask`` have their shapes.
    Strides are in elements of ``cache_ptr`` (bytes for the quantized formats). Masked
    elements are 0. ``ROW_ALIGN``: per-token-head rows (``D + 4`` bytes, so not all 16-byte
    aligned) start on multiples of it; 4 lets the compiler load them 4 bytes at a time.
    """
    mask = key_mask & dim_mask
    row = page * stride_page + tok * stride_tok + head * stride_head
    INT8_ROWS: tl.constexpr = FORMAT == KIND_INT8_PER_TOKEN_HEAD
    PTH_ROWS: tl.constexpr = INT8_ROWS or FORMAT == KIND_FP8_PER_TOKEN_HEAD
    if PTH_ROWS and ROW_ALIGN % 4 == 0:
        row = tl.multiple_of(row, [4, 4])
    if INT8_ROWS and DOT_DTYPE.is_fp16():  # int8 v: fp16 1024 + (v + 128), minus 1152
        byte = tl.load(cache_ptr + row + dim, mask=mask, other=0).to(tl.uint16)
        value = (byte ^ 0x6480).to(tl.float16, bitcast=True) - 1152.0
    elif INT8_ROWS:  # int8 v: fp32 2^23 + (v + 128), minus 2^23 + 128 (exact; exact in bf16)
        byte = tl.load(cache_ptr + row + dim, mask=mask, other=0).to(tl.uint32)
        value = (byte ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
    else:
        raw = tl.load(cache_ptr + row + dim, mask=mask, other=0)
        value = decode_kv_values(raw, FORMAT, BF16_PAGES, DOT_DTYPE)
    return value  # masked loads gave 0 bits: 0 in every format


@triton.jit
def decode_kv_values(raw, FORMAT: tl.constexpr, BF16_PAGES: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Loaded elements of an unquantized or FP8 cache side (per-token-head FP8 too) as
    :func:`load_kv_tile` returns them: FP8 as unscaled fp16 units, bf16 pages for bf16 dots as
    their bits (no widening and rounding back), the rest in fp32."""
    if FORMAT != KIND_UNQUANTIZED:
        value = fp8_units(raw, FORMAT == KIND_FP8_E5M2)
    elif BF16_PAGES and DOT_DTYPE.is_bf16():
        value = raw.to(tl.bfloat16, bitcast=True)
    elif BF16_PAGES:
        value = from_bits(source_to_f32_bits(raw, 2))  # 2: SRC_BF16
    else:
        value = raw.to(tl.float32)
    return value
