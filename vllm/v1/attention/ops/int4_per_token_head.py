"""Triton writer and reader of the ``int4_per_token_head`` KV cache, at upstream v0.33's module
path, under its names (``reshape_and_cache_int4``, ``unified_attention_int4``, ``single_rht``).

The bytes are those of the reference codec :mod:`vllm.kv_quant.int4_per_token_head`: the writer
rotates in torch (as upstream does) and its kernel quantizes one (token, head) row per program,
every fp32 step rounded on its own (launched without FMA contraction). The reader is one fused
kernel (:func:`~.triton_packed_attention.packed_attention_kernel`) over the pages in place: each
tile's ``code - zp`` (exact in the dot dtype) meets the query rotated once (``RHT(q)``, rounded
back to its dtype as upstream), each key's scale multiplies its scores and each value's its
probabilities (fp16: its values), softmax scale ``softmax_scale / b``; the rotated-domain output,
in ``out``'s dtype, is rotated back once (``H(out) * s / b``), as upstream: attention over the
codec's decoded values, up to fp32 summation order.

Bytes per decoded (token, KV head): the two rows, ``2 * (D/2 + 4)`` (136 at D = 128); the
previous reader also wrote and re-read every referenced page as fp32, ``+ 4 * 4 * D`` (2184).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.kv_quant.formats import PER_TOKEN_HEAD_SCALE_BYTES
from vllm.kv_quant.index_tensor import check_integer_tensor
from vllm.kv_quant.int4_per_token_head import (
    INT4_QMAX,
    INT4_SCALE_FLOOR,
    int4_scale_words,
    rht_block_size,
    single_rht,
)
from vllm.triton_utils import tl, triton
from vllm.triton_utils.aot import TritonCompileCase, case_from_launch
from vllm.v1.attention.ops.triton_attention_plan import PagedAttentionLaunch
from vllm.v1.attention.ops.triton_packed_attention import (
    INT4_LAYOUT,
    launch_case,
    plan_packed_attention,
)

__all__ = [
    "int4_paged_attention",
    "reshape_and_cache_int4",
    "single_rht",
    "triton_compile_cases",
    "unified_attention_int4",
]

_NUM_WARPS = 4


@triton.jit
def _round_code(t):
    """Upstream's rounding, half away from zero, clamped to [0, 15]. Clamping to [-1, 16] first
    keeps the int cast defined (results past it clamp to 0 / 15 either way)."""
    t = tl.minimum(tl.maximum(t, -1.0), 16.0)
    r = tl.where(t >= 0, (t + 0.5).to(tl.int32), (t - 0.5).to(tl.int32))
    return tl.minimum(tl.maximum(r, 0), 15)


@triton.jit
def _int4_store_kernel(
    src_ptr,
    cache_ptr,
    scale_ptr,
    slot_ptr,
    src_tok,
    src_head,
    cache_blk,
    cache_slot,
    cache_head,
    scale_blk,
    scale_slot,
    scale_head,
    block_size,
    D: tl.constexpr,
    HALF_PADDED: tl.constexpr,
    QMAX: tl.constexpr,
    FLOOR: tl.constexpr,
):
    """One (token, head) row of rotated values -> D / 2 packed bytes + the scale word."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        j = tl.arange(0, HALF_PADDED)
        ok = j < D // 2
        base = src_ptr + tok.to(tl.int64) * src_tok + head * src_head
        even = tl.load(base + 2 * j, mask=ok, other=0.0).to(tl.float32)
        odd = tl.load(base + 2 * j + 1, mask=ok, other=0.0).to(tl.float32)
        lo = tl.minimum(
            tl.min(tl.where(ok, even, float("inf")), axis=0),
            tl.min(tl.where(ok, odd, float("inf")), axis=0),
        )
        hi = tl.maximum(
            tl.max(tl.where(ok, even, float("-inf")), axis=0),
            tl.max(tl.where(ok, odd, float("-inf")), axis=0),
        )
        # div_rn: Triton's `/` is div.full.f32 (not IEEE) on NVIDIA GPUs; the codec's bytes
        # need correctly rounded quotients (upstream's kernel uses `/`).
        scale = tl.maximum(tl.math.div_rn(hi - lo, tl.zeros_like(hi) + QMAX), FLOOR)
        zp = _round_code(tl.math.div_rn(-lo, scale))
        inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
        zpf = zp.to(tl.float32)
        q_even = _round_code(even * inv + zpf)
        q_odd = _round_code(odd * inv + zpf)
        packed = (q_even | (q_odd << 4)).to(tl.uint8)
        blk = slot // block_size
        pos = slot % block_size
        row = cache_ptr + blk * cache_blk + pos * cache_slot + head * cache_head
        tl.store(row + j, packed, mask=ok)
        word = (scale.to(tl.int32, bitcast=True) & -16) | zp
        tl.store(scale_ptr + blk * scale_blk + pos * scale_slot + head * scale_head, word)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_side(cache: torch.Tensor, scales: torch.Tensor, name: str, lead: list[int],
                head_size: int) -> None:  # fmt: skip
    _check(
        cache.dtype == torch.uint8 and cache.dim() == 4 and list(cache.shape[:3]) == lead
        and cache.shape[3] >= head_size // 2 and cache.stride(3) == 1,
        f"{name}: expected a uint8 {lead + [head_size // 2]} tensor (last dim >= "
        f"{head_size // 2}, unit last stride), got {cache.dtype} of shape {list(cache.shape)}",
    )  # fmt: skip
    scale_name = f"{name[0]}_scale_cache"
    _check(
        scales.dtype == torch.float32 and list(scales.shape) == lead,
        f"{scale_name}: expected a float32 tensor {lead}, got {scales.dtype} of shape "
        f"{list(scales.shape)}",
    )


