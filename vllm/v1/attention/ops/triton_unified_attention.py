"""Upstream vLLM's Triton ``unified_attention`` entry point over this library's paged caches.

:func:`unified_attention` checks upstream's arguments and runs
:func:`~vllm.v1.attention.ops.triton_attention_plan.plan_paged_attention` (this library's
caches by ``kv_cache_dtype``), launching through this module's :data:`kernel_unified_attention`
and :data:`reduce_segments` (upstream's names, which callers and tests may wrap). Kernels:
:mod:`vllm.v1.attention.ops.triton_paged_attention`; helpers:
:mod:`vllm.v1.attention.ops.triton_attention_helpers`.
"""

from __future__ import annotations

import os

import torch

from vllm.kv_quant import ScaleLayout, kv_scale_as_1d
from vllm.kv_quant.formats import (
    AUTO,
    CacheKind,
    KVQuantMode,
    format_for_storage,
    format_of_kind,
    lookup,
)
from vllm.kv_quant.index_tensor import check_integer_tensor
from vllm.triton_utils import triton
from vllm.v1.attention.ops.int4_per_token_head import unified_attention_int4
from vllm.v1.attention.ops.triton_attention_plan import (
    _QUERY_DTYPES,
    MAX_SPLITS,
    FP32Staging,
    PagedAttentionLaunch,
    SegmentScratch,
    _side,
    choose_num_splits,
    kernel_format,
    plan_paged_attention,
)
from vllm.v1.attention.ops.triton_attention_reduce import reduce_segments
from vllm.v1.attention.ops.triton_paged_attention import paged_attention_kernel

__all__ = [
    "MAX_3D_QUERY_LEN",
    "MAX_SPLITS",
    "FP32Staging",
    "PagedAttentionLaunch",
    "SegmentScratch",
    "_side",
    "choose_num_splits",
    "kernel_format",
    "kernel_unified_attention",
    "plan_paged_attention",
    "reduce_segments",
    "unified_attention",
]

kernel_unified_attention = paged_attention_kernel
"""Upstream's name of the attention kernel (one kernel for the 2D and the split-K launch,
told apart by its ``IS_3D`` constexpr)."""

is_batch_invariant = os.environ.get("VLLM_BATCH_INVARIANT", "0").strip() not in ("", "0")
"""Batch-invariant mode (``VLLM_BATCH_INVARIANT`` set, not 0, at import): no split-K, so a
row's result does not depend on the batch around it."""

MAX_3D_QUERY_LEN = 8
"""Longest query per sequence (e.g. 1 + speculative tokens) that the split-K launch takes."""


def _upstream_format(k: torch.Tensor, kv_quant_mode: KVQuantMode) -> str:
    """The ``kv_cache_dtype`` of upstream-style arguments: the registry's format of
    ``kv_quant_mode`` stored as the cache's torch dtype (one-byte caches without a mode are
    FP8, the float8 dtype naming the variant)."""
    mode = KVQuantMode(kv_quant_mode)
    if k.dtype in _QUERY_DTYPES and not mode.is_quantized:
        return AUTO.name
    if k.dtype.itemsize != 1:
        raise ValueError(
            f"k: expected a float16 / bfloat16 / float32 / float8 / uint8 cache for "
            f"kv_quant_mode={mode.name}, got {k.dtype}"
        )
    if k.dtype == torch.float8_e5m2:
        return format_of_kind(CacheKind.FP8_E5M2).name
    fp8 = KVQuantMode.FP8_PER_TENSOR
    return format_for_storage(mode if mode.is_quantized else fp8, k.dtype).name


def _descale(x: torch.Tensor | None, name: str, num_kv_heads: int) -> torch.Tensor:
    """fp32 ``[1]`` / ``[Hkv]`` scale from upstream's descale argument (``None``: 1; a
    ``[num_seqs, Hkv]`` expansion: its first row)."""
    if x is None:
        return torch.ones(1, dtype=torch.float32)
    if isinstance(x, torch.Tensor) and x.dim() == 2:
        x = x[0]
    return kv_scale_as_1d(x, name, num_kv_heads)


