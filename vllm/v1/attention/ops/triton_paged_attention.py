"""Triton paged attention over every cache format (kernels; host entry points in
:mod:`vllm.v1.attention.ops.triton_unified_attention`).

One program attends ``BLOCK_Q`` query tokens x the query heads of one KV head (``BLOCK_M``
rows, the heads of a GQA group side by side) over the keys of one split of the key range, in
tiles of ``TILE_N`` keys (tile ``j``: keys ``j * TILE_N ..``). Each key's page comes from the
block table, so a tile may straddle pages; every tile is decoded WITHOUT its scales
(:func:`~.triton_kv_decode.load_kv_tile`, :func:`~.triton_kv_decode.nvfp4_tile`: values exact
in the query dtype), goes whole into one
``tl.dot`` (fp32 queries: IEEE fp32 dots) with fp32 accumulation, and the scales multiply the
scores, the probabilities (per-token-head values) or the output once; the scores are folded
into an fp32 online softmax (:func:`~.triton_attention_helpers.softmax_step`). Without
``IS_3D`` the program writes the output; with it (split-K, upstream's "3D" launch) segment ``s``
of ``NUM_SPLITS`` takes the sequence's key tiles ``s * T .. (s + 1) * T - 1``, ``T =
ceil(seq_len / (NUM_SPLITS * TILE_N))``, and writes its unnormalised partial sums and running
max / sum, which :func:`~.triton_attention_reduce.reduce_segments` combines.

FP8 e4m3 queries (``Q_FP8``, read as bytes) are decoded exactly into the dot dtype, their
scale folded into the score scale; an output scale (``OUT_SCALE``) divides the output, which
is clamped to e4m3's range and, for a byte output, rounded to e4m3 in integer arithmetic.
``USE_TD`` loads the key / value tiles of unquantized and FP8 caches through tensor
descriptors (TMA on sm_90+), each tile inside one page.

With ``REBUILD_KEYS`` (layers that store keys before RoPE or keep key sinks) each key tile is
instead rebuilt in fp32 real units (:func:`~.triton_key_rebuild.rebuilt_key_tile`: sink rows,
Hadamard back, offset, RoPE at the keys' positions) and dotted with the fp32 query in IEEE
precision, so the rebuilt keys lose nothing; the other paths are compiled without it.
"""

from __future__ import annotations

from typing import NamedTuple

from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_attention_helpers import (
    apply_softcap,
    cdiv_fn,
    position_bias,
    query_tile_rows,
    softmax_step,
)
from vllm.v1.attention.ops.triton_attention_reduce import E4M3_MAX, store_output
from vllm.v1.attention.ops.triton_key_rebuild import rebuilt_key_tile
from vllm.v1.attention.ops.triton_kv_decode import (
    KIND_FP8_E4M3,
    KIND_FP8_PER_TOKEN_HEAD,
    KIND_INT8_PER_TOKEN_HEAD,
    KIND_NVFP4,
    KIND_UNQUANTIZED,
    NVFP4_UNIT,
    decode_kv_values,
    fp8_units,
    load_kv_tile,
    load_row_scale,
    nvfp4_tile,
)

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
def _dot_operand(x, dtype: tl.constexpr):
    """``x`` (exact in ``dtype``) as a dot operand of ``dtype``. fp16 goes to bf16 through fp32:
    the direct conversion is one slow instruction per element (a quarter of the integer
    rate), the two steps are fast ones (the second packs two elements)."""
    if x.dtype == tl.float16 and dtype == tl.bfloat16:
        return x.to(tl.float32).to(tl.bfloat16)
    return x.to(dtype)


