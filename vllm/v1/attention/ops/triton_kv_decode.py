"""Triton decoders of the paged KV-cache formats (``@triton.jit`` helpers, no kernels).

:func:`load_kv_tile` reads a tile of one cache side straight from its pages and returns fp32
values equal, bit for bit, to the reference codecs of :mod:`vllm.kv_quant`:

* unquantized fp16 / fp32: loaded and widened; bf16: read as int16 bits, shifted into the high
  half of an fp32 (exact, and right under Triton's interpreter, whose bf16 is wrong);
* FP8 e4m3 / e5m2 (per-tensor or per-head scale): :func:`fp8_units`, the bytes' bits moved
  into exact fp16 (e4m3 times 2^-8) that go into the dots as they are; the kernel multiplies the
  scores by ``k_scale * 2^8`` and the output by ``v_scale * 2^8`` (with a softmax weight of 1:
  ``fp32(q) * scale`` rounded once, as ``dequantize_fp8``);
* per-token-head INT8 / FP8: the row's bytes times its fp32 scale, read from 4 inline
  little-endian bytes after the row (this library's layout) or from a separate fp32 scale cache
  (upstream's ``k_scale_cache``);
* NVFP4 is not decoded element by element into fp32 (a dozen operations per element would
  make the read compute-bound): :func:`nvfp4_units` gives each code's ``E2M1[q] * 2^-14`` as an
  exact fp16 in a few integer operations, :func:`nvfp4_block_scales` the e4m3 block scales, and
  the attention kernel applies the scales per 16-element group around its dots: for keys,
  ``s = sum_g sf_g * (q_g . E_g)`` (a batched dot per group), for values ``P (sf_g) @ E_g``, the
  global scale and 2^14 once per tile / at the end. With a softmax weight of 1 the output is
  ``(E2M1[q] * sf) * gs`` rounded once, as ``dequantize_nvfp4``.
"""

from __future__ import annotations

from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_kv_encode import (
    e4m3_to_f32,
    from_bits,
    source_to_f32_bits,
)

# Cache formats as the kernels see them (constexpr values).
FMT_FLOAT = 0  # fp16 / fp32 pages, read in their own dtype
FMT_BF16 = 1  # bf16 pages, read as int16 bits
FMT_FP8_E4M3 = 2
FMT_FP8_E5M2 = 3
FMT_INT8_PER_TOKEN_HEAD = 4
FMT_FP8_PER_TOKEN_HEAD = 5
FMT_NVFP4 = 6


