"""Triton paged attention over every cache format (kernels; host entry points in
:mod:`vllm.v1.attention.ops.triton_unified_attention`).

One program attends ``BLOCK_Q`` query tokens x the query heads of one KV head (``BLOCK_M``
rows, the heads of a GQA group side by side) over the keys of one split of the key range, in
tiles of ``TILE_N`` keys. Each key's page comes from the block table, so a tile may straddle
pages; every tile is decoded WITHOUT its scales (:func:`~.triton_kv_decode.load_kv_tile`,
:func:`~.triton_kv_decode.nvfp4_tile`: values exact in the query dtype), goes whole into one
``tl.dot`` (fp32 queries: IEEE fp32 dots) with fp32 accumulation, and the scales multiply the
scores, the probabilities (per-token-head values) or the output once; the scores are folded
into an fp32 online softmax (base 2). With ``NUM_SPLITS == 1`` the program writes the output;
otherwise it writes its unnormalised partial sums and running max / sum, which
:func:`merge_splits_kernel` combines (split-K for long sequences).

With ``REBUILD_KEYS`` (layers that store keys before RoPE or keep key sinks) each key tile is
instead rebuilt in fp32 real units (:func:`~.triton_key_rebuild.rebuilt_key_tile`: sink rows,
Hadamard back, offset, RoPE at the keys' positions) and dotted with the fp32 query in IEEE
precision, so the rebuilt keys lose nothing; the other paths are compiled without it.
"""

from __future__ import annotations

from typing import NamedTuple

from vllm.triton_utils import LOG2E, tl, triton
from vllm.v1.attention.ops.triton_key_rebuild import rebuilt_key_tile
from vllm.v1.attention.ops.triton_kv_decode import (
    KIND_FP8_E4M3,
    KIND_FP8_PER_TOKEN_HEAD,
    KIND_INT8_PER_TOKEN_HEAD,
    KIND_NVFP4,
    KIND_UNQUANTIZED,
    NVFP4_UNIT,
    load_kv_tile,
    load_row_scale,
    nvfp4_tile,
)

_LOG2E = tl.constexpr(LOG2E)

PIPELINE_STAGES = 3
"""Software-pipelining depth of the key loop as launched (and compiled by the AOT cases)."""


TILE_N = 32
"""Keys per tile of the tensor-core paths (fp16 / bf16 queries)."""


class Tiling(NamedTuple):
    """Launch shape of :func:`paged_attention_kernel`: query rows per program, keys per tile,
    warps per program."""

    block_m: int
    tile_n: int
    num_warps: int


def choose_tiling(group_pad: int, max_query_len: int, exact: bool) -> Tiling:
    """Tensor-core dots (fp16 / bf16 queries): the GQA group times enough query tokens for 16
    rows (decode) or 64 (prefill), 32-key tiles, 4 warps. Exact paths (fp32 queries' IEEE dots,
    rebuilt keys), whose dots run on FMA units with fp32 operands in registers: 16 rows, 16-key
    tiles, 8 warps; larger tiles spill (sm_90: 0.9-5.7 KB of local memory per thread at 64 x 32
    with 4 warps, none at 16 x 16 with 8; benchmarks.md, static cost)."""
    if exact:
        return Tiling(max(16, group_pad), 16, 8)
    return Tiling(max(16 if max_query_len <= 1 else 64, group_pad), TILE_N, 4)


