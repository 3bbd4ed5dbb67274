"""The Triton KV-cache writer under upstream vLLM's import path and names
(``vllm.v1.attention.ops.triton_reshape_and_cache_flash``).

:func:`triton_reshape_and_cache_flash` writes every format the compiled op
``torch.ops._C_cache_ops.reshape_and_cache_flash`` writes, to the same bytes: unquantized caches
(fp32 / fp16 / bf16, K/V of any float dtype rounded to the cache dtype), FP8 e4m3 / e5m2 with
per-tensor or per-head scales, per-token-head INT8 / FP8 rows with their inline fp32 scale
(INT4 ones through upstream's ``reshape_and_cache_int4``), NVFP4 (``nvfp4``, ``nvfp4_mse``,
``nvfp4_4over6``) with linear or interleave4 block-scale layouts; NHD and HND pages; in the same
program as a token's K rows, the optional key sink rows (e4m3 copies of the first S keys of each
page). Arguments go through the compiled op's checks first (a zero-token call, nothing written).
Upstream's :func:`triton_reshape_and_cache_flash_per_token_head_quant` (separate fp32 scale
caches) and :func:`triton_reshape_and_cache_flash_diffkv` (K and V in one row) share the kernel.

One program writes the K rows, then the V rows, of up to :func:`heads_per_program` heads of one
token (a ``[heads, D]`` tile per side: wide accesses, few programs). The encoders
(:mod:`.triton_kv_encode`) are integer-exact, so the bytes are the reference codecs' under
Triton's interpreter (CPU tensors, no GPU) and on a GPU alike.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import torch

from vllm.kv_quant.formats import (
    NVFP4_GROUP_SIZE,
    CacheKind,
    KVCacheFormat,
    KVQuantMode,
    format_of_kind,
    lookup,
)
from vllm.kv_quant.int4_per_token_head import int4_scale_words
from vllm.kv_quant.kv_scale import kv_scale_as_1d
from vllm.kv_quant.per_token_head import PER_TOKEN_HEAD_SCALE_FLOOR, per_token_head_qmax
from vllm.kv_quant.scale_layout import ScaleLayout
from vllm.triton_utils import HAS_TRITON, row_alignment, tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2
from vllm.v1.attention.ops.int4_per_token_head import reshape_and_cache_int4
from vllm.v1.attention.ops.triton_kv_encode import (
    SRC_BF16,
    SRC_FP16,
    SRC_FP32,
    search_policy,
    write_fp8_rows,
    write_nvfp4_groups,
    write_per_token_head_rows,
    write_plain_rows,
)
from vllm.v1.attention.ops.triton_writer_checks import (
    check,
    check_paged,
    check_slot_mapping,
    check_sources,
    dtype_name,
)

__all__ = [
    "WriterLaunch",
    "plan_per_token_head_quant",
    "plan_reshape_and_cache_flash",
    "triton_reshape_and_cache_flash",
    "triton_reshape_and_cache_flash_diffkv",
    "triton_reshape_and_cache_flash_per_token_head_quant",
]

# What a side's kernel writes (constexpr KIND): the registry's row encoding, by name.
KIND_PLAIN = tl.constexpr(CacheKind.UNQUANTIZED.value)
KIND_FP8_E4M3 = tl.constexpr(CacheKind.FP8_E4M3.value)
KIND_FP8_E5M2 = tl.constexpr(CacheKind.FP8_E5M2.value)
KIND_NVFP4 = tl.constexpr(CacheKind.NVFP4.value)
KIND_INT8_PTH = tl.constexpr(CacheKind.INT8_PER_TOKEN_HEAD.value)
KIND_FP8_PTH = tl.constexpr(CacheKind.FP8_PER_TOKEN_HEAD.value)


WRITER_TILE_ELEMENTS = 1024
"""Most padded row elements of one cache side a writer program stores: 8 per thread at 4 warps,
so a bf16 row tile moves in 16-byte accesses (a program per (token, head) moved 2 bytes per
thread)."""


def heads_per_program(num_heads: int, row_elements: int) -> int:
    """Heads of one token a writer program writes: all of them (a power of two covering
    ``num_heads``) up to :data:`WRITER_TILE_ELEMENTS` padded elements of ``row_elements``."""
    fit = max(1, WRITER_TILE_ELEMENTS // row_elements)
    return min(next_power_of_2(num_heads), 1 << (fit.bit_length() - 1))


def writer_num_warps(tile_elements: int) -> int:
    """Warps of a writer program storing ``tile_elements`` padded elements per side: 8 elements
    per thread, 1 to 8 warps."""
    return max(1, min(8, tile_elements // 256))


@triton.jit
def _write_side(src_ptr, src_off, dst_ptr, block, tok, head0, num_heads, block_stride,
                token_stride, head_stride, scale_ptr, aux_block_stride, aux_token_stride,
                aux_head_stride, scale_region_off, D: tl.constexpr, D_PAD: tl.constexpr,
                HEADS: tl.constexpr, KIND: tl.constexpr, SRC: tl.constexpr, DST: tl.constexpr,
                SCALE_PER_HEAD: tl.constexpr, INTERLEAVE4: tl.constexpr, SEARCH: tl.constexpr,
                QMAX: tl.constexpr, FLOOR: tl.constexpr, SCALE_INLINE: tl.constexpr,
                ROW_ALIGN: tl.constexpr):  # fmt: skip
    """Rows of heads ``head0 .. head0 + HEADS - 1`` (those < ``num_heads``) of one token of one
    cache side; ``src_off`` is the token's first source element (its ``[H, D]`` is dense).
    Strides are in cache elements; NVFP4's token and head strides count entries (rows of D/2
    data or D/16 scale bytes), and its ``D_PAD`` pads the D/16 groups."""
    if KIND == KIND_NVFP4:
        G: tl.constexpr = D // 16
        QUARTER: tl.constexpr = G // 4
        r = tl.arange(0, HEADS * D_PAD)  # one row per 16-element group
        head = head0 + r // D_PAD
        g = r % D_PAD
        ok = (head < num_heads) & (g < G)
        scale = tl.load(scale_ptr + (head if SCALE_PER_HEAD else head * 0), mask=ok, other=1.0)
        page = block * block_stride
        data_off = page + (tok * token_stride + head * head_stride) * (D // 2) + g * 8
        scale_plane = page + scale_region_off
        if INTERLEAVE4:
            # Row (t // 4) * 4 + g // QUARTER, column (g % QUARTER) * 4 + t % 4 of the [N, S]
            # plane of the head.
            srow = (tok // 4) * 4 + g // QUARTER
            scale_off = (srow * token_stride + head * head_stride) * G + (g % QUARTER) * 4 + tok % 4
        else:
            scale_off = (tok * token_stride + head * head_stride) * G + g
        write_nvfp4_groups(src_ptr, src_off + head * D + g * 16, dst_ptr, data_off,
                           scale_plane + scale_off, ok, scale, SRC, SEARCH)  # fmt: skip
    else:
        head = head0 + tl.arange(0, HEADS)
        ok = head < num_heads
        rows = src_off + head * D
        entry = block * block_stride + tok * token_stride + head * head_stride
        if KIND == KIND_PLAIN:
            write_plain_rows(src_ptr, rows, dst_ptr, entry, ok, D, D_PAD, SRC, DST)
        elif KIND == KIND_FP8_E4M3 or KIND == KIND_FP8_E5M2:  # noqa: SIM109 (Triton: no `in`)
            scale = tl.load(scale_ptr + (head if SCALE_PER_HEAD else head * 0), mask=ok, other=1.0)
            write_fp8_rows(src_ptr, rows, dst_ptr, entry, ok, scale, D, D_PAD, SRC,
                           KIND == KIND_FP8_E5M2)  # fmt: skip
        else:
            aux = block * aux_block_stride + tok * aux_token_stride + head * aux_head_stride
            write_per_token_head_rows(src_ptr, rows, dst_ptr, entry, ok, scale_ptr, aux, D, D_PAD,
                                      SRC, KIND == KIND_FP8_PTH, QMAX, FLOOR, SCALE_INLINE,
                                      ROW_ALIGN)  # fmt: skip


@triton.jit
def reshape_and_cache_flash_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr,
    slot_mapping_ptr, key_stride, value_stride,
    k_block_stride, k_token_stride, k_head_stride,
    v_block_stride, v_token_stride, v_head_stride,
    ks_block_stride, ks_token_stride, ks_head_stride,
    vs_block_stride, vs_token_stride, vs_head_stride,
    k_scale_region_off, v_scale_region_off, block_size, num_slots, num_heads,
    sinks_ptr, sink_scale_ptr, sink_block_stride, sink_token_stride, sink_head_stride, sink_rows,
    D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, PAD_V: tl.constexpr,
    HEADS: tl.constexpr, KIND: tl.constexpr, SRC: tl.constexpr, DST: tl.constexpr,
    K_PER_HEAD: tl.constexpr, V_PER_HEAD: tl.constexpr,
    K_INTERLEAVE4: tl.constexpr, V_INTERLEAVE4: tl.constexpr, SEARCH: tl.constexpr,
    QMAX: tl.constexpr, FLOOR: tl.constexpr, SCALE_INLINE: tl.constexpr, ROW_ALIGN: tl.constexpr,
    SINKS: tl.constexpr, SINK_PER_HEAD: tl.constexpr, PAD_SINK: tl.constexpr,
):  # fmt: skip
    """Grid (num_tokens, cdiv(num_heads, HEADS)): writes K then V of ``HEADS`` heads of one
    token. Slots < 0 (padding) and >= num_slots are skipped. PAD_*: next power of 2 of the row
    (NVFP4: of D / 16 groups). ``k_scale_ptr`` / ``v_scale_ptr``: the fp32 dequantization scale
    ([1] or [H]) of FP8 / NVFP4, or an int32 view of a per-token-head scale cache (strides
    ``ks_*`` / ``vs_*``). SINKS: a token at page row ``< sink_rows`` also gets its key's e4m3
    sink rows (byte strides ``sink_*``, fp32 scale ``sink_scale_ptr``, [1] or [H])."""
    tok_idx = tl.program_id(0).to(tl.int64)  # source offsets may pass 2^31 elements
    head0 = tl.program_id(1) * HEADS
    slot = tl.load(slot_mapping_ptr + tok_idx).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // block_size
    tok = slot % block_size
    _write_side(key_ptr, tok_idx * key_stride, key_cache_ptr, block, tok, head0, num_heads,
                k_block_stride, k_token_stride, k_head_stride, k_scale_ptr, ks_block_stride,
                ks_token_stride, ks_head_stride, k_scale_region_off, D_K, PAD_K, HEADS, KIND, SRC,
                DST, K_PER_HEAD, K_INTERLEAVE4, SEARCH, QMAX, FLOOR, SCALE_INLINE,
                ROW_ALIGN)  # fmt: skip
    if SINKS:  # noqa: SIM102 - a constexpr: kernels without sinks hold none of this
        if tok < sink_rows:
            head = head0 + tl.arange(0, HEADS)
            ok = head < num_heads
            scale = tl.load(sink_scale_ptr + (head if SINK_PER_HEAD else head * 0), mask=ok,
                            other=1.0)  # fmt: skip
            sink = block * sink_block_stride + tok * sink_token_stride + head * sink_head_stride
            write_fp8_rows(key_ptr, tok_idx * key_stride + head * D_K, sinks_ptr, sink, ok, scale,
                           D_K, PAD_SINK, SRC, False)  # fmt: skip
    _write_side(value_ptr, tok_idx * value_stride, value_cache_ptr, block, tok, head0, num_heads,
                v_block_stride, v_token_stride, v_head_stride, v_scale_ptr, vs_block_stride,
                vs_token_stride, vs_head_stride, v_scale_region_off, D_V, PAD_V, HEADS, KIND, SRC,
                DST, V_PER_HEAD, V_INTERLEAVE4, SEARCH, QMAX, FLOOR, SCALE_INLINE,
                ROW_ALIGN)  # fmt: skip


# Element dtype -> (SRC / DST code, the integer dtype the kernel reads and writes its bits as).
_BITS_VIEW: dict[torch.dtype, tuple[int, torch.dtype]] = {
    torch.float32: (SRC_FP32, torch.int32),
    torch.float16: (SRC_FP16, torch.int16),
    torch.bfloat16: (SRC_BF16, torch.int16),
}


def _kind_of(fmt: KVCacheFormat) -> int:
    """The kernel's ``KIND``: the format's row encoding."""
    assert fmt.cache_kind is not None
    return fmt.cache_kind.value


def _ops() -> ModuleType:
    """The compiled ops, imported on the first call rather than with this module, so that the
    AOT compile check (tools/compile_triton_kernels.py) imports the kernels without the built
    extension."""
    from vllm import _custom_ops

    return _custom_ops


def _page_strides(cache: torch.Tensor, last_dim: int) -> tuple[int, int, int]:
    """(block, token, head) strides of a cache side whose pages are dense in NHD or HND order,
    size-1 dims given the canonical stride of the detected order (csrc make_side)."""
    num_blocks, block_size, heads, _ = cache.shape
    nhd = (block_size <= 1 or cache.stride(1) == heads * last_dim) and (
        heads <= 1 or cache.stride(2) == last_dim
    )
    block = block_size * heads * last_dim if num_blocks <= 1 else cache.stride(0)
    if nhd:
        return block, heads * last_dim, last_dim
    return block, last_dim, block_size * last_dim


class WriterLaunch(NamedTuple):
    """One launch of :func:`reshape_and_cache_flash_kernel`, every argument prepared: calling it
    writes (nothing for an empty grid). The compile cases are built from such launches
    (:mod:`.triton_reshape_and_cache_flash_cases`)."""

    grid: tuple[int, int]
    args: tuple[torch.Tensor | int, ...]
    """The kernel's runtime arguments, in order: tensors for pointers, ints."""
    constexprs: dict[str, Any]
    num_warps: int

    def __call__(self) -> None:
        check(HAS_TRITON, "triton: expected Triton installed (pip install triton), got none")
        if self.grid[0] == 0:
            return
        reshape_and_cache_flash_kernel[self.grid](
            *self.args, **self.constexprs, num_warps=self.num_warps, enable_fp_fusion=False
        )