def _check_scalar_scale(name: str, x: torch.Tensor | None) -> None:
    if x is not None and (not isinstance(x, torch.Tensor) or x.numel() != 1):
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected None or a one-element float32 tensor, got {got}")


def _check_bias_args(
    q: torch.Tensor,
    seqused_k: torch.Tensor,
    max_seqlen_q: int,
    alibi_slopes: torch.Tensor | None,
    use_alibi_sqrt: bool,
    qq_bias: torch.Tensor | None,
    rswa_prefix_lens: torch.Tensor | None,
    rswa_window: int | None,
) -> None:
    """``ValueError`` / ``TypeError`` for a malformed ALiBi, q/q-bias or R-SWA argument."""

    def got(x: object) -> str:
        if not isinstance(x, torch.Tensor):
            return type(x).__name__
        return f"{x.dtype} of shape {list(x.shape)} on {x.device}"

    floats = (torch.float32, torch.float16, torch.bfloat16)
    heads, device = q.shape[1], q.device
    if alibi_slopes is not None and not (
        isinstance(alibi_slopes, torch.Tensor)
        and alibi_slopes.dtype in floats
        and alibi_slopes.shape == (heads,)
        and alibi_slopes.device == device
    ):
        raise ValueError(
            f"alibi_slopes: expected a float32 / float16 / bfloat16 [{heads}] (Hq) tensor on "
            f"{device}, got {got(alibi_slopes)}"
        )
    if not isinstance(use_alibi_sqrt, bool):
        raise TypeError(f"use_alibi_sqrt: expected a bool, got {type(use_alibi_sqrt).__name__}")
    if qq_bias is not None and not (
        isinstance(qq_bias, torch.Tensor)
        and qq_bias.dtype in floats
        and qq_bias.dim() == 2
        and qq_bias.shape[0] >= max_seqlen_q
        and qq_bias.device == device
        and qq_bias.stride(1) == 1
    ):
        raise ValueError(
            f"qq_bias: expected a float32 / float16 / bfloat16 [>= {max_seqlen_q}, C] tensor "
            f"(query rows x the sequence's query tokens, unit last stride) on {device}, got "
            f"{got(qq_bias)}"
        )
    if rswa_prefix_lens is not None:
        check_integer_tensor("rswa_prefix_lens", rswa_prefix_lens)
        if rswa_prefix_lens.shape != seqused_k.shape or rswa_prefix_lens.device != seqused_k.device:
            raise ValueError(
                f"rswa_prefix_lens: expected an integer {list(seqused_k.shape)} (num_seqs) "
                f"tensor on {seqused_k.device}, got {got(rswa_prefix_lens)}"
            )
    if rswa_window is not None and (
        isinstance(rswa_window, bool) or not isinstance(rswa_window, int) or rswa_window < 1
    ):
        raise ValueError(f"rswa_window: expected None or a positive int, got {rswa_window!r}")