@triton.jit
def fp8_units(byte, E5M2: tl.constexpr):
    """Exact fp16 of FP8 bytes in two or three integer operations, no fp8 type (sm_80 has
    none): an e5m2 byte is the high byte of an fp16 (its value); e4m3's sign, exponent and
    mantissa bits moved into an fp16 give its value times 2^-8 (the kernel puts the 2^8 back
    with the scale, once), its NaN bytes 0x7F / 0xFF NaN."""
    b = byte.to(tl.int32)
    if E5M2:
        return (b << 8).to(tl.uint16).to(tl.float16, bitcast=True)
    magnitude = b & 0x7F
    units = (((b & 0x80) << 8) | (magnitude << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    return tl.where(magnitude == 0x7F, float("nan"), units)


@triton.jit
def load_row_scale(scale_ptr, offset, mask, SCALE_INLINE: tl.constexpr):
    """Per-token-head scales: fp32 from 4 little-endian bytes at ``scale_ptr + offset``
    (``SCALE_INLINE``) or an fp32 load from a scale cache."""
    if SCALE_INLINE:
        p = scale_ptr + offset
        bits = tl.load(p, mask=mask, other=0).to(tl.uint32)
        bits |= tl.load(p + 1, mask=mask, other=0).to(tl.uint32) << 8
        bits |= tl.load(p + 2, mask=mask, other=0).to(tl.uint32) << 16
        bits |= tl.load(p + 3, mask=mask, other=0).to(tl.uint32) << 24
        return bits.to(tl.float32, bitcast=True)
    return tl.load(scale_ptr + offset, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def nvfp4_units(cache_ptr, page, tok, head, dim, mask, stride_page, stride_tok, stride_head):
    """fp16 ``E2M1[q] * 2^-14`` (exact) of NVFP4 elements ``dim`` of (``page``, ``tok``) of KV
    head ``head``: byte ``dim / 2`` of the data view (low nibble first), its 4-bit code moved
    into an fp16's sign, exponent and mantissa bits (a few integer operations per element; the
    2^14 is put back after the dot). Masked elements are 0."""
    row = page * stride_page + tok * stride_tok + head * stride_head
    byte = tl.load(cache_ptr + row + dim // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((dim & 1) * 4)) & 0xF
    return (((code & 8) << 12) | ((code & 7) << 9)).to(tl.uint16).to(tl.float16, bitcast=True)


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
    """fp32 e4m3 block scales of 16-element ``group`` of (``page``, ``tok``) of KV head ``head``,
    read from the page's scale view at their linear or interleave4 place (row
    ``(t/4)*4 + s/(S/4)``, column ``(s % (S/4))*4 + t%4``). Masked scales are 0."""
    if INTERLEAVE4:
        quarter: tl.constexpr = HEAD_SIZE // 64
        srow = (tok // 4) * 4 + group // quarter
        scol = (group % quarter) * 4 + tok % 4
    else:
        srow = tok
        scol = group
    aux = page * stride_page + srow * stride_tok + head * stride_head + scol
    return e4m3_to_f32(tl.load(aux_ptr + aux, mask=mask, other=0).to(tl.uint32))


@triton.jit
def load_kv_tile(
    cache_ptr,
    aux_ptr,
    page,
    tok,
    head,
    dim,
    key_mask,
    dim_mask,
    stride_page,
    stride_tok,
    stride_head,
    aux_stride_page,
    aux_stride_tok,
    aux_stride_head,
    FORMAT: tl.constexpr,
    SCALE_INLINE: tl.constexpr,
):
    """Values of one cache side (any format but NVFP4, see :func:`nvfp4_units`) at
    (``page``, ``tok``) x ``dim`` of KV head ``head``: fp32, except FP8's :func:`fp8_units`
    (fp16, the per-tensor / per-head scale not applied: the kernel applies it to the scores and
    the output, once).

    ``page`` (int64) / ``tok`` and ``dim`` broadcast against each other (e.g. ``[1, N]`` and
    ``[D, 1]`` for a transposed key tile); ``key_mask`` / ``dim_mask`` have their shapes.
    Strides are in elements of ``cache_ptr`` (bytes for the quantized formats). ``aux_ptr`` /
    ``aux_stride_*``: the per-token-head scales (inline bytes or a scale cache). Masked
    elements are 0.
    """
    mask = key_mask & dim_mask
    row = page * stride_page + tok * stride_tok + head * stride_head
    if FORMAT == 4 or FORMAT == 5:  # per-token-head rows
        byte = tl.load(cache_ptr + row + dim, mask=mask, other=0).to(tl.int32)
        # FORMAT 4: the uint8 bits of an int8 value; 5: e4m3.
        q = ((byte ^ 128) - 128).to(tl.float32) if FORMAT == 4 else e4m3_to_f32(byte.to(tl.uint32))
        aux = page * aux_stride_page + tok * aux_stride_tok + head * aux_stride_head
        value = q * load_row_scale(aux_ptr, aux, key_mask, SCALE_INLINE)
    elif FORMAT == 2 or FORMAT == 3:  # FP8: unscaled fp16 units (see fp8_units)
        value = fp8_units(tl.load(cache_ptr + row + dim, mask=mask, other=0), FORMAT == 3)
    elif FORMAT == 1:
        bits = tl.load(cache_ptr + row + dim, mask=mask, other=0)
        value = from_bits(source_to_f32_bits(bits, 2))  # 2: SRC_BF16
    else:
        value = tl.load(cache_ptr + row + dim, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, value, 0.0)