def _store_launch(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor,
                  slot_mapping: torch.Tensor) -> tuple[tuple[int, int], list[Any],
                                                       dict[str, object]]:  # fmt: skip
    """Grid, runtime arguments and constexprs of one side's store (``x`` already rotated)."""
    head_size = x.shape[2]
    args: list[Any] = [
        x, cache, scales.view(torch.int32), slot_mapping,
        x.stride(0), x.stride(1), *cache.stride()[:3], *scales.stride(), cache.shape[1],
    ]  # fmt: skip
    constexprs: dict[str, object] = dict(
        D=head_size,
        HALF_PADDED=triton.next_power_of_2(head_size // 2),
        QMAX=INT4_QMAX,
        FLOOR=INT4_SCALE_FLOOR,
    )
    return (slot_mapping.shape[0], x.shape[1]), args, constexprs


def reshape_and_cache_int4(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
) -> None:
    """Rotate, quantize and write ``key [T_pad, H, D]`` / ``value [T_pad, H, Dv]`` (fp32 / fp16
    / bf16) token ``i`` into slot ``slot_mapping[i]`` (< 0: skipped) of ``key_cache [B, N, H,
    >= D/2]`` / ``value_cache`` (uint8; upstream passes its ``D/2 + 4``-byte rows, whose last 4
    bytes the scale caches view), scale words into ``k_scale_cache`` / ``v_scale_cache [B, N,
    H]`` fp32 (any strides). Bad arguments raise ``ValueError`` before anything is written."""
    for name, x in (("key", key), ("value", value)):
        _check(
            x.dim() == 3 and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and x.shape[2] > 0 and x.shape[2] % 2 == 0,
            f"{name}: expected a float32 / float16 / bfloat16 [T_pad, H, D] tensor with D even, "
            f"got {x.dtype} of shape {list(x.shape)}",
        )  # fmt: skip
    _check(
        value.shape[:2] == key.shape[:2],
        f"value: expected {list(key.shape[:2])} tokens and heads (key's), got {list(value.shape)}",
    )
    _check(key_cache.dim() == 4, f"key_cache: expected a 4-D tensor, got {list(key_cache.shape)}")
    lead = [key_cache.shape[0], key_cache.shape[1], key.shape[1]]
    _check_side(key_cache, k_scale_cache, "key_cache", lead, key.shape[2])
    _check_side(value_cache, v_scale_cache, "value_cache", lead, value.shape[2])
    check_integer_tensor("slot_mapping", slot_mapping)
    _check(
        slot_mapping.dim() == 1 and slot_mapping.shape[0] <= key.shape[0],
        f"slot_mapping: expected [T] with T <= {key.shape[0]}, got {list(slot_mapping.shape)}",
    )
    num_slots = lead[0] * lead[1]
    top = int(slot_mapping.max()) if slot_mapping.numel() else -1
    _check(top < num_slots, f"slot_mapping: expected slots < {num_slots} (B * N), got {top}")
    for x, cache, scales in ((key, key_cache, k_scale_cache), (value, value_cache, v_scale_cache)):
        rotated = single_rht(x.float()).to(x.dtype)
        grid, args, constexprs = _store_launch(rotated, cache, scales, slot_mapping)
        _int4_store_kernel[grid](*args, **constexprs, num_warps=_NUM_WARPS,
                                 enable_fp_fusion=False)  # fmt: skip


def _plan(
    out: torch.Tensor,
    rotated_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    softmax_scale: float,
    max_query_len: int,
    max_seq_len: int,
    **options: Any,
) -> PagedAttentionLaunch:
    """The fused launch over the INT4 sides in place (rotated-domain output into ``out``),
    the scale words read as int32 (zero point in the low 4 bits)."""
    return plan_packed_attention(
        out, rotated_q, k_cache, v_cache, k_scale_cache.view(torch.int32),
        v_scale_cache.view(torch.int32), None, INT4_LAYOUT, block_table, seq_lens,
        query_start_loc, softmax_scale, max_query_len, max_seq_len, **options,
    )  # fmt: skip


def int4_paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
    *,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    softmax_scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool | torch.Tensor = True,
    num_splits: int | None = 1,
    mm_prefix_range: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_sqrt: bool = False,
    qq_bias: torch.Tensor | None = None,
) -> None:
    """Attention of ``q [T, Hq, D]`` over an INT4 cache ``k_cache (B, N, Hkv, >= D/2)`` /
    ``v_cache (B, N, Hkv, >= Dv/2)`` uint8 with scale words ``[B, N, Hkv]`` fp32, into
    ``out [T, Hq, Dv]``; the other arguments as
    :func:`~vllm.v1.attention.ops.triton_attention_plan.plan_paged_attention`'s (sliding window
    in keys, ``None``: off; ``num_splits`` ``None``: chosen for the GPU). The block table's
    entries for the keys read must be pages of the cache (read in place). Shared by
    :func:`unified_attention_int4` (causal, one split) and the ``TRITON_ATTN`` backend.

    ``q`` is rotated (and rounded back to its dtype, as upstream), ``softmax_scale`` divided by
    ``D``'s block ``b`` (the rotation's norm squared); the output, computed in V's rotated
    domain into ``out``'s dtype, is rotated back and divided by ``Dv``'s block."""
    _check(
        q.dim() == 3 and q.dtype in (torch.float32, torch.float16, torch.bfloat16),
        f"q: expected a float32 / float16 / bfloat16 [T, Hq, D] tensor, got {q.dtype} of shape "
        f"{list(q.shape)}",
    )
    _check(
        out.dim() == 3 and out.shape[:2] == q.shape[:2] and out.shape[2] > 0,
        f"out: expected [{q.shape[0]}, {q.shape[1]}, Dv], got shape {list(out.shape)}",
    )
    head_size, head_size_v = q.shape[2], out.shape[2]
    _check(k_cache.dim() == 4, f"k_cache: expected a 4-D tensor, got {list(k_cache.shape)}")
    lead = list(k_cache.shape[:3])
    _check_side(k_cache, k_scale_cache, "k_cache", lead, head_size)
    _check_side(v_cache, v_scale_cache, "v_cache", lead, head_size_v)
    rotated_q = single_rht(q.float()).to(q.dtype)
    # Upstream's kernel stores the rotated output in out's dtype before rotating it back.
    # Zeros: a split-K launch leaves the rows of sequences without keys unwritten.
    rotated_out = torch.zeros_like(out)
    _plan(
        rotated_out, rotated_q, k_cache, v_cache, k_scale_cache, v_scale_cache, block_table,
        seq_lens, query_start_loc, softmax_scale / rht_block_size(head_size), max_query_len,
        max_seq_len, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        sinks=sinks, causal=causal, num_splits=num_splits, mm_prefix_range=mm_prefix_range,
        alibi_slopes=alibi_slopes, alibi_sqrt=alibi_sqrt, qq_bias=qq_bias,
    )()  # fmt: skip
    rotated = single_rht(rotated_out.float(), inverse=True)
    out.copy_((rotated / rht_block_size(head_size_v)).to(out.dtype))


