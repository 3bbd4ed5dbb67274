"""``@triton.jit`` building blocks of the paged attention kernels, at upstream vLLM's module path
and with its signatures: ceiling division, the logit soft cap, one online-softmax step, the
sequence lookup of a query token and the key-tile range of a query block; and this library's
ALiBi / q/q score bias (:func:`position_bias`).

:mod:`vllm.v1.attention.ops.triton_paged_attention` runs its softmax and soft cap through
these; :func:`compute_tile_loop_bounds` is upstream's tile-range rule (multimodal prefix ranges,
chunked and sliding windows, split-K segments) for kernels that take their window as a
constexpr.
"""

from __future__ import annotations

from vllm.triton_utils import tl, triton


@triton.jit
def cdiv_fn(x, y):
    """``ceil(x / y)`` for non-negative integers."""
    return (x + y - 1) // y


@triton.jit
def apply_softcap(S, x):
    """``x * tanh(S / x)`` through a single exponential, ``tanh(y) = 1 - 2 / (e^(2y) + 1)``:
    it saturates to ``±x`` where ``e^(2y)`` overflows or underflows (no ``inf / inf``), and
    libdevice's ``tanh`` is not there under Triton's interpreter."""
    y = S / x
    return x * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))


@triton.jit
def softmax_step(S, M, L):
    """One online-softmax step over the scores ``S [rows, keys]`` (natural-log units, masked
    keys ``-inf``) from the running row maxima ``M`` and sums ``L``. Returns ``(M_new, L_new,
    P, alpha)``: ``P = exp(S - M_new)``, ``alpha = exp(M - M_new)`` (the caller rescales its
    accumulators by it). A row with no key yet keeps ``M = -inf``, so a later tile of very
    negative scores still sets its maximum; the exponents then shift by 0, not by ``-inf``."""
    m_new = tl.maximum(M, tl.max(S, axis=1))
    shift = tl.where(m_new > float("-inf"), m_new, 0.0)
    P = tl.exp(S - shift[:, None])
    alpha = tl.exp(M - shift)
    return m_new, L * alpha + tl.sum(P, axis=1), P, alpha


@triton.jit
def position_bias(
    keys,
    q_pos,
    q_idx,
    context,
    slope,
    qq_rows,
    qq_cols,
    row_ok,
    USE_ALIBI: tl.constexpr,
    ALIBI_SQRT: tl.constexpr,
    USE_QQ_BIAS: tl.constexpr,
):
    """The fp32 ``[rows, keys]`` bias added to the scaled (soft-capped) scores of query rows at
    positions ``q_pos`` (index ``q_idx`` in their sequence, whose queries start at position
    ``context``) over ``keys``. ALiBi: ``slope [rows]`` times the key's distance from the
    first query, ``key - context`` (its row constant cancels in the softmax, not against a
    sink), or with ``ALIBI_SQRT`` ``-sqrt(query - key)`` for past keys, 0 for later ones.
    q/q bias: the keys that are this sequence's queries (``key - context`` in ``[0,
    qq_cols)``) read element ``key - context`` of the row pointers ``qq_rows``."""
    bias = tl.zeros([q_pos.shape[0], keys.shape[0]], dtype=tl.float32)
    if USE_ALIBI:
        if ALIBI_SQRT:
            back = (q_pos[:, None] - keys[None, :]).to(tl.float32)
            offset = tl.where(back >= 0, -tl.sqrt(tl.maximum(back, 0.0)), 0.0)
        else:
            offset = (keys - context).to(tl.float32)[None, :]
        bias += slope[:, None] * offset
    if USE_QQ_BIAS:
        col = keys - context
        col_ok = (col >= 0) & (col < qq_cols)
        mask = row_ok[:, None] & col_ok[None, :]
        bias += tl.load(qq_rows[:, None] + col[None, :], mask=mask, other=0.0).to(tl.float32)
    return bias