@triton.jit
def _td_tile(
    cache_ptr,
    page,
    kv_head,
    first_tok,
    stride_page,
    stride_tok,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    FORMAT: tl.constexpr,
    BF16_PAGES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """``[TILE_N, D_PAD]`` values of tokens ``first_tok ..`` of ``page`` (one page: the launch
    keeps ``BLOCK_SIZE % TILE_N == 0``) through a tensor descriptor over the page's
    ``(BLOCK_SIZE, HEAD_SIZE)`` rows of ``kv_head`` (padding columns read as 0), decoded as
    :func:`~.triton_kv_decode.load_kv_tile` decodes an unquantized or FP8 tile."""
    desc = tl.make_tensor_descriptor(
        base=cache_ptr + page * stride_page + kv_head * stride_head,
        shape=(BLOCK_SIZE, HEAD_SIZE),
        strides=(stride_tok, 1),
        block_shape=(TILE_N, D_PAD),
    )
    return decode_kv_values(desc.load([first_tok, 0]), FORMAT, BF16_PAGES, DOT_DTYPE)


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
    q_scale_ptr,
    out_scale_ptr,
    causal_ptr,
    mm_prefix_ptr,
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
    alibi_ptr,
    qq_bias_ptr,
    rswa_prefix_ptr,
    qq_bias_stride,
    qq_bias_cols,
    rswa_window,
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
    PER_SEQ_CAUSAL: tl.constexpr,
    CHUNK_LOOKBACK: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    MAX_MM_RANGES: tl.constexpr,
    MM_PREFIX_CLAMP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IS_3D: tl.constexpr,
    Q_FP8: tl.constexpr,
    OUT_SCALE: tl.constexpr,
    USE_TD: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    REBUILD_KEYS: tl.constexpr,
    USE_ROPE: tl.constexpr,
    ROPE_NEOX: tl.constexpr,
    KEY_HADAMARD: tl.constexpr,
    USE_KEY_OFFSET: tl.constexpr,
    USE_SINK_KEYS: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    ALIBI_SQRT: tl.constexpr,
    USE_QQ_BIAS: tl.constexpr,
    USE_RSWA: tl.constexpr,
):
    """Grid ``(query tiles, num_kv_heads, NUM_SPLITS)``. ``tile_seq[i]`` is the sequence of
    query tile ``i`` (``num_seqs`` past the last tile: the program does nothing) and
    ``tile_first[s]`` the first tile of sequence ``s``. ``window`` W: a query at ``p`` sees
    keys in ``(p - W, p]`` (and ``[p, p + W)`` when not causal; ``PER_SEQ_CAUSAL``: sequence
    ``s`` is causal where ``causal[s] != 0``, int32 ``[num_seqs]``). ``CHUNK_LOOKBACK >= 0``:
    chunks of ``CHUNK_SIZE`` keys, a query seeing its own and ``CHUNK_LOOKBACK`` earlier ones
    (in place of the window). ``mm_prefix [num_seqs, MAX_MM_RANGES, 2]`` int32: bidirectional
    ranges (inclusive ends; ``start >= end``: none) seen whatever the mask, within the window
    with ``MM_PREFIX_CLAMP``. ``IS_3D`` partial results,
    fp32 and contiguous: ``segm_output [T, Hq, NUM_SPLITS, DV_PAD]``, ``segm_max`` /
    ``segm_expsum [T, Hq, NUM_SPLITS]`` (running max of the scaled scores, natural-log units,
    and running sum). ``q_scale`` (``Q_FP8``) and ``out_scale`` (``OUT_SCALE``: the inverse
    output scale) are fp32 ``[1]``. ``NUM_STAGES``: software-pipelining depth of the key loop
    (1: none). Score biases (:func:`~.triton_attention_helpers.position_bias`): ALiBi slopes
    ``alibi [Hq]`` (``USE_ALIBI``, ``ALIBI_SQRT``), ``qq_bias`` rows of ``qq_bias_stride``
    elements (``USE_QQ_BIAS``). ``USE_RSWA``: keys below ``rswa_prefix[seq]`` (int32
    ``[num_seqs]``) stay visible, the others within ``rswa_window`` of the query, in place of
    the sliding window."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    # What the decoders leave out of the values: e4m3 units are value * 2^-8, NVFP4 tiles
    # E2M1 * sf / NVFP4_UNIT.
    E4M3_UNITS: tl.constexpr = FORMAT == KIND_FP8_E4M3 or FORMAT == KIND_FP8_PER_TOKEN_HEAD  # noqa: SIM109 (Triton compiles no `in`)
    NVFP4: tl.constexpr = FORMAT == KIND_NVFP4
    ROW_SCALES: tl.constexpr = (
        FORMAT == KIND_INT8_PER_TOKEN_HEAD or FORMAT == KIND_FP8_PER_TOKEN_HEAD  # noqa: SIM109 (Triton compiles no `in`)
    )
    UNIT: tl.constexpr = NVFP4_UNIT if NVFP4 else (256.0 if E4M3_UNITS else 1.0)
    if FP32_DOT:
        DOT_DTYPE: tl.constexpr = tl.float32
    elif Q_FP8:  # exact for e4m3 units; bf16 beside bf16 pages, which it leaves unconverted
        DOT_DTYPE: tl.constexpr = tl.bfloat16 if BF16_PAGES else tl.float16
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
    d_ok = d < HEAD_SIZE
    dv = tl.arange(0, DV_PAD)
    dv_ok = dv < HEAD_SIZE_V
    q = tl.load(
        q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0,
    )
    qk_scale = softmax_scale
    if Q_FP8:  # e4m3 bytes as fp16 units (value * 2^-8), exact in the dot dtype
        q = fp8_units(q, False).to(tl.float32).to(DOT_DTYPE)
        qk_scale = qk_scale * tl.load(q_scale_ptr) * 256.0

    # Keys this tile's queries can see; an empty range for a dead program or tile.
    first_q = context + q_tile * BLOCK_Q
    last_q = tl.minimum(first_q + BLOCK_Q - 1, seq_len - 1)
    key_lo = 0
    open_hi = seq_len  # a bidirectional sequence's
    WINDOW: tl.constexpr = USE_WINDOW and not USE_RSWA  # R-SWA replaces the window
    if WINDOW:
        key_lo = tl.maximum(first_q - window + 1, 0)
        open_hi = tl.minimum(last_q + window, seq_len)
    if PER_SEQ_CAUSAL:  # this sequence's flag (0: bidirectional)
        causal_flag = tl.load(causal_ptr + seq)
        seq_causal = causal_flag != 0
        seq_open = causal_flag == 0
        key_hi = tl.where(seq_causal, last_q + 1, open_hi)
    elif CAUSAL:
        key_hi = last_q + 1
    else:
        key_hi = open_hi
    if CHUNK_LOOKBACK >= 0:  # chunked attention replaces the window's left edge
        key_lo = tl.maximum((first_q // CHUNK_SIZE - CHUNK_LOOKBACK) * CHUNK_SIZE, 0)
    mm_base = mm_prefix_ptr + seq * (MAX_MM_RANGES * 2)
    if MAX_MM_RANGES > 0 and not MM_PREFIX_CLAMP:  # ranges override the window: every key
        key_lo = 0
        key_hi = seq_len
    for i in tl.static_range(MAX_MM_RANGES if MM_PREFIX_CLAMP else 0):  # ranges meeting the
        start = tl.load(mm_base + 2 * i)  # tile widen the range, within the window
        end = tl.load(mm_base + 2 * i + 1)
        meets = (start < end) & (start <= last_q) & (end >= first_q)
        lo = tl.maximum(start, first_q - window + 1) if WINDOW else start
        key_lo = tl.where(meets, tl.minimum(key_lo, tl.maximum(lo, 0)), key_lo)
        key_hi = tl.where(meets, tl.maximum(key_hi, tl.minimum(end + 1, seq_len)), key_hi)
    key_hi = tl.where(live & (q_tile * BLOCK_Q < q_len), key_hi, key_lo)
    tile_begin = key_lo // TILE_N
    tile_end = tl.where(key_hi > key_lo, cdiv_fn(key_hi, TILE_N), tile_begin)
    if IS_3D:  # this segment's share of the sequence's tiles (reduce_segments' rule)
        per_split = cdiv_fn(seq_len, NUM_SPLITS * TILE_N)
        tile_begin = tl.maximum(tile_begin, split * per_split)
        tile_end = tl.minimum(tile_end, (split + 1) * per_split)

    k_scale = tl.load(k_scale_ptr + kv_head * k_scale_stride)
    v_scale = tl.load(v_scale_ptr + kv_head * v_scale_stride)
    if USE_SINKS and split == 0:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    kv_head64 = kv_head.to(tl.int64)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)  # per-row bias inputs, read once
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    qq_rows = qq_bias_ptr + q_idx.to(tl.int64) * qq_bias_stride
    rswa_prefix = tl.load(rswa_prefix_ptr + seq) if USE_RSWA else 0

    # Software pipelining: the next tiles' block-table entries and pages are copied in
    # (cp.async) while this one is computed; without it each tile waits out its loads. Not
    # for rebuilt keys: their fp32 cos / sin tiles in flight took 100-150 KB of shared memory
    # (sm_86 / sm_89 have 99 KB), 48 KB without.
    STAGES: tl.constexpr = 1 if REBUILD_KEYS else NUM_STAGES
    for t in tl.range(tile_begin, tile_end, num_stages=STAGES):
        keys = t * TILE_N + tl.arange(0, TILE_N)
        key_ok = (keys >= key_lo) & (keys < key_hi)  # aligned tiles: the window's left edge too
        page = tl.load(
            block_table_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0
        ).to(tl.int64)
        tok = keys % BLOCK_SIZE
        if USE_TD:  # the tile lies in one page: its entry, once
            td_page = tl.load(block_table_ptr + seq * stride_bt + t * TILE_N // BLOCK_SIZE)
            td_page = td_page.to(tl.int64)
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
            elif USE_TD:  # keys past the sequence may hold anything (NaN): zeroed
                k = _td_tile(
                    k_ptr,
                    td_page,
                    kv_head64,
                    t * TILE_N % BLOCK_SIZE,
                    stride_k_page,
                    stride_k_tok,
                    stride_k_head,
                    BLOCK_SIZE,
                    TILE_N,
                    HEAD_SIZE,
                    D_PAD,
                    FORMAT,
                    BF16_PAGES,
                    DOT_DTYPE,
                )
                k = tl.trans(tl.where(key_ok[:, None], k, 0.0).to(k.dtype))
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
        s = s * qk_scale
        if USE_SOFT_CAP:
            s = apply_softcap(s, soft_cap)
        dist = q_pos[:, None] - keys[None, :]  # query minus key position
        seen = tl.full([BLOCK_M, TILE_N], 1, tl.int1)
        if PER_SEQ_CAUSAL:
            seen &= (dist >= 0) | seq_open
        elif CAUSAL:
            seen &= dist >= 0
        if USE_RSWA:  # the prompt stays visible, later keys within the window
            seen &= (keys[None, :] < rswa_prefix) | (dist < rswa_window)
        if CHUNK_LOOKBACK >= 0:  # (causal and chunks) or prefix ranges
            seen &= q_pos[:, None] // CHUNK_SIZE - keys[None, :] // CHUNK_SIZE <= CHUNK_LOOKBACK
        elif WINDOW:  # (causal and window) or prefix ranges
            seen &= dist < window
            if PER_SEQ_CAUSAL:
                seen &= (-dist < window) | seq_causal
            elif not CAUSAL:
                seen &= -dist < window
        for i in tl.static_range(MAX_MM_RANGES):  # bidirectional prefix-LM ranges, inclusive
            start = tl.load(mm_base + 2 * i)
            end = tl.load(mm_base + 2 * i + 1)
            q_in = (q_pos >= start) & (q_pos <= end) & (start < end)
            k_in = (keys >= start) & (keys <= end)
            in_range = q_in[:, None] & k_in[None, :]
            if MM_PREFIX_CLAMP and USE_WINDOW:
                in_range &= dist < window
            seen |= in_range
        if USE_ALIBI or USE_QQ_BIAS:
            s += position_bias(keys, q_pos, q_idx, context, slope, qq_rows, qq_bias_cols, row_ok,
                               USE_ALIBI, ALIBI_SQRT, USE_QQ_BIAS)  # fmt: skip
        s = tl.where(row_ok[:, None] & key_ok[None, :] & seen, s, float("-inf"))
        m_i, l_i, p, alpha = softmax_step(s, m_i, l_i)
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
        elif USE_TD:
            v = _td_tile(
                v_ptr,
                td_page,
                kv_head64,
                t * TILE_N % BLOCK_SIZE,
                stride_v_page,
                stride_v_tok,
                stride_v_head,
                BLOCK_SIZE,
                TILE_N,
                HEAD_SIZE_V,
                DV_PAD,
                FORMAT,
                BF16_PAGES,
                DOT_DTYPE,
            )
            v = tl.where(key_ok[:, None], v, 0.0).to(v.dtype)
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

    if FORMAT != KIND_UNQUANTIZED and not ROW_SCALES:  # the tensor or head scale, once
        acc = acc * (v_scale * UNIT)
    if IS_3D:
        part = (token * num_heads + head) * NUM_SPLITS + split
        part_mask = row_ok[:, None] & dv_ok[None, :]
        tl.store(segm_output_ptr + part[:, None] * DV_PAD + dv[None, :], acc, mask=part_mask)
        tl.store(segm_max_ptr + part, m_i, mask=row_ok)
        tl.store(segm_expsum_ptr + part, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no key seen (empty sequence): 0
        if OUT_SCALE:
            out = tl.clamp(out * tl.load(out_scale_ptr), -E4M3_MAX, E4M3_MAX)
        offsets = token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dv[None, :]
        store_output(out_ptr, offsets, out, row_ok[:, None] & dv_ok[None, :])