@triton.jit
def _tanh(x):
    """tanh from exp (libdevice does not run under the interpreter); saturates to ±1."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _dot_operand(x, dtype: tl.constexpr):
    """``x`` (exact in ``dtype``) as a dot operand of ``dtype``. fp16 goes to bf16 through fp32:
    the direct conversion is one slow instruction per element (a quarter of the integer
    rate), the two steps are fast ones (the second packs two elements)."""
    if x.dtype == tl.float16 and dtype == tl.bfloat16:
        return x.to(tl.float32).to(tl.bfloat16)
    return x.to(dtype)


@triton.jit
def paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    k_aux_ptr,
    v_aux_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    tile_seq_ptr,
    tile_first_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,
    part_acc_ptr,
    part_ml_ptr,
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
    stride_ka_page,
    stride_ka_tok,
    stride_ka_head,
    stride_v_page,
    stride_v_tok,
    stride_v_head,
    stride_va_page,
    stride_va_tok,
    stride_va_head,
    stride_bt,
    k_scale_stride,
    v_scale_stride,
    num_heads,
    rope_ptr,
    key_offset_ptr,
    sink_keys_ptr,
    hadamard_scale,
    rotary_dim,
    num_sink_keys,
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
    BF16_PAGES: tl.constexpr,
    K_INTERLEAVE4: tl.constexpr,
    V_INTERLEAVE4: tl.constexpr,
    SCALE_INLINE: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    FP32_DOT: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    REBUILD_KEYS: tl.constexpr,
    USE_ROPE: tl.constexpr,
    ROPE_NEOX: tl.constexpr,
    KEY_HADAMARD: tl.constexpr,
    USE_KEY_OFFSET: tl.constexpr,
    USE_SINK_KEYS: tl.constexpr,
):
    """Grid ``(query tiles, num_kv_heads, NUM_SPLITS)``. ``tile_seq[i]`` is the sequence of
    query tile ``i`` (``num_seqs`` past the last tile: the program does nothing) and
    ``tile_first[s]`` the first tile of sequence ``s``. ``window`` W: a query at ``p`` sees
    keys in ``(p - W, p]`` (and ``[p, p + W)`` when not causal). Partial results:
    ``part_acc [T, Hq, NUM_SPLITS, DV_PAD]`` fp32, ``part_ml [T, Hq, NUM_SPLITS, 2]``
    (running max in log2 units, running sum). ``NUM_STAGES``: software-pipelining depth of
    the key loop (1: none)."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    # What the decoders leave out of the values: e4m3 units are value * 2^-8, NVFP4 tiles
    # E2M1 * sf / NVFP4_UNIT.
    E4M3_UNITS: tl.constexpr = FORMAT == KIND_FP8_E4M3 or FORMAT == KIND_FP8_PER_TOKEN_HEAD  # noqa: SIM109 (Triton compiles no `in`)
    NVFP4: tl.constexpr = FORMAT == KIND_NVFP4
    ROW_SCALES: tl.constexpr = (
        FORMAT == KIND_INT8_PER_TOKEN_HEAD or FORMAT == KIND_FP8_PER_TOKEN_HEAD  # noqa: SIM109 (Triton compiles no `in`)
    )
    UNIT: tl.constexpr = NVFP4_UNIT if NVFP4 else (256.0 if E4M3_UNITS else 1.0)
    DOT_DTYPE: tl.constexpr = tl.float32 if FP32_DOT else q_ptr.dtype.element_ty
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_raw = tl.load(tile_seq_ptr + pid)
    live = seq_raw < num_seqs
    seq = tl.minimum(seq_raw, num_seqs - 1)
    q_tile = pid - tl.load(tile_first_ptr + seq)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.where(live, tl.load(query_start_ptr + seq + 1) - q_start, 0)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    q_pos = context + q_idx
    token = (q_start + q_idx).to(tl.int64)

    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_SIZE
    dv = tl.arange(0, DV_PAD)
    dv_ok = dv < HEAD_SIZE_V
    q = tl.load(
        q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # Keys this tile's queries can see; an empty range for a dead program or tile.
    first_q = context + q_tile * BLOCK_Q
    last_q = tl.minimum(first_q + BLOCK_Q - 1, seq_len - 1)
    key_lo = 0
    if USE_WINDOW:
        key_lo = tl.maximum(first_q - window + 1, 0)
    if CAUSAL:
        key_hi = last_q + 1
    elif USE_WINDOW:
        key_hi = tl.minimum(last_q + window, seq_len)
    else:
        key_hi = seq_len
    key_hi = tl.where(live & (q_tile * BLOCK_Q < q_len), key_hi, key_lo)
    num_tiles = tl.cdiv(key_hi - key_lo, TILE_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * per_split
    tile_end = tl.minimum(tile_begin + per_split, num_tiles)

    k_scale = tl.load(k_scale_ptr + kv_head * k_scale_stride)
    v_scale = tl.load(v_scale_ptr + kv_head * v_scale_stride)
    if USE_SINKS and split == 0:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * _LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    kv_head64 = kv_head.to(tl.int64)

    # Software pipelining: the next tiles' block-table entries and pages are copied in
    # (cp.async) while this one is computed; without it each tile waits out its loads. Not
    # for rebuilt keys: their fp32 cos / sin tiles in flight took 100-150 KB of shared memory
    # (sm_86 / sm_89 have 99 KB), 48 KB without.
    STAGES: tl.constexpr = 1 if REBUILD_KEYS else NUM_STAGES
    for t in tl.range(tile_begin, tile_end, num_stages=STAGES):
        keys = key_lo + t * TILE_N + tl.arange(0, TILE_N)
        key_ok = keys < key_hi
        page = tl.load(
            block_table_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0
        ).to(tl.int64)
        tok = keys % BLOCK_SIZE
        if REBUILD_KEYS:  # fp32 keys in real units, rebuilt (triton_key_rebuild), fp32 dot
            k = rebuilt_key_tile(
                k_ptr,
                k_aux_ptr,
                rope_ptr,
                key_offset_ptr,
                sink_keys_ptr,
                page,
                tok,
                keys,
                key_ok,
                seq,
                kv_head64,
                d,
                k_scale,
                hadamard_scale,
                rotary_dim,
                num_sink_keys,
                num_heads // GROUP,
                stride_k_page,
                stride_k_tok,
                stride_k_head,
                stride_ka_page,
                stride_ka_tok,
                stride_ka_head,
                HEAD_SIZE,
                D_PAD,
                FORMAT,
                BF16_PAGES,
                K_INTERLEAVE4,
                SCALE_INLINE,
                ROW_ALIGN,
                USE_ROPE,
                ROPE_NEOX,
                KEY_HADAMARD,
                USE_KEY_OFFSET,
                USE_SINK_KEYS,
            )
            s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
        else:
            if NVFP4:  # E2M1 * block scale, exact in the dot dtype; rows loaded
                k = nvfp4_tile(
                    k_ptr,
                    k_aux_ptr,
                    page,
                    tok,
                    kv_head64,
                    key_ok,
                    stride_k_page,
                    stride_k_tok,
                    stride_k_head,
                    stride_ka_page,
                    stride_ka_tok,
                    stride_ka_head,
                    K_INTERLEAVE4,
                    HEAD_SIZE,
                    D_PAD,
                )
                k = tl.trans(k)
            else:
                k = load_kv_tile(
                    k_ptr,
                    page[None, :],
                    tok[None, :],
                    kv_head64,
                    d[:, None],
                    key_ok[None, :],
                    d_ok[:, None],
                    stride_k_page,
                    stride_k_tok,
                    stride_k_head,
                    FORMAT,
                    BF16_PAGES,
                    DOT_DTYPE,
                    ROW_ALIGN,
                )
            if FP32_DOT:
                s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, _dot_operand(k, q.dtype))
            if ROW_SCALES:  # per-token-head: each key's row scale, once
                k_aux = page * stride_ka_page + tok * stride_ka_tok + kv_head64 * stride_ka_head
                k_row = load_row_scale(k_aux_ptr, k_aux, key_ok, SCALE_INLINE, ROW_ALIGN)
                s = s * (k_row * UNIT)[None, :]
            elif FORMAT != KIND_UNQUANTIZED:  # FP8 (units) / NVFP4: the tensor or head scale
                s = s * (k_scale * UNIT)
        s = s * softmax_scale
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        allowed = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            allowed &= keys[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            allowed &= q_pos[:, None] - keys[None, :] < window
            if not CAUSAL:
                allowed &= keys[None, :] - q_pos[:, None] < window
        s = tl.where(allowed, s * _LOG2E, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp2 finite
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if NVFP4:
            v = nvfp4_tile(
                v_ptr,
                v_aux_ptr,
                page,
                tok,
                kv_head64,
                key_ok,
                stride_v_page,
                stride_v_tok,
                stride_v_head,
                stride_va_page,
                stride_va_tok,
                stride_va_head,
                V_INTERLEAVE4,
                HEAD_SIZE_V,
                DV_PAD,
            )
        else:
            v = load_kv_tile(
                v_ptr,
                page[:, None],
                tok[:, None],
                kv_head64,
                dv[None, :],
                key_ok[:, None],
                dv_ok[None, :],
                stride_v_page,
                stride_v_tok,
                stride_v_head,
                FORMAT,
                BF16_PAGES,
                DOT_DTYPE,
                ROW_ALIGN,
            )
        if ROW_SCALES:  # per-token-head: each value row's scale
            v_aux = page * stride_va_page + tok * stride_va_tok + kv_head64 * stride_va_head
            v_row = load_row_scale(v_aux_ptr, v_aux, key_ok, SCALE_INLINE, ROW_ALIGN) * UNIT
            if q.dtype == tl.float16:  # p * scale could fall into fp16's subnormals
                v = v * v_row[:, None]
            else:  # on the probabilities, once per key (fp32 / bf16 range)
                p = p * v_row[None, :]
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), _dot_operand(v, q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if FORMAT != KIND_UNQUANTIZED and not ROW_SCALES:  # the tensor or head scale, once
        acc = acc * (v_scale * UNIT)
    if NUM_SPLITS == 1:
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # padding rows: no 0 / 0
        tl.store(
            out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dv[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dv_ok[None, :],
        )
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split
        acc_ptrs = part_acc_ptr + part[:, None] * DV_PAD + dv[None, :]
        tl.store(acc_ptrs, acc, mask=row_ok[:, None])
        ml = part * 2
        tl.store(part_ml_ptr + ml, m_i, mask=row_ok)
        tl.store(part_ml_ptr + ml + 1, l_i, mask=row_ok)


@triton.jit
def merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    stride_o_tok,
    stride_o_head,
    num_heads,
    HEAD_SIZE_V: tl.constexpr,
    DV_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Grid ``(tokens, num_heads)``: ``out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)``,
    ``M = max_s m_s``, over the partial results of :func:`paged_attention_kernel`
    (``part_acc`` contiguous ``[T, num_heads, NUM_SPLITS, DV_PAD]``, ``part_ml`` contiguous
    ``[T, num_heads, NUM_SPLITS, 2]``)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    row = token * num_heads + head
    ml = part_ml_ptr + (row * NUM_SPLITS + splits) * 2
    m = tl.load(ml, mask=split_ok, other=float("-inf"))
    l_part = tl.load(ml + 1, mask=split_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    total = tl.sum(l_part * weight, axis=0)
    dv = tl.arange(0, DV_PAD)
    acc = tl.load(
        part_acc_ptr + (row * NUM_SPLITS + splits[:, None]) * DV_PAD + dv[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(
        out_ptr + token * stride_o_tok + head * stride_o_head + dv,
        out.to(out_ptr.dtype.element_ty),
        mask=dv < HEAD_SIZE_V,
    )