def _use_3d(
    q: torch.Tensor,
    k: torch.Tensor,
    max_seqlen_q: int,
    num_seqs: int,
    causal: bool | torch.Tensor,
    mm_prefix: bool,
    seq_threshold_3D: int | None,
    num_par_softmax_segments: int | None,
    scratch: tuple[torch.Tensor | None, ...],
) -> bool:
    """Upstream's rule for the split-K launch: a threshold, a segment count and the three
    scratch buffers are given; the queries are decodes, or causal (one flag for all), without
    prefix ranges and at most :data:`MAX_3D_QUERY_LEN` long; the query blocks of all
    sequences (this launch's decode tiling) are at most ``seq_threshold_3D``; not
    batch-invariant; scratch rows for every query token."""
    if seq_threshold_3D is None or num_par_softmax_segments is None or None in scratch:
        return False
    per_seq = isinstance(causal, torch.Tensor)
    multi = max_seqlen_q > 1
    if multi and (max_seqlen_q > MAX_3D_QUERY_LEN or per_seq or mm_prefix or not causal):
        return False
    group_pad = triton.next_power_of_2(q.shape[1] // k.shape[2])
    block_q = max(16, group_pad) // group_pad  # choose_tiling's decode rows
    if num_seqs * triton.cdiv(max_seqlen_q, block_q) > seq_threshold_3D or is_batch_invariant:
        return False
    segm_max = scratch[1]
    assert segm_max is not None
    return segm_max.shape[0] >= q.shape[0]


def unified_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    seqused_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool | torch.Tensor,
    window_size: tuple[int, int],
    block_table: torch.Tensor,
    softcap: float,
    q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    seq_threshold_3D: int | None = None,
    num_par_softmax_segments: int | None = None,
    softmax_segm_output: torch.Tensor | None = None,
    softmax_segm_max: torch.Tensor | None = None,
    softmax_segm_expsum: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    output_scale: torch.Tensor | None = None,
    qq_bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    mm_prefix_range: torch.Tensor | None = None,
    rswa_prefix_lens: torch.Tensor | None = None,
    rswa_window: int | None = None,
    use_alibi_sqrt: bool = False,
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    chunk_lookback: int = -1,
    use_td: bool = False,
    mm_prefix_clamp_sliding_window: bool = False,
    *,
    kv_cache_dtype: str | None = None,
    k_scale_layout: ScaleLayout | str | None = None,
    v_scale_layout: ScaleLayout | str | None = None,
    rope_cos_sin: torch.Tensor | None = None,
    rope_is_neox: bool = True,
    key_offset: torch.Tensor | None = None,
    sink_keys: torch.Tensor | None = None,
    key_hadamard: bool = False,
) -> None:
    """Upstream vLLM's ``unified_attention`` over this library's paged caches.

    ``q [T, Hq, D]`` (fp16 / bf16 / fp32, or float8_e4m3fn dequantized by ``q_descale``, fp32
    ``[1]``; ``q_descale`` is unread for other queries, as upstream's); ``out [T, Hq, Dv]``
    (those float dtypes, or float8_e4m3fn); ``output_scale`` (fp32 ``[1]``) divides the
    output, clamped to e4m3's range. ``k`` / ``v`` ``(B, N, Hkv, D')`` cache sides;
    ``cu_seqlens_q [num_seqs + 1]``, ``seqused_k [num_seqs]`` keys per sequence,
    ``block_table [num_seqs, max_pages]``; ``window_size (left, right)``: ``(-1, -1)`` or
    ``(W - 1, 0)`` for a window of W keys; ``softcap`` 0 for none; ``k_descale`` /
    ``v_descale`` the FP8 (NVFP4: global) scales, ``[1]``, ``[Hkv]`` or ``[num_seqs, Hkv]``
    (its first row). The format comes from ``kv_cache_dtype`` when given, else from
    ``k.dtype`` and ``kv_quant_mode`` (per-token-head: separate fp32 scale caches ``[B, N,
    Hkv]`` when ``k_scale_cache`` / ``v_scale_cache`` are given, else the inline scales of
    this library's rows).

    Split-K (``IS_3D``: ``num_par_softmax_segments`` segments in the ``softmax_segm_*``
    buffers, then :data:`reduce_segments`) by upstream's rule (:func:`_use_3d`); otherwise
    one 2D launch. ``use_td``: tensor-descriptor tile loads (unquantized / FP8 caches, block
    sizes a multiple of 16). Keys stored before RoPE / key sinks: the keyword-only
    ``rope_cos_sin`` .. ``key_hadamard`` of :func:`plan_paged_attention`, which also describes
    ``chunk_lookback`` and the prefix-LM ``mm_prefix_range`` (``[num_seqs, R, 2]``).
    ``alibi_slopes [Hq]`` (``use_alibi_sqrt``: the square-root variant), ``qq_bias`` and R-SWA
    (``rswa_prefix_lens [num_seqs]`` and ``rswa_window``, used when both are given, as
    upstream's) as :func:`plan_paged_attention` describes them.
    ``causal`` may be per sequence (a ``[num_seqs]`` bool / integer tensor, non-zero: causal).
    """
    if kv_quant_mode == KVQuantMode.INT4_PER_TOKEN_HEAD and kv_cache_dtype is None:
        if isinstance(causal, torch.Tensor) or not causal:
            raise ValueError(f"causal: expected True for INT4_PER_TOKEN_HEAD, got {causal!r}")
        if k_scale_cache is None or v_scale_cache is None:
            raise ValueError("k_scale_cache, v_scale_cache: expected both for INT4_PER_TOKEN_HEAD")
        unified_attention_int4(
            q, k, v, out, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
            seqused_k=seqused_k, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
            window_size=window_size, block_table=block_table, softcap=softcap, sinks=sinks,
            alibi_slopes=alibi_slopes, use_alibi_sqrt=use_alibi_sqrt, qq_bias=qq_bias,
            output_scale=output_scale, mm_prefix_range=mm_prefix_range,
            k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache,
            seq_threshold_3D=seq_threshold_3D, num_par_softmax_segments=num_par_softmax_segments,
            softmax_segm_output=softmax_segm_output, softmax_segm_max=softmax_segm_max,
            softmax_segm_expsum=softmax_segm_expsum,
        )  # fmt: skip
        return
    window = window_size[0] + 1 if window_size[0] >= 0 else 0
    if window and chunk_lookback > -1 and window // (chunk_lookback + 1) <= 0:
        raise ValueError(
            f"chunk_lookback: expected -1 or less than the window of {window} keys minus 1, "
            f"got {chunk_lookback}"
        )
    if q.dim() != 3 or q.dtype not in (*_QUERY_DTYPES, torch.float8_e4m3fn) or q.stride(-1) != 1:
        raise ValueError(
            f"q: expected a [T, Hq, D] float16 / bfloat16 / float32 / float8_e4m3fn tensor "
            f"with unit last stride, got {q.dtype} of shape {list(q.shape)}"
        )
    out_dtypes = (*_QUERY_DTYPES, torch.float8_e4m3fn)
    if out.dim() != 3 or out.shape[:2] != q.shape[:2] or out.dtype not in out_dtypes:
        raise ValueError(
            f"out: expected [{q.shape[0]}, {q.shape[1]}, Dv] in float16 / bfloat16 / float32 / "
            f"float8_e4m3fn, got {out.dtype} of shape {list(out.shape)}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"out: expected a unit last stride, got strides {out.stride()}")
    _check_scalar_scale("q_descale", q_descale)
    _check_scalar_scale("output_scale", output_scale)
    if k.dim() != 4 or v.dim() != 4 or q.shape[1] % k.shape[2] != 0:
        raise ValueError(
            f"k: expected (B, N, Hkv, D') sides with Hq={q.shape[1]} a multiple of Hkv, got "
            f"{list(k.shape)} and {list(v.shape)}"
        )
    if len(window_size) != 2 or window_size[1] not in (-1, 0):
        raise ValueError(f"window_size: expected (-1, -1) or (W - 1, 0), got {window_size}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(
            f"block_table: expected an int32 [num_seqs, max_pages] tensor, got "
            f"{block_table.dtype} of shape {list(block_table.shape)}"
        )
    check_integer_tensor("cu_seqlens_q", cu_seqlens_q)
    check_integer_tensor("seqused_k", seqused_k)
    num_seqs = seqused_k.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(
            f"cu_seqlens_q: expected shape [{num_seqs + 1}] (num_seqs + 1), got "
            f"{list(cu_seqlens_q.shape)}"
        )
    if isinstance(causal, torch.Tensor) and (
        causal.shape != seqused_k.shape or causal.is_floating_point() or causal.is_complex()
    ):
        raise ValueError(
            f"causal: expected a bool or a bool / integer tensor of shape "
            f"{list(seqused_k.shape)} (one flag per sequence), got {causal.dtype} of shape "
            f"{list(causal.shape)}"
        )
    if mm_prefix_range is not None and (
        mm_prefix_range.dim() != 3
        or mm_prefix_range.shape[0] != num_seqs
        or mm_prefix_range.shape[2] != 2
        or mm_prefix_range.is_floating_point()
    ):
        raise ValueError(
            f"mm_prefix_range: expected an integer [{num_seqs}, R, 2] tensor (num_seqs, ranges, "
            f"inclusive start / end), got {mm_prefix_range.dtype} of shape "
            f"{list(mm_prefix_range.shape)}"
        )
    _check_bias_args(
        q,
        seqused_k,
        max_seqlen_q,
        alibi_slopes,
        use_alibi_sqrt,
        qq_bias,
        rswa_prefix_lens,
        rswa_window,
    )
    use_rswa = rswa_prefix_lens is not None and rswa_window is not None
    name = kv_cache_dtype or _upstream_format(k, kv_quant_mode)
    fmt = lookup(name, include_mla_only=False)
    num_kv_heads = k.shape[2]
    if fmt.is_per_token_head and (k_scale_cache is None) != (v_scale_cache is None):
        raise ValueError("k_scale_cache, v_scale_cache: expected both or neither")
    scratch = (softmax_segm_output, softmax_segm_max, softmax_segm_expsum)
    use_3d = _use_3d(
        q,
        k,
        max_seqlen_q,
        num_seqs,
        causal,
        mm_prefix_range is not None,
        seq_threshold_3D,
        num_par_softmax_segments,
        scratch,
    )
    if use_3d and not 1 <= int(num_par_softmax_segments or 0) <= MAX_SPLITS:
        raise ValueError(
            f"num_par_softmax_segments: expected 1..{MAX_SPLITS}, got {num_par_softmax_segments}"
        )
    launch = plan_paged_attention(
        out,
        q,
        k if k.dtype in _QUERY_DTYPES else k.view(torch.uint8),
        v if v.dtype in _QUERY_DTYPES else v.view(torch.uint8),
        block_table,
        seqused_k,
        cu_seqlens_q,
        name,
        _descale(k_descale, "k_descale", num_kv_heads),
        _descale(v_descale, "v_descale", num_kv_heads),
        softmax_scale,
        max_seqlen_q,
        max_seqlen_k,
        sliding_window=window_size[0] + 1 if window_size[0] >= 0 else None,
        logits_soft_cap=softcap if softcap > 0 else None,
        sinks=sinks,
        causal=causal,
        k_scale_layout=k_scale_layout,
        v_scale_layout=v_scale_layout,
        k_scale_cache=k_scale_cache,
        v_scale_cache=v_scale_cache,
        num_splits=num_par_softmax_segments if use_3d else 1,
        rope_cos_sin=rope_cos_sin,
        rope_is_neox=rope_is_neox,
        key_offset=key_offset,
        sink_keys=sink_keys,
        key_hadamard=key_hadamard,
        q_scale=q_descale if q.dtype == torch.float8_e4m3fn else None,
        output_scale=output_scale,
        segment_scratch=SegmentScratch(*scratch) if use_3d else None,  # type: ignore[arg-type]
        use_td=use_td,
        chunk_lookback=chunk_lookback if window else -1,
        mm_prefix_range=mm_prefix_range,
        mm_prefix_clamp_sliding_window=mm_prefix_clamp_sliding_window,
        alibi_slopes=alibi_slopes,
        alibi_sqrt=use_alibi_sqrt,
        qq_bias=qq_bias,
        rswa_prefix_lens=rswa_prefix_lens if use_rswa else None,
        rswa_window=rswa_window if use_rswa else None,
    )
    launch.kernel = kernel_unified_attention
    launch.reducer = reduce_segments
    launch()