@triton.jit
def find_seq_idx(
    query_start_len_ptr,
    target_idx,
    num_seqs,
    BLOCK_Q: tl.constexpr,
    use_q_block_mode: tl.constexpr,
):
    """The sequence holding ``target_idx``: a query token (``use_q_block_mode`` False) or a
    query block of the grid in which sequence ``i`` starts at ``query_start_len[i] // BLOCK_Q
    + i`` (True), by binary search over ``query_start_len [num_seqs + 1]``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_len_ptr + mid)
        if use_q_block_mode:
            start = start // BLOCK_Q + mid
        if start <= target_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def compute_tile_loop_bounds(
    context_len,
    seq_len,
    cur_batch_query_len,
    q_block_local_idx,
    segm_idx_or_0,
    tiles_per_segment_or_0,
    TILE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    num_queries_per_kv: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    USE_MM_PREFIX: tl.constexpr,
    IS_3D: tl.constexpr,
    USE_CAUSAL: tl.constexpr = True,
    USE_PER_SEQ_CAUSAL: tl.constexpr = False,
    CHUNK_LOOKBACK: tl.constexpr = -1,
    CHUNK_SIZE: tl.constexpr = -1,
    USE_R_SWA: tl.constexpr = False,
    MM_PREFIX_CLAMP_SW: tl.constexpr = False,
    MAX_MM_RANGES: tl.constexpr = 0,
    mm_prefix_range_ptr=None,
    seq_idx=0,
):
    """Key tiles ``[loop_lo, loop_hi)`` (``TILE_SIZE`` keys each, tile ``j`` = keys ``j *
    TILE_SIZE ..``) that query block ``q_block_local_idx`` (``BLOCK_Q`` tokens, ``BLOCK_M``
    rows of ``num_queries_per_kv`` heads each) of a sequence of ``seq_len`` keys, the last
    ``cur_batch_query_len`` of them queries, can see, and the key bound ``max_seq_prefix_len``
    the tiles are masked to.

    Causal blocks read up to their last query; non-causal, per-sequence causal, multimodal
    prefix or R-SWA blocks the whole sequence. A sliding window of ``SLIDING_WINDOW`` keys
    (or chunks of ``CHUNK_SIZE`` keys looking back ``CHUNK_LOOKBACK`` chunks) drops the tiles
    left of it (and, non-causal, right of it); with ``MM_PREFIX_CLAMP_SW`` the multimodal
    ranges ``mm_prefix_range [num_seqs, MAX_MM_RANGES, 2]`` (inclusive ends) that meet the
    block widen that range to their ends, clamped to the window. ``IS_3D``: only segment
    ``segm_idx_or_0``'s ``tiles_per_segment_or_0`` tiles."""
    max_seq_prefix_len = (
        context_len + q_block_local_idx * BLOCK_Q + (BLOCK_M - 1) // num_queries_per_kv + 1
    )
    if USE_MM_PREFIX or USE_R_SWA or USE_PER_SEQ_CAUSAL or (not USE_CAUSAL):
        max_seq_prefix_len = seq_len  # never past the written keys (the tail may be NaN)
    else:
        max_seq_prefix_len = tl.minimum(max_seq_prefix_len, seq_len)
    num_tiles = cdiv_fn(max_seq_prefix_len, TILE_SIZE)
    tile_start = 0
    tile_end = num_tiles
    # Unclamped prefix ranges override the window, so they need every tile.
    if SLIDING_WINDOW > 0 and (not USE_R_SWA) and ((not USE_MM_PREFIX) or MM_PREFIX_CLAMP_SW):
        first_q = context_len + q_block_local_idx * BLOCK_Q
        last_q = context_len + tl.minimum(
            q_block_local_idx * BLOCK_Q + (BLOCK_M - 1) // num_queries_per_kv,
            cur_batch_query_len - 1,
        )
        if CHUNK_LOOKBACK > -1:
            lo_key = (first_q // CHUNK_SIZE - CHUNK_LOOKBACK) * CHUNK_SIZE
        else:
            lo_key = first_q - SLIDING_WINDOW + 1
        hi_key = last_q
        if USE_PER_SEQ_CAUSAL or (not USE_CAUSAL):  # keys right of the query, in the window
            hi_key = last_q + SLIDING_WINDOW - 1
        if USE_MM_PREFIX and MM_PREFIX_CLAMP_SW:
            for i in range(MAX_MM_RANGES):
                entry = mm_prefix_range_ptr + (seq_idx * MAX_MM_RANGES + i) * 2
                range_start = tl.load(entry)
                range_end = tl.load(entry + 1)
                meets = (range_start < range_end) & (range_start <= last_q) & (range_end >= first_q)
                clamped_start = tl.maximum(range_start, first_q - SLIDING_WINDOW + 1)
                lo_key = tl.minimum(lo_key, tl.where(meets, clamped_start, lo_key))
                hi_key = tl.maximum(hi_key, tl.where(meets, range_end, hi_key))
        hi_key = tl.minimum(hi_key, seq_len - 1)
        tile_start = tl.maximum(0, lo_key // TILE_SIZE)
        tile_end = tl.minimum(hi_key // TILE_SIZE + 1, num_tiles)
    if IS_3D:
        loop_lo = tl.maximum(segm_idx_or_0 * tiles_per_segment_or_0, tile_start)
        loop_hi = tl.minimum((segm_idx_or_0 + 1) * tiles_per_segment_or_0, tile_end)
    else:
        loop_lo = tile_start
        loop_hi = tile_end
    return loop_lo, loop_hi, max_seq_prefix_len


@triton.jit
def query_tile_rows(
    tile_seq_ptr,
    tile_first_ptr,
    query_start_ptr,
    seq_lens_ptr,
    num_seqs,
    pid,
    kv_head,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Query tile ``pid`` of the paged kernels' grid and its ``BLOCK_M`` rows (``BLOCK_Q``
    query tokens x ``GROUP_PAD`` heads of KV head ``kv_head``): ``tile_seq`` maps a tile to its
    sequence (``>= num_seqs``: a dead tile, ``live`` False, its query length 0), ``tile_first``
    a sequence to its first tile. Returns ``live, seq, q_tile, q_start, q_len, seq_len, q_idx``
    (each row's query index in the sequence), ``row_ok`` and ``head`` (each row's query head)."""
    seq_raw = tl.load(tile_seq_ptr + pid)
    live = seq_raw < num_seqs
    seq = tl.minimum(seq_raw, num_seqs - 1)
    q_tile = pid - tl.load(tile_first_ptr + seq)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.where(live, tl.load(query_start_ptr + seq + 1) - q_start, 0)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    return live, seq, q_tile, q_start, q_len, seq_len, q_idx, row_ok, head