def _plan(
    key: torch.Tensor,
    value: torch.Tensor,
    sides: tuple[torch.Tensor, torch.Tensor],
    strides: tuple[tuple[int, int, int], tuple[int, int, int]],
    scales: tuple[torch.Tensor, torch.Tensor],
    scale_strides: tuple[tuple[int, int, int], tuple[int, int, int]],
    slot_mapping: torch.Tensor,
    num_slots: int,
    block_size: int,
    *,
    kind: int,
    dst: int = SRC_FP32,
    per_head: tuple[bool, bool] = (False, False),
    interleave4: tuple[bool, bool] = (False, False),
    search: int = 0,
    qmax: float = 1.0,
    scale_inline: bool = True,
    sinks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> WriterLaunch:
    """The writer's launch over (tokens, head blocks); an empty grid for empty input. ``sides``
    are the K / V cache tensors already viewed as the dtype the kernel stores (int bits or
    uint8); ``sinks``: the key sink rows and their scale, if any."""
    num_tokens = slot_mapping.shape[0]
    heads, d_k, d_v = key.shape[1], key.shape[2], value.shape[2]
    src, bits_dtype = _BITS_VIEW[key.dtype]
    nvfp4 = kind == CacheKind.NVFP4
    pads = [next_power_of_2(d // NVFP4_GROUP_SIZE if nvfp4 else d) for d in (d_k, d_v)]
    row_elements = max(pads) * (NVFP4_GROUP_SIZE if nvfp4 else 1)
    per_program = heads_per_program(heads, row_elements)
    region = [block_size * heads * (d // 2) if nvfp4 else 0 for d in (d_k, d_v)]
    row_align = 1  # read by the per-token-head rows alone (a constexpr: one compile for others)
    if kind in (CacheKind.INT8_PER_TOKEN_HEAD, CacheKind.FP8_PER_TOKEN_HEAD):
        row_align = row_alignment(sides[0].data_ptr(), sides[1].data_ptr(), *strides[0],
                                  *strides[1], d_k, d_v)  # fmt: skip
    empty = num_tokens == 0 or heads == 0 or d_k == 0 or d_v == 0
    grid = (0 if empty else num_tokens, cdiv(heads, per_program))
    sink_args = (sides[0], scales[0], 0, 0, 0, 0)  # unread without sinks
    if sinks is not None:
        sink_args = (sinks[0], sinks[1].reshape(-1), *sinks[0].stride()[:3], sinks[0].shape[1])
    args = (
        key.view(bits_dtype), value.view(bits_dtype), sides[0], sides[1], scales[0], scales[1],
        slot_mapping, key.stride(0), value.stride(0), *strides[0], *strides[1],
        *scale_strides[0], *scale_strides[1], region[0], region[1], block_size, num_slots, heads,
        *sink_args,
    )  # fmt: skip
    constexprs = dict(
        D_K=d_k, D_V=d_v, PAD_K=pads[0], PAD_V=pads[1], HEADS=per_program, KIND=kind, SRC=src,
        DST=dst, K_PER_HEAD=per_head[0], V_PER_HEAD=per_head[1], K_INTERLEAVE4=interleave4[0],
        V_INTERLEAVE4=interleave4[1], SEARCH=search, QMAX=qmax,
        FLOOR=PER_TOKEN_HEAD_SCALE_FLOOR, SCALE_INLINE=scale_inline, ROW_ALIGN=row_align,
        SINKS=sinks is not None, SINK_PER_HEAD=sinks is not None and sinks[1].numel() > 1,
        PAD_SINK=next_power_of_2(d_k),
    )  # fmt: skip
    return WriterLaunch(grid, args, constexprs, writer_num_warps(per_program * row_elements))


def triton_reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_scale_layout: ScaleLayout | str | None = None,
    v_scale_layout: ScaleLayout | str | None = None,
    key_sinks: torch.Tensor | None = None,
    key_sink_scale: torch.Tensor | None = None,
) -> None:
    """:func:`vllm._custom_ops.reshape_and_cache_flash` in Triton, same arguments and bytes.

    ``key [T_pad, H, D]`` / ``value [T_pad, H, Dv]`` token ``i < T`` goes to slot
    ``slot_mapping[i]`` (< 0: skipped) of the paged caches (logical ``[B, N, H, D']``, NHD or
    HND), quantized for ``kv_cache_dtype``. ``k_scale`` / ``v_scale``: fp32 dequantization
    scales, one value (0-d, [1]) or [H]; NVFP4 block-scale layouts as the op's (``None``: the
    default for the geometry; V follows a named K). ``key_sinks`` (uint8 ``[B, S, H, D]``) with
    ``key_sink_scale``: a token at page row ``t < S`` also gets ``key_sinks[page, t] =
    e4m3(key / key_sink_scale)``, whatever the format."""
    if isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 1:
        # The compiled op's checks (shapes, strides, dtypes, scales, layouts, overlap, key
        # sinks), with its messages: a zero-token call validates and writes nothing.
        _ops().reshape_and_cache_flash(
            key, value, key_cache, value_cache, slot_mapping[:0], kv_cache_dtype, k_scale,
            v_scale, k_scale_layout, v_scale_layout, key_sinks, key_sink_scale,
        )  # fmt: skip
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    check_slot_mapping(slot_mapping, key.shape[0], num_blocks * block_size)
    if lookup(kv_cache_dtype).cache_kind is CacheKind.INT4_PER_TOKEN_HEAD:
        # Rotated rows: upstream's own kernel (the codec's bytes too).
        return reshape_and_cache_int4(
            key, value, key_cache, value_cache, slot_mapping,
            k_scale_cache=int4_scale_words(key_cache, key.shape[2]),
            v_scale_cache=int4_scale_words(value_cache, value.shape[2]),
        )  # fmt: skip
    plan_reshape_and_cache_flash(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
        k_scale_layout, v_scale_layout, key_sinks, key_sink_scale,
    )()  # fmt: skip


def plan_reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_scale_layout: ScaleLayout | str | None = None,
    v_scale_layout: ScaleLayout | str | None = None,
    key_sinks: torch.Tensor | None = None,
    key_sink_scale: torch.Tensor | None = None,
) -> WriterLaunch:
    """The launch of :func:`triton_reshape_and_cache_flash` for arguments it has checked
    (nothing runs until the result is called)."""
    sinks = None if key_sinks is None else (key_sinks, key_sink_scale)
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    fmt = lookup(kv_cache_dtype)
    kind = _kind_of(fmt)
    d_k, d_v = key.shape[2], value.shape[2]
    last = (fmt.last_dim(d_k), fmt.last_dim(d_v)) if fmt.is_quantized else (d_k, d_v)
    caches = (key_cache, value_cache)
    strides = tuple(_page_strides(c, f) for c, f in zip(caches, last, strict=True))
    no_aux = ((0, 0, 0), (0, 0, 0))
    if kind == CacheKind.UNQUANTIZED:
        dst, bits = _BITS_VIEW[key_cache.dtype]
        sides = (key_cache.view(bits), value_cache.view(bits))
        return _plan(key, value, sides, strides, (k_scale, v_scale), no_aux, slot_mapping,
                     num_blocks * block_size, block_size, kind=kind, dst=dst,
                     sinks=sinks)  # fmt: skip
    sides = (key_cache.view(torch.uint8), value_cache.view(torch.uint8))
    if fmt.is_per_token_head:
        return _plan(key, value, sides, strides, sides, no_aux, slot_mapping,
                     num_blocks * block_size, block_size, kind=kind,
                     qmax=per_token_head_qmax(fmt), sinks=sinks)  # fmt: skip
    per_head = (k_scale.numel() > 1, v_scale.numel() > 1)
    interleave4 = (False, False)
    if kind == CacheKind.NVFP4:
        k_layout = ScaleLayout.resolve(k_scale_layout, block_size, d_k)
        if v_scale_layout is not None:
            v_layout = ScaleLayout.parse(v_scale_layout)
        else:
            v_layout = (
                k_layout if k_scale_layout is not None else ScaleLayout.default_for(block_size, d_v)
            )
        interleave4 = (k_layout == ScaleLayout.INTERLEAVE4, v_layout == ScaleLayout.INTERLEAVE4)
        # NVFP4 token / head strides count entries of the page's data and scale regions.
        strides = tuple((b, t // f, h // f) for (b, t, h), f in zip(strides, last, strict=True))
    return _plan(key, value, sides, strides, (k_scale.reshape(-1), v_scale.reshape(-1)),
                 no_aux, slot_mapping, num_blocks * block_size, block_size, kind=kind,
                 per_head=per_head, interleave4=interleave4, search=search_policy(fmt.scale_search),
                 sinks=sinks)  # fmt: skip


def triton_reshape_and_cache_flash_per_token_head_quant(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_quant_mode: KVQuantMode | None = None,
) -> None:
    """Upstream's per-token-head writer: ``key [T_pad, H, D]`` / ``value [T_pad, H, Dv]`` token
    ``i`` quantized per (token, head) into slot ``slot_mapping[i]`` (< 0: skipped) of
    ``key_cache [B, N, H, D]`` / ``value_cache [B, N, H, Dv]`` (int8, or float8_e4m3fn / uint8
    e4m3 bytes), the fp32 scales into ``k_scale_cache`` / ``v_scale_cache [B, N, H]``. Bytes and
    scales are those of the ``int8_per_token_head`` / ``fp8_per_token_head`` codec
    (:mod:`vllm.kv_quant.per_token_head`); any strides. ``kv_quant_mode`` (``None``: by the
    cache dtype) ``INT4_PER_TOKEN_HEAD`` goes to ``reshape_and_cache_int4``."""
    if kv_quant_mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        scales = dict(k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache)
        return reshape_and_cache_int4(key, value, key_cache, value_cache, slot_mapping, **scales)
    key, value = check_sources(key, value)
    fp8 = key_cache.dtype in (torch.float8_e4m3fn, torch.uint8)
    check(
        fp8 or key_cache.dtype == torch.int8,
        "key_cache: expected dtype int8 or float8_e4m3fn (uint8: e4m3 bytes), "
        f"got {dtype_name(key_cache.dtype)}",
    )
    check(
        value_cache.dtype == key_cache.dtype,
        f"value_cache: expected dtype {dtype_name(key_cache.dtype)} (key_cache's), "
        f"got {dtype_name(value_cache.dtype)}",
    )
    check(key_cache.dim() == 4, f"key_cache: expected a 4-D tensor, got {list(key_cache.shape)}")
    lead = [key_cache.shape[0], key_cache.shape[1], key.shape[1]]
    check_paged(key_cache, "key_cache", lead, key.shape[2])
    check_paged(value_cache, "value_cache", lead, value.shape[2])
    for name, sc in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        check(
            sc.dtype == torch.float32 and list(sc.shape) == lead,
            f"{name}: expected a float32 tensor {lead}, got {dtype_name(sc.dtype)} of shape "
            f"{list(sc.shape)}",
        )
    check_slot_mapping(slot_mapping, key.shape[0], lead[0] * lead[1])
    plan_per_token_head_quant(
        key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping
    )()


def plan_per_token_head_quant(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> WriterLaunch:
    """The launch of :func:`triton_reshape_and_cache_flash_per_token_head_quant` for arguments
    it has checked (nothing runs until the result is called)."""
    fp8 = key_cache.dtype in (torch.float8_e4m3fn, torch.uint8)
    fmt = format_of_kind(CacheKind.FP8_PER_TOKEN_HEAD if fp8 else CacheKind.INT8_PER_TOKEN_HEAD)
    sides = (key_cache.view(torch.uint8), value_cache.view(torch.uint8))
    scales = (k_scale_cache.view(torch.int32), v_scale_cache.view(torch.int32))
    return _plan(key, value, sides, tuple(tuple(c.stride()[:3]) for c in sides), scales,
                 tuple(tuple(s.stride()) for s in scales), slot_mapping,
                 key_cache.shape[0] * key_cache.shape[1], key_cache.shape[1], kind=_kind_of(fmt),
                 qmax=per_token_head_qmax(fmt), scale_inline=False)  # fmt: skip


def triton_reshape_and_cache_flash_diffkv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Upstream's writer for K and V of different head sizes in one row: ``key [T_pad, H, Dk]``
    and ``value [T_pad, H, Dv]`` into ``kv_cache [B, N, H, Dk + Dv]`` (K first), unquantized
    (rounded to the cache dtype) or FP8 (``x / scale``, per-tensor or per-head scales); any page
    strides with a contiguous last dim."""
    key, value = check_sources(key, value)
    fmt = lookup(kv_cache_dtype)
    check(
        fmt.quant_mode in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR) and not fmt.mla_only,
        "kv_cache_dtype: expected an unquantized or FP8 format for rows holding K and V, "
        f"got {kv_cache_dtype!r}",
    )
    floats = "float32, float16 or bfloat16"
    wanted = floats if fmt.is_auto else dtype_name(fmt.resolve_storage_dtype(kv_cache.dtype))
    check(
        kv_cache.dtype in _BITS_VIEW if fmt.is_auto else kv_cache.dtype == fmt.storage_dtype,
        f"kv_cache: expected dtype {wanted} for kv_cache_dtype '{kv_cache_dtype}', "
        f"got {dtype_name(kv_cache.dtype)}",
    )
    heads, d_k, d_v = key.shape[1], key.shape[2], value.shape[2]
    check(
        list(value.shape[:2]) == list(key.shape[:2]),
        f"value: expected [T_pad, H] = {list(key.shape[:2])} (key's), got {list(value.shape)}",
    )
    check(kv_cache.dim() == 4, f"kv_cache: expected a 4-D tensor, got {list(kv_cache.shape)}")
    lead = [kv_cache.shape[0], kv_cache.shape[1], heads]
    check_paged(kv_cache, "kv_cache", lead, d_k + d_v)
    k_scale = kv_scale_as_1d(k_scale, "k_scale", heads)
    v_scale = kv_scale_as_1d(v_scale, "v_scale", heads)
    num_slots = lead[0] * lead[1]
    check_slot_mapping(slot_mapping, key.shape[0], num_slots)
    kind = _kind_of(fmt)
    dst, bits = (
        _BITS_VIEW[kv_cache.dtype] if kind == CacheKind.UNQUANTIZED else (SRC_FP32, torch.uint8)
    )
    view = kv_cache.view(bits)
    stride = tuple(view.stride()[:3])
    _plan(key, value, (view[..., :d_k], view[..., d_k:]), (stride, stride), (k_scale, v_scale),
          ((0, 0, 0), (0, 0, 0)), slot_mapping, num_slots, lead[1], kind=kind, dst=dst,
          per_head=(k_scale.numel() > 1, v_scale.numel() > 1))()  # fmt: skip
