"""Fused Triton paged attention over packed KV caches (TurboQuant slots, ``int4_per_token_head``
sides): each key / value tile is decoded from the pages inside the attention kernel
(:mod:`~vllm.v1.attention.ops.triton_packed_kv_tiles`), so no decoded copy of the pages is
written or read back. Readers: :func:`~.triton_turboquant_decode.triton_turboquant_decode_attention`
and :func:`~.int4_per_token_head.int4_paged_attention`.

The program layout is :func:`~.triton_paged_attention.paged_attention_kernel`'s: one program
attends ``BLOCK_Q`` query tokens x the query heads of one KV head (``BLOCK_M`` rows) over one
split of the key range in tiles of ``TILE_N`` keys, fp32 online softmax; a split-K launch
(``IS_3D``) writes the segments :func:`~.triton_attention_reduce.reduce_segments` combines.
Both formats keep their keys in a rotated frame: the caller rotates the query once (for an
orthonormal ``H``, ``q . (k H) = (q Hᵀ) . k``) and, where the values are rotated too (INT4),
the output back once. Each key's scale (TurboQuant norm / length, INT4 row scale, FP8's 2^8)
multiplies its scores, once per key.

Bytes read per (token, KV head) by a decode: the packed row(s) only (TurboQuant ``slot_size``;
INT4 ``D/2 + 4`` per side); the previous readers also wrote and re-read ``2 * 4 * D`` bytes per
side of decoded fp32 pages (module docstrings of the readers have the numbers).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from vllm.kv_quant.turboquant.config import TurboQuantConfig
from vllm.triton_utils import tl, triton, triton_interpreted
from vllm.triton_utils.aot import TritonCompileCase, case_from_launch
from vllm.v1.attention.ops.triton_attention_helpers import (
    apply_softcap,
    cdiv_fn,
    position_bias,
    query_tile_rows,
    softmax_step,
)
from vllm.v1.attention.ops.triton_attention_plan import (
    FP32Staging,
    PagedAttentionLaunch,
    SegmentScratch,
    choose_num_splits,
)
from vllm.v1.attention.ops.triton_attention_reduce import store_output
from vllm.v1.attention.ops.triton_packed_kv_tiles import (
    INT4_FORMAT,
    PACKED_INT4,
    PACKED_OCTAVE,
    PACKED_TURBOQUANT,
    PACKED_ULTRAQUANT,
    TURBOQUANT_FORMAT,
    int4_tile,
    octave_tile,
    turboquant_key_tile,
    turboquant_value_tile,
    ultraquant_tile,
)
from vllm.v1.attention.ops.triton_paged_attention import PIPELINE_STAGES, choose_tiling

__all__ = [
    "INT4_LAYOUT",
    "PackedLayout",
    "launch_case",
    "packed_attention_kernel",
    "plan_packed_attention",
    "triton_compile_cases",
]


class PackedLayout(NamedTuple):
    """The format constants of one packed cache: ``format`` (``*_FORMAT`` of
    :mod:`~.triton_packed_kv_tiles`), TurboQuant's key / value bits, Octave's value bits,
    ``rope_dim`` (K dims with 4-bit codes) and ``k_scale_block`` (K dims per scale)."""

    format: int
    key_fp8: bool = False
    mse_bits: int = 0
    norm_correction: bool = False
    value_bits: int = 0
    rope_dim: int = 0
    k_scale_block: int = 0

    @classmethod
    def turboquant(cls, cfg: TurboQuantConfig) -> PackedLayout:
        return cls(
            TURBOQUANT_FORMAT,
            cfg.key_fp8,
            cfg.key_mse_bits,
            cfg.norm_correction,
            cfg.effective_value_quant_bits,
        )


INT4_LAYOUT = PackedLayout(INT4_FORMAT)
"""The layout of an ``int4_per_token_head`` cache (no further constants)."""


@triton.jit
def _key_range(
    first_q,
    last_q,
    seq_len,
    window,
    seq_causal,
    CAUSAL: tl.constexpr,
    PER_SEQ_CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MAX_MM_RANGES: tl.constexpr,
):
    """``[key_lo, key_hi)``: the keys queries ``first_q .. last_q`` can see (causal: up to
    the last; a window W: ``(p - W, p]``, and ``[p, p + W)`` when not causal); multimodal
    prefix ranges, which override the window, need every key."""
    key_lo = 0
    open_hi = seq_len
    if USE_WINDOW:
        key_lo = tl.maximum(first_q - window + 1, 0)
        open_hi = tl.minimum(last_q + window, seq_len)
    if PER_SEQ_CAUSAL:
        key_hi = tl.where(seq_causal, last_q + 1, open_hi)
    elif CAUSAL:
        key_hi = last_q + 1
    else:
        key_hi = open_hi
    if MAX_MM_RANGES > 0:
        key_lo = 0
        key_hi = seq_len
    return key_lo, key_hi


@triton.jit
def _visible(
    q_pos,
    keys,
    window,
    seq_causal,
    mm_base,
    CAUSAL: tl.constexpr,
    PER_SEQ_CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MAX_MM_RANGES: tl.constexpr,
):
    """``[rows, keys]`` mask of the keys each query row sees: causal (per sequence with
    ``PER_SEQ_CAUSAL``), within the window, or inside one of the sequence's bidirectional
    prefix ranges (``mm_base``: ``MAX_MM_RANGES`` pairs of inclusive ends)."""
    dist = q_pos[:, None] - keys[None, :]
    seen = tl.full(dist.shape, 1, tl.int1)
    if PER_SEQ_CAUSAL:
        seen &= (dist >= 0) | (seq_causal == 0)
    elif CAUSAL:
        seen &= dist >= 0
    if USE_WINDOW:
        seen &= dist < window
        if PER_SEQ_CAUSAL:
            seen &= (-dist < window) | seq_causal
        elif not CAUSAL:
            seen &= -dist < window
    for i in tl.static_range(MAX_MM_RANGES):
        start = tl.load(mm_base + 2 * i)
        end = tl.load(mm_base + 2 * i + 1)
        q_in = (q_pos >= start) & (q_pos <= end) & (start < end)
        k_in = (keys >= start) & (keys <= end)
        seen |= q_in[:, None] & k_in[None, :]
    return seen


@triton.jit
def packed_attention_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    k_word_ptr,
    v_word_ptr,
    centroid_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    tile_seq_ptr,
    tile_first_ptr,
    sinks_ptr,
    causal_ptr,
    mm_prefix_ptr,
    alibi_ptr,
    qq_bias_ptr,
    segm_output_ptr,
    segm_max_ptr,
    segm_expsum_ptr,
    softmax_scale,
    soft_cap,
    window,
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_page,
    stride_k_tok,
    stride_k_head,
    stride_v_page,
    stride_v_tok,
    stride_v_head,
    stride_kw_page,
    stride_kw_tok,
    stride_kw_head,
    stride_vw_page,
    stride_vw_tok,
    stride_vw_head,
    stride_bt,
    num_heads,
    qq_bias_stride,
    qq_bias_cols,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    FORMAT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    KEY_FP8: tl.constexpr,
    MSE_BITS: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    CAUSAL: tl.constexpr,
    PER_SEQ_CAUSAL: tl.constexpr,
    MAX_MM_RANGES: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    ALIBI_SQRT: tl.constexpr,
    USE_QQ_BIAS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IS_3D: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    ROPE_DIM: tl.constexpr = 0,
    K_SCALE_BLOCK: tl.constexpr = 0,
):
    """Grid ``(query tiles, num_kv_heads, NUM_SPLITS)``, the query-tile map and masks of
    :func:`~.triton_paged_attention.paged_attention_kernel` (``tile_seq``, ``tile_first``,
    ``window``, ``causal [num_seqs]``, ``mm_prefix [num_seqs, MAX_MM_RANGES, 2]``, ALiBi and
    q/q bias, ``IS_3D`` segments). Pages: TurboQuant ``k_ptr`` / ``v_ptr`` the key and value
    parts of the slots (byte strides), ``centroid_ptr`` fp32 ``[2**MSE_BITS]``; INT4 the two
    sides' packed bytes and int32 scale words ``k_word_ptr`` / ``v_word_ptr`` (element
    strides); ``ultraquant_4bit`` the slots' key and value sides, Octave the whole slots (both),
    ``centroid_ptr`` their level tables. ``FP32_DOT``: IEEE fp32 dots (fp32 queries; every launch
    but INT4's with 16-bit queries)."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    TURBOQUANT: tl.constexpr = FORMAT == PACKED_TURBOQUANT
    INT4: tl.constexpr = FORMAT == PACKED_INT4
    if FP32_DOT:
        DOT_DTYPE: tl.constexpr = tl.float32
    else:
        DOT_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    live, seq, q_tile, q_start, q_len, seq_len, q_idx, row_ok, head = query_tile_rows(
        tile_seq_ptr, tile_first_ptr, query_start_ptr, seq_lens_ptr, num_seqs, pid, kv_head,
        BLOCK_M, BLOCK_Q, GROUP_PAD, GROUP,
    )  # fmt: skip
    context = seq_len - q_len
    q_pos = context + q_idx
    token = (q_start + q_idx).to(tl.int64)
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    dv_ok = dv < HEAD_SIZE_V
    q = tl.load(
        q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
        mask=row_ok[:, None] & (d < HEAD_SIZE)[None, :],
        other=0,
    ).to(DOT_DTYPE)

    seq_causal = True
    if PER_SEQ_CAUSAL:
        seq_causal = tl.load(causal_ptr + seq) != 0
    first_q = context + q_tile * BLOCK_Q
    last_q = tl.minimum(first_q + BLOCK_Q - 1, seq_len - 1)
    key_lo, key_hi = _key_range(first_q, last_q, seq_len, window, seq_causal, CAUSAL,
                                PER_SEQ_CAUSAL, USE_WINDOW, MAX_MM_RANGES)  # fmt: skip
    key_hi = tl.where(live & (q_tile * BLOCK_Q < q_len), key_hi, key_lo)
    tile_begin = key_lo // TILE_N
    tile_end = tl.where(key_hi > key_lo, cdiv_fn(key_hi, TILE_N), tile_begin)
    if IS_3D:  # this segment's share of the sequence's tiles (reduce_segments' rule)
        per_split = cdiv_fn(seq_len, NUM_SPLITS * TILE_N)
        tile_begin = tl.maximum(tile_begin, split * per_split)
        tile_end = tl.minimum(tile_end, (split + 1) * per_split)

    if USE_SINKS and split == 0:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    kv_head64 = kv_head.to(tl.int64)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    qq_rows = qq_bias_ptr + q_idx.to(tl.int64) * qq_bias_stride
    mm_base = mm_prefix_ptr + seq * (MAX_MM_RANGES * 2)

    for t in tl.range(tile_begin, tile_end, num_stages=NUM_STAGES):
        keys = t * TILE_N + tl.arange(0, TILE_N)
        key_ok = (keys >= key_lo) & (keys < key_hi)
        page = tl.load(
            block_table_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0
        ).to(tl.int64)
        tok = keys % BLOCK_SIZE
        k_rows = page * stride_k_page + tok * stride_k_tok + kv_head64 * stride_k_head
        v_rows = page * stride_v_page + tok * stride_v_tok + kv_head64 * stride_v_head
        if TURBOQUANT:
            k, k_factor = turboquant_key_tile(
                k_ptr, k_rows, key_ok, centroid_ptr, HEAD_SIZE, D_PAD, KEY_FP8, MSE_BITS,
                NORM_CORRECTION,
            )  # fmt: skip
        elif not INT4:  # ultraquant_4bit and Octave: the element values, no per-key factor
            if FORMAT == PACKED_ULTRAQUANT:
                k = ultraquant_tile(k_ptr, k_rows, key_ok, centroid_ptr, HEAD_SIZE, D_PAD)
            else:
                k = octave_tile(k_ptr, k_rows, key_ok, centroid_ptr, HEAD_SIZE, D_PAD, ROPE_DIM,
                                K_SCALE_BLOCK, VALUE_BITS, True)  # fmt: skip
            k_factor = tl.where(key_ok, 1.0, 0.0)
        else:
            k_words = page * stride_kw_page + tok * stride_kw_tok + kv_head64 * stride_kw_head
            k, k_factor = int4_tile(k_ptr, k_word_ptr, k_rows, k_words, key_ok, HEAD_SIZE,
                                    D_PAD, DOT_DTYPE)  # fmt: skip
        if FP32_DOT:  # noqa: SIM108 (the precision is a compile-time choice of the dot)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * k_factor[None, :] * softmax_scale
        if USE_SOFT_CAP:
            s = apply_softcap(s, soft_cap)
        seen = _visible(q_pos, keys, window, seq_causal, mm_base, CAUSAL, PER_SEQ_CAUSAL,
                        USE_WINDOW, MAX_MM_RANGES)  # fmt: skip
        if USE_ALIBI or USE_QQ_BIAS:
            s += position_bias(keys, q_pos, q_idx, context, slope, qq_rows, qq_bias_cols, row_ok,
                               USE_ALIBI, ALIBI_SQRT, USE_QQ_BIAS)  # fmt: skip
        s = tl.where(row_ok[:, None] & key_ok[None, :] & seen, s, float("-inf"))
        m_i, l_i, p, alpha = softmax_step(s, m_i, l_i)
        if TURBOQUANT:
            v = turboquant_value_tile(v_ptr, v_rows, key_ok, HEAD_SIZE_V, DV_PAD, VALUE_BITS)
        elif FORMAT == PACKED_ULTRAQUANT:
            v = ultraquant_tile(v_ptr, v_rows, key_ok, centroid_ptr, HEAD_SIZE_V, DV_PAD)
        elif FORMAT == PACKED_OCTAVE:
            v = octave_tile(v_ptr, v_rows, key_ok, centroid_ptr, HEAD_SIZE_V, DV_PAD, ROPE_DIM,
                            K_SCALE_BLOCK, VALUE_BITS, False)  # fmt: skip
        else:
            v_words = page * stride_vw_page + tok * stride_vw_tok + kv_head64 * stride_vw_head
            v, v_row = int4_tile(v_ptr, v_word_ptr, v_rows, v_words, key_ok, HEAD_SIZE_V,
                                 DV_PAD, DOT_DTYPE)  # fmt: skip
            if DOT_DTYPE.is_fp16():  # p * scale could fall into fp16's subnormals
                v = (v.to(tl.float32) * v_row[:, None]).to(DOT_DTYPE)
            else:  # on the probabilities, once per key (fp32 / bf16 range)
                p = p * v_row[None, :]
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(DOT_DTYPE), v)
        acc = acc * alpha[:, None] + pv

    if IS_3D:
        part = (token * num_heads + head) * NUM_SPLITS + split
        part_mask = row_ok[:, None] & dv_ok[None, :]
        tl.store(segm_output_ptr + part[:, None] * DV_PAD + dv[None, :], acc, mask=part_mask)
        tl.store(segm_max_ptr + part, m_i, mask=row_ok)
        tl.store(segm_expsum_ptr + part, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no key seen (empty sequence): 0
        offsets = token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dv[None, :]
        store_output(out_ptr, offsets, out, row_ok[:, None] & dv_ok[None, :])


@functools.cache
def _target_programs(device_index: int) -> int:
    """Programs that fill the GPU: twice its SM count."""
    return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count


def _strides3(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def plan_packed_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    key_words: torch.Tensor | None,
    value_words: torch.Tensor | None,
    centroids: torch.Tensor | None,
    layout: PackedLayout,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool | torch.Tensor = True,
    num_splits: int | None = None,
    mm_prefix_range: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_sqrt: bool = False,
    qq_bias: torch.Tensor | None = None,
) -> PagedAttentionLaunch:
    """The launches (run when the result is called) that write attention of ``query [T, Hq,
    D]`` (its dtype the dot's, fp32: IEEE fp32 dots) into ``out [T, Hq, Dv]`` over packed
    pages read in place.

    ``key_pages`` / ``value_pages``: uint8 ``(B, N, Hkv, bytes)`` views with unit last stride
    (any page / token / head strides): TurboQuant the key and value parts of the slots
    (``kv_cache[..., :key_packed_size]`` / ``kv_cache[..., key_packed_size:]``) with the
    fp32 ``centroids`` of Lloyd-Max keys; INT4 the two sides with their int32 scale words
    ``key_words`` / ``value_words (B, N, Hkv)``. The rest as
    :func:`~.triton_attention_plan.plan_paged_attention`'s (sequences, block table of pages
    per sequence, window W in keys, soft cap, sinks, per-sequence causal flags, split count,
    prefix ranges, ALiBi, q/q bias). Arguments are assumed checked by the caller, but for the
    query dtype TurboQuant's fp32 tiles need."""
    if layout.format != INT4_FORMAT and query.dtype != torch.float32:
        raise ValueError(f"query: expected float32 for packed-slot pages, got {query.dtype}")
    staging = FP32Staging.needed(query, out)
    if staging is not None:
        query, out = staging.query_fp32, staging.out_fp32
    num_tokens, num_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return PagedAttentionLaunch((0, 0, 1), [], {})
    device = query.device
    num_kv_heads = key_pages.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    fp32_dot = query.dtype == torch.float32
    split_k = (num_splits or 1) > 1
    tiling = choose_tiling(group_pad, 1 if split_k else max_query_len, fp32_dot)
    block_q = tiling.block_m // group_pad
    qsl = query_start_loc.to(device=device, dtype=torch.int32)
    tiles = ((qsl[1:] - qsl[:-1]).to(torch.int64) + block_q - 1) // block_q
    tiles_end = torch.cumsum(tiles, 0)
    num_programs = num_tokens // block_q + num_seqs  # >= the tiles of any split of T
    arange = torch.arange(num_programs, device=device)
    tile_seq = torch.searchsorted(tiles_end, arange, right=True).to(torch.int32)
    tile_first = (tiles_end - tiles).to(torch.int32)
    if num_splits is None:
        target = 1 if triton_interpreted() or device.type != "cuda" else _target_programs(
            device.index or 0)  # fmt: skip
        num_splits = choose_num_splits(num_seqs * num_kv_heads, max_seq_len, num_tokens, target,
                                       tiling.tile_n)  # fmt: skip
    head_size_v = out.shape[2]
    d_pad = max(16, triton.next_power_of_2(head_size))
    dv_pad = max(16, triton.next_power_of_2(head_size_v))
    is_3d = num_splits > 1
    scratch = SegmentScratch.empty(num_tokens, num_heads, num_splits, dv_pad, device) if is_3d \
        else None  # fmt: skip
    table = block_table.to(device=device, dtype=torch.int32)
    seq_lens_arg = seq_lens.to(device=device, dtype=torch.int32)
    dummy = torch.zeros(1, dtype=torch.float32, device=device)  # unread pointers

    def fp32_or_dummy(x: torch.Tensor | None) -> torch.Tensor:
        return dummy if x is None else x.to(device=device, dtype=torch.float32).contiguous()

    k_words = key_pages if key_words is None else key_words
    v_words = value_pages if value_words is None else value_words
    args: list[Any] = [
        out, query, key_pages, value_pages, k_words, v_words, fp32_or_dummy(centroids), table,
        seq_lens_arg, qsl, tile_seq, tile_first, fp32_or_dummy(sinks),
        causal.to(device, torch.int32) if isinstance(causal, torch.Tensor) else table,
        table if mm_prefix_range is None else mm_prefix_range.to(device, torch.int32).contiguous(),
        fp32_or_dummy(alibi_slopes), dummy if qq_bias is None else qq_bias.to(device),
        *(scratch or (dummy, dummy, dummy)),
        float(scale), float(logits_soft_cap or 1.0), int(sliding_window or 0), num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *_strides3(key_pages), *_strides3(value_pages), *_strides3(k_words),
        *_strides3(v_words), table.stride(0), num_heads,
        0 if qq_bias is None else qq_bias.stride(0), 0 if qq_bias is None else qq_bias.shape[1],
    ]  # fmt: skip
    constexprs = dict(
        HEAD_SIZE=head_size,
        HEAD_SIZE_V=head_size_v,
        D_PAD=d_pad,
        DV_PAD=dv_pad,
        BLOCK_SIZE=key_pages.shape[1],
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=tiling.block_m,
        TILE_N=tiling.tile_n,
        FORMAT=layout.format,
        FP32_DOT=fp32_dot,
        KEY_FP8=layout.key_fp8,
        MSE_BITS=layout.mse_bits,
        NORM_CORRECTION=layout.norm_correction,
        VALUE_BITS=layout.value_bits,
        CAUSAL=isinstance(causal, torch.Tensor) or bool(causal),
        PER_SEQ_CAUSAL=isinstance(causal, torch.Tensor),
        MAX_MM_RANGES=0 if mm_prefix_range is None else mm_prefix_range.shape[1],
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=logits_soft_cap is not None,
        USE_SINKS=sinks is not None,
        USE_ALIBI=alibi_slopes is not None,
        ALIBI_SQRT=alibi_slopes is not None and alibi_sqrt,
        USE_QQ_BIAS=qq_bias is not None,
        NUM_SPLITS=num_splits,
        IS_3D=is_3d,
        NUM_STAGES=PIPELINE_STAGES,
        ROPE_DIM=layout.rope_dim,
        K_SCALE_BLOCK=layout.k_scale_block,
    )
    reduce_args = reduce_kwargs = None
    if scratch is not None:
        reduce_args = [out, *scratch, seq_lens_arg, num_seqs, num_heads, dummy, out.stride(0),
                       out.stride(1), table.stride(0)]  # fmt: skip
        reduce_kwargs = dict(TILE_SIZE=tiling.tile_n, HEAD_SIZE=head_size_v,
                             HEAD_SIZE_PADDED=dv_pad, query_start_len_ptr=qsl, BLOCK_Q=block_q,
                             NUM_SEGMENTS_PER_SEQ=num_splits, USE_FP8=False)  # fmt: skip
    # TurboQuant values are the codec's `code * scale + lo`, two roundings: no FMA contraction
    # (nor for the other slot formats, whose tiles are the codecs' products).
    fusion = layout.format == INT4_FORMAT
    launch = PagedAttentionLaunch(
        (num_programs, num_kv_heads, num_splits), args, constexprs, reduce_args, reduce_kwargs,
        staging, fusion, tiling.num_warps,
    )  # fmt: skip
    launch.kernel = packed_attention_kernel
    return launch


def _int4_case(name: str, dtype: torch.dtype, head_size: int, splits: int,
               **options: Any) -> TritonCompileCase:  # fmt: skip
    """A launch over an INT4 cache of 4 pages of 16 tokens, 2 KV heads, GQA 3, two sequences
    (a 5-token prefill chunk and a decode)."""
    cache = torch.zeros(4, 16, 2, head_size // 2 + 4, dtype=torch.uint8)
    words = torch.zeros(4, 16, 2, dtype=torch.int32)
    q = torch.zeros(6, 6, head_size, dtype=dtype)
    launch = plan_packed_attention(
        torch.zeros_like(q), q, cache, cache, words, words, None, INT4_LAYOUT,
        torch.zeros(2, 2, dtype=torch.int32), torch.tensor([30, 20], dtype=torch.int32),
        torch.tensor([0, 5, 6], dtype=torch.int32), 0.1, 5, 30, num_splits=splits, **options,
    )  # fmt: skip
    return launch_case(name, launch)


def launch_case(name: str, launch: PagedAttentionLaunch) -> TritonCompileCase:
    """The compile case of a :func:`plan_packed_attention` launch, as it runs."""
    return case_from_launch(
        name,
        packed_attention_kernel,
        launch.args,
        launch.constexprs,
        num_warps=launch.num_warps,
        enable_fp_fusion=launch.fp_fusion,
    )


def triton_compile_cases() -> list[TritonCompileCase]:
    """Specialisations the readers' own cases leave out: INT4 with fp16 queries (window, soft
    cap, sinks) at head size 64 and with fp32 queries (split-K, per-sequence causal flags,
    prefix ranges, ALiBi, q/q bias) at 128; TurboQuant ``turboquant_3bit_nc`` unsplit at
    head dim 64 (the TurboQuant reader compiles every preset at 128 and 96)."""
    cases = [
        _int4_case("int4/fp16/d64/window-softcap-sinks", torch.float16, 64, 1,
                   sliding_window=8, logits_soft_cap=20.0, sinks=torch.zeros(6)),
        _int4_case("int4/fp32/d128/split-biases", torch.float32, 128, 4,
                   causal=torch.ones(2, dtype=torch.int32),
                   mm_prefix_range=torch.zeros(2, 1, 2, dtype=torch.int32),
                   alibi_slopes=torch.zeros(6), qq_bias=torch.zeros(5, 5)),
    ]  # fmt: skip
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_3bit_nc", 64)
    kps = cfg.key_packed_size
    cache = torch.zeros(4, 16, 2, cfg.slot_size_aligned, dtype=torch.uint8)
    q = torch.zeros(2, 4, 64)
    launch = plan_packed_attention(
        torch.zeros_like(q), q, cache[..., :kps], cache[..., kps:], None, None,
        torch.zeros(cfg.n_centroids), PackedLayout.turboquant(cfg),
        torch.zeros(2, 2, dtype=torch.int32), torch.tensor([30, 20], dtype=torch.int32),
        torch.arange(3, dtype=torch.int32), 0.125, 1, 32, num_splits=1,
    )  # fmt: skip
    cases.append(launch_case("turboquant/3bit_nc/d64", launch))
    return cases