def unified_attention_int4(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    seqused_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    window_size: tuple[int, int],
    block_table: torch.Tensor,
    softcap: float,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    use_alibi_sqrt: bool,
    qq_bias: torch.Tensor | None,
    output_scale: torch.Tensor | None,
    mm_prefix_range: torch.Tensor | None,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
    seq_threshold_3D: int | None = None,
    num_par_softmax_segments: int | None = None,
    softmax_segm_output: torch.Tensor | None = None,
    softmax_segm_max: torch.Tensor | None = None,
    softmax_segm_expsum: torch.Tensor | None = None,
) -> None:
    """Causal paged attention over an INT4 cache ``k_cache`` / ``v_cache (B, N, Hkv, >= D/2)``
    uint8 with scale words ``[B, N, Hkv]`` fp32, into ``out [T, Hq, D]``; the other arguments
    as :func:`~vllm.v1.attention.ops.triton_unified_attention.unified_attention`'s
    (:func:`int4_paged_attention` does the work).

    The pages are read in place in one unsplit launch: the split-K arguments only shape
    upstream's own launch, the result is the same function. ``output_scale`` (an
    FP8 output) is refused: upstream applies it before the inverse rotation, which leaves the
    rotated output's clamp in the result."""
    _check(output_scale is None, "output_scale: expected None for int4_per_token_head (no FP8 "
           f"output), got a {type(output_scale).__name__}")  # fmt: skip
    int4_paged_attention(
        out, q, k_cache, v_cache, k_scale_cache, v_scale_cache, block_table=block_table,
        seq_lens=seqused_k, query_start_loc=cu_seqlens_q, softmax_scale=softmax_scale,
        max_query_len=max_seqlen_q, max_seq_len=max_seqlen_k,
        sliding_window=window_size[0] + 1 if window_size[0] >= 0 else None,
        logits_soft_cap=softcap if softcap > 0 else None, sinks=sinks,
        mm_prefix_range=mm_prefix_range, alibi_slopes=alibi_slopes,
        alibi_sqrt=use_alibi_sqrt, qq_bias=qq_bias,
    )  # fmt: skip


