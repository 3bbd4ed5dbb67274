"""Split-K epilogue of the Triton paged attention: :func:`reduce_segments` (upstream vLLM's
kernel name and signature) combines the per-segment partial softmax results of
:func:`~.triton_paged_attention.paged_attention_kernel`'s ``IS_3D`` launch, and
:func:`store_output` writes either kernel's output in its dtype (e4m3 bytes included)."""

from __future__ import annotations

from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_attention_helpers import cdiv_fn, find_seq_idx
from vllm.v1.attention.ops.triton_kv_encode import f32_to_e4m3

E4M3_MAX = tl.constexpr(448.0)
"""Largest finite float8_e4m3fn value: scaled FP8 outputs are clamped to +-it."""


@triton.jit
def store_output(base_ptr, offsets, x, mask):
    """Store fp32 ``x`` at ``base_ptr + offsets`` in the output's dtype; an e4m3 output (its
    bytes, or a float8e4nv pointer) takes :func:`~.triton_kv_encode.f32_to_e4m3`'s rounding
    (to nearest even, saturating), which needs no fp8 type (sm_80 has none)."""
    out_ty: tl.constexpr = base_ptr.dtype.element_ty
    if out_ty == tl.uint8 or out_ty == tl.float8e4nv:  # noqa: SIM109 (Triton compiles no `in`)
        bits = f32_to_e4m3(x).to(tl.uint8)
        if out_ty == tl.float8e4nv:
            bits = bits.to(tl.float8e4nv, bitcast=True)
        tl.store(base_ptr + offsets, bits, mask=mask)
    else:
        tl.store(base_ptr + offsets, x.to(out_ty), mask=mask)


@triton.jit
def reduce_segments(
    output_ptr,
    segm_output_ptr,
    segm_max_ptr,
    segm_expsum_ptr,
    seq_lens_ptr,
    num_seqs,
    num_query_heads: tl.constexpr,
    out_scale_inv,
    output_stride_0,
    output_stride_1,
    block_table_stride,
    TILE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    query_start_len_ptr,
    BLOCK_Q: tl.constexpr,
    NUM_SEGMENTS_PER_SEQ: tl.constexpr,
    USE_FP8: tl.constexpr,
):
    """Grid ``(tokens, num_query_heads)``: the attention output of one query token and head
    from the ``NUM_SEGMENTS_PER_SEQ`` segments of its sequence (upstream's signature and
    scratch layout; ``block_table_stride`` and ``BLOCK_Q`` are unread).

    ``segm_output [T, Hq, NUM_SEGMENTS_PER_SEQ, HEAD_SIZE_PADDED]``, ``segm_max`` /
    ``segm_expsum [T, Hq, NUM_SEGMENTS_PER_SEQ]``, fp32, contiguous: each segment's
    unnormalised sums, running max (natural-log units) and sum over its ``ceil(seq_len /
    (NUM_SEGMENTS_PER_SEQ * TILE_SIZE))`` tiles of ``TILE_SIZE`` keys. ``out = sum_s acc_s
    e^(m_s - M) / sum_s l_s e^(m_s - M)``, ``M`` the largest maximum of a segment that saw a key
    (max finite, sum > 0); no such segment: 0. ``USE_FP8``: times ``out_scale_inv`` (an fp32
    ``[1]`` pointer), clamped to e4m3's range. Tokens past ``query_start_len[num_seqs]`` (graph
    padding) and sequences without keys are left unwritten."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_len_ptr + num_seqs):
        return
    seq = find_seq_idx(query_start_len_ptr, token, num_seqs, BLOCK_Q, False)
    seq_len = tl.load(seq_lens_ptr + seq)
    if seq_len <= 0:
        return
    per_segment = cdiv_fn(seq_len, NUM_SEGMENTS_PER_SEQ * TILE_SIZE)
    used = cdiv_fn(seq_len, per_segment * TILE_SIZE)  # later segments were never written
    row = token.to(tl.int64) * num_query_heads + head
    m_all = float("-inf")
    for s in range(NUM_SEGMENTS_PER_SEQ):
        m = tl.load(segm_max_ptr + row * NUM_SEGMENTS_PER_SEQ + s)
        l_s = tl.load(segm_expsum_ptr + row * NUM_SEGMENTS_PER_SEQ + s)
        seen = (s < used) & (l_s > 0.0) & (m > float("-inf"))
        m_all = tl.maximum(m_all, tl.where(seen, m, float("-inf")))
    d = tl.arange(0, HEAD_SIZE_PADDED)
    d_ok = d < HEAD_SIZE
    total = 0.0
    acc = tl.zeros([HEAD_SIZE_PADDED], dtype=tl.float32)
    for s in range(NUM_SEGMENTS_PER_SEQ):
        part = row * NUM_SEGMENTS_PER_SEQ + s
        m = tl.load(segm_max_ptr + part)
        l_s = tl.load(segm_expsum_ptr + part)
        seen = (s < used) & (l_s > 0.0) & (m > float("-inf"))
        weight = tl.where(seen, tl.exp(m - m_all), 0.0)
        total += l_s * weight
        seen_d = d_ok & ((d * 0 + seen.to(tl.int32)) != 0)  # unwritten scratch may be NaN
        seg = tl.load(segm_output_ptr + part * HEAD_SIZE_PADDED + d, mask=seen_d, other=0.0)
        acc += seg * weight
    out = tl.where(total > 0.0, acc / tl.where(total > 0.0, total, 1.0), 0.0)
    if USE_FP8:
        out = tl.clamp(out * tl.load(out_scale_inv), -E4M3_MAX, E4M3_MAX)
    offsets = token * output_stride_0 + head * output_stride_1 + d
    store_output(output_ptr, offsets, out, d_ok)