def triton_compile_cases() -> list[TritonCompileCase]:
    """The store at head sizes 128 and 96 (bf16 source, upstream's ``D/2 + 4``-byte rows) and
    the fused reader's bf16 decode at 128, block size 16 (more of its specialisations:
    :mod:`~.triton_packed_attention`'s cases)."""
    cases = []
    for d in (128, 96):
        x = torch.zeros(1, 2, d, dtype=torch.bfloat16)
        cache = torch.zeros(1, 16, 2, d // 2 + PER_TOKEN_HEAD_SCALE_BYTES, dtype=torch.uint8)
        scales = torch.zeros(1, 16, 2)
        _, args, constexprs = _store_launch(x, cache, scales, torch.zeros(1, dtype=torch.int64))
        cases.append(case_from_launch(f"store/d{d}", _int4_store_kernel, args, constexprs,
                                      num_warps=_NUM_WARPS, enable_fp_fusion=False))  # fmt: skip
    # The fused reader: a bf16 decode batch (2 sequences, GQA 4, 2 key splits), D = 128.
    cache = torch.zeros(2, 16, 2, 68, dtype=torch.uint8)
    words = int4_scale_words(cache, 128)
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    launch = _plan(
        torch.zeros_like(q), q, cache, cache, words, words, torch.zeros(2, 2, dtype=torch.int32),
        torch.full((2,), 32, dtype=torch.int32), torch.arange(3, dtype=torch.int32), 0.1, 1, 32,
        num_splits=2,
    )  # fmt: skip
    cases.append(launch_case("decode/d128", launch))
    return cases
