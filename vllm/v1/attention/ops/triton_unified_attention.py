"""Host side of the Triton paged attention: :func:`plan_paged_attention` (this library's
caches, named by ``kv_cache_dtype``; the plan is called to run) and upstream's
:func:`unified_attention` signature over it.

Kernels: :mod:`vllm.v1.attention.ops.triton_paged_attention`; format decoders:
:mod:`vllm.v1.attention.ops.triton_kv_decode`. Every cache side is a 4-D ``(B, N, H, D')`` view
with any page / token / head strides (NHD, HND, one side of a 5-D cache); scales are fp32
``[1]`` or ``[H]``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch

from vllm.kv_quant import ScaleLayout, kv_scale_as_1d
from vllm.kv_quant.formats import (
    AUTO,
    CacheKind,
    KVCacheFormat,
    KVQuantMode,
    format_for_storage,
    format_of_kind,
    lookup,
)
from vllm.kv_quant.index_tensor import check_integer_tensor
from vllm.triton_utils import row_alignment, triton, triton_interpreted
from vllm.utils.torch_utils import nvfp4_split_data_scale
from vllm.v1.attention.ops.triton_key_rebuild import key_rebuild_args
from vllm.v1.attention.ops.triton_paged_attention import (
    PIPELINE_STAGES,
    TILE_N,
    choose_tiling,
    merge_splits_kernel,
    paged_attention_kernel,
)

MAX_SPLITS = 32
"""Most key splits of one query tile (split-K): a batch-1 decode over 8 KV heads fills twice
the 132 SMs of an H100 (256 programs of 256 keys at 8k context), so more of the cache is in
flight at once; the partial sums it costs are 1-2 % of a bf16 cache read there."""

_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _Side(NamedTuple):
    """Kernel arguments of one cache side: the tensor its data pointer comes from, its
    ``(page, token, head)`` strides, and the auxiliary tensor (NVFP4 scale view, per-token-head
    scales) with its strides."""

    data: torch.Tensor
    strides: tuple[int, int, int]
    aux: torch.Tensor
    aux_strides: tuple[int, int, int]
    interleave4: bool

    @property
    def row_align(self) -> int:
        """:func:`~vllm.triton_utils.row_alignment` of this side's rows and inline scales (both
        pointers, the ``(page, token, head)`` strides); only the per-token-head decoders read
        it."""
        return row_alignment(self.data.data_ptr(), self.aux.data_ptr(), *self.strides)


def kernel_format(fmt: KVCacheFormat) -> CacheKind:
    """The kernels' ``FORMAT`` constant for a cache of ``fmt``: its row encoding."""
    if fmt.cache_kind is None:
        raise ValueError(f"kv_cache_dtype: expected a format TRITON_ATTN reads, got {fmt.name!r}")
    return fmt.cache_kind


def _side(
    side: torch.Tensor,
    kind: CacheKind,
    head_size: int,
    layout: ScaleLayout,
    scale_cache: torch.Tensor | None,
) -> _Side:
    """Kernel arguments of ``side (B, N, H, D')`` of row encoding ``kind`` (bf16 pages are
    read as their int16 bits)."""
    strides = (side.stride(0), side.stride(1), side.stride(2))
    if kind is CacheKind.NVFP4:
        data, scale = nvfp4_split_data_scale(side)
        scale = scale.view(torch.uint8)
        return _Side(
            data,
            (data.stride(0), data.stride(1), data.stride(2)),
            scale,
            (scale.stride(0), scale.stride(1), scale.stride(2)),
            layout is ScaleLayout.INTERLEAVE4,
        )
    if kind in (CacheKind.INT8_PER_TOKEN_HEAD, CacheKind.FP8_PER_TOKEN_HEAD):
        raw = side.view(torch.uint8)
        if scale_cache is None:  # inline: 4 scale bytes after each row's values
            return _Side(raw, strides, raw[..., head_size:], strides, False)
        aux = (scale_cache.stride(0), scale_cache.stride(1), scale_cache.stride(2))
        return _Side(raw, strides, scale_cache, aux, False)
    if side.dtype == torch.bfloat16:
        return _Side(side.view(torch.int16), strides, side, (0, 0, 0), False)
    if kind in (CacheKind.FP8_E4M3, CacheKind.FP8_E5M2):
        return _Side(side.view(torch.uint8), strides, side, (0, 0, 0), False)
    return _Side(side, strides, side, (0, 0, 0), False)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(
    num_programs: int,
    max_seq_len: int,
    num_tokens: int,
    target_programs: int,
    tile_n: int = TILE_N,
) -> int:
    """Key splits per query tile: enough programs to fill ``target_programs`` (e.g. twice the
    SM count) when few query tiles attend over long sequences, at least 4 key tiles of
    ``tile_n`` keys per split, at most :data:`MAX_SPLITS`; 1 when the batch has many query
    tokens (prefill fills the GPU and the partial buffers would be large)."""
    if num_tokens > 128 or num_programs >= target_programs:
        return 1
    by_keys = max(1, math.ceil(max_seq_len / tile_n) // 4)
    return max(1, min(MAX_SPLITS, by_keys, math.ceil(target_programs / max(num_programs, 1))))


class PagedAttentionLaunch:
    """The kernel launches of one :func:`plan_paged_attention` call, every argument prepared
    (tile map, scratch, views); calling it runs them again, e.g. once per timed call of a
    benchmark or under a CUDA graph capture (the inputs are read in place at each call)."""

    def __init__(
        self,
        grid: tuple[int, int, int],
        args: list[Any],
        constexprs: dict[str, Any],
        merge_grid: tuple[int, int] | None,
        merge_args: list[Any],
        merge_constexprs: dict[str, Any],
        staging: FP32Staging | None = None,
        fp_fusion: bool = True,
        num_warps: int = 4,
    ) -> None:
        self.grid = grid
        self.fp_fusion = fp_fusion
        self.num_warps = num_warps
        self.args = args
        self.constexprs = constexprs
        self.merge_grid = merge_grid
        self.merge_args = merge_args
        self.merge_constexprs = merge_constexprs
        self.staging = staging

    @property
    def num_splits(self) -> int:
        """Key splits per query tile (1: no merge kernel)."""
        return self.grid[2]

    def __call__(self) -> None:
        if self.grid[0] == 0:
            return
        if self.staging is not None:
            self.staging.query_fp32.copy_(self.staging.query)
        paged_attention_kernel[self.grid](
            *self.args, **self.constexprs, enable_fp_fusion=self.fp_fusion, num_warps=self.num_warps
        )
        if self.merge_grid is not None:
            merge_splits_kernel[self.merge_grid](*self.merge_args, **self.merge_constexprs)
        if self.staging is not None:
            self.staging.out.copy_(self.staging.out_fp32)


class FP32Staging(NamedTuple):
    """fp32 stand-ins of a bf16 query / output under Triton's interpreter, which multiplies bf16
    bit patterns as integers: the kernels run on the fp32 copies, the launch copies the query in
    and the output back (rounded to nearest even by torch) at each call. On a GPU there is none."""

    query: torch.Tensor
    query_fp32: torch.Tensor
    out: torch.Tensor
    out_fp32: torch.Tensor

    @classmethod
    def needed(cls, query: torch.Tensor, out: torch.Tensor) -> FP32Staging | None:
        if torch.bfloat16 not in (query.dtype, out.dtype) or not triton_interpreted():
            return None
        return cls(
            query,
            torch.empty(query.shape, dtype=torch.float32, device=query.device),
            out,
            torch.empty(out.shape, dtype=torch.float32, device=out.device),
        )


def plan_paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    k_scale_layout: ScaleLayout | str | None = None,
    v_scale_layout: ScaleLayout | str | None = None,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    num_splits: int | None = None,
    rope_cos_sin: torch.Tensor | None = None,
    rope_is_neox: bool = True,
    key_offset: torch.Tensor | None = None,
    sink_keys: torch.Tensor | None = None,
    key_hadamard: bool = False,
) -> PagedAttentionLaunch:
    """The launches that write attention of ``query [T, Hq, D]`` over the paged cache into
    ``out [T, Hq, Dv]`` (nothing runs until the result is called).

    Sequence ``i`` has ``seq_lens[i]`` keys and the queries ``query_start_loc[i] ..
    query_start_loc[i+1] - 1`` at its last positions; ``block_table [num_seqs, max_pages]``
    (int32) maps its pages. ``key_cache`` / ``value_cache`` are ``(B, N, Hkv, D')`` sides of a
    ``kv_cache_dtype`` cache; ``k_scale`` / ``v_scale`` fp32 ``[1]`` or ``[Hkv]`` (FP8 scales,
    NVFP4 global scales; unread otherwise). Per-token-head caches read their inline scales, or
    ``k_scale_cache`` / ``v_scale_cache`` (fp32 ``[B, N, Hkv]``, upstream's separate layout).
    ``num_splits`` forces the split-K count (``None``: :func:`choose_num_splits`).

    Keys stored before RoPE / key sinks (``rope_cos_sin``, ``rope_is_neox``, ``key_offset``,
    ``sink_keys``, ``key_hadamard``: as :func:`vllm._custom_ops.paged_attention`, e.g.
    :meth:`~vllm.v1.attention.backends.key_rebuild.KeyRebuild.kernel_args`) are checked here
    (:func:`~.triton_key_rebuild.key_rebuild_args`, ``ValueError`` before any launch); any of
    them rebuilds every key tile in fp32 (real units) and dots it with the query in IEEE fp32,
    launched without FMA contraction. Other arguments are assumed checked (the backend's impl
    and :func:`unified_attention` check them).
    """
    fmt = lookup(kv_cache_dtype, include_mla_only=False)
    staging = FP32Staging.needed(query, out)
    if staging is not None:
        query, out = staging.query_fp32, staging.out_fp32
    num_tokens, num_heads, head_size = query.shape
    head_size_v = out.shape[2]
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    rebuild = key_rebuild_args(
        rope_cos_sin,
        rope_is_neox,
        key_offset,
        sink_keys,
        key_hadamard,
        num_seqs=num_seqs,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        max_seq_len=max_seq_len,
        device=key_cache.device,
    )
    if num_tokens == 0 or num_seqs == 0:
        return PagedAttentionLaunch((0, 0, 1), [], {}, None, [], {})
    device = query.device
    code = kernel_format(fmt)
    k_layout = ScaleLayout.resolve(k_scale_layout, block_size, head_size)
    v_layout = ScaleLayout.resolve(v_scale_layout, block_size, head_size_v)
    k_side = _side(key_cache, code, head_size, k_layout, k_scale_cache)
    v_side = _side(value_cache, code, head_size_v, v_layout, v_scale_cache)

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    exact = query.dtype == torch.float32 or rebuild.constexprs["REBUILD_KEYS"]
    tiling = choose_tiling(group_pad, max_query_len, exact)
    block_q = tiling.block_m // group_pad
    qsl = query_start_loc.to(device=device, dtype=torch.int32)
    q_lens = (qsl[1:] - qsl[:-1]).to(torch.int64)
    tiles = (q_lens + block_q - 1) // block_q
    tiles_end = torch.cumsum(tiles, 0)
    num_programs = num_tokens // block_q + num_seqs  # >= the tiles of any split of T
    tile_seq = torch.searchsorted(
        tiles_end, torch.arange(num_programs, device=device), right=True
    ).to(torch.int32)
    tile_first = (tiles_end - tiles).to(torch.int32)

    if num_splits is None:
        target = 1 if triton_interpreted() or device.type != "cuda" else 2 * _num_sms(device.index)
        num_splits = choose_num_splits(
            num_seqs * num_kv_heads, max_seq_len, num_tokens, target, tiling.tile_n
        )
    d_pad = max(16, triton.next_power_of_2(head_size))
    dv_pad = max(16, triton.next_power_of_2(head_size_v))
    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, dv_pad, device=device)
        part_ml = torch.empty(num_tokens, num_heads, num_splits, 2, device=device)
    else:
        part_acc = part_ml = out  # unread
    table = block_table.to(device=device, dtype=torch.int32)
    k_scale = k_scale.to(device=device, dtype=torch.float32)
    # unread pointers: an fp32 tensor on the kernels' device
    sinks_arg = sinks.to(device=device, dtype=torch.float32) if sinks is not None else k_scale
    v_scale = v_scale.to(device=device, dtype=torch.float32)
    args = [
        out,
        query,
        k_side.data,
        v_side.data,
        k_side.aux,
        v_side.aux,
        table,
        seq_lens.to(device=device, dtype=torch.int32),
        qsl,
        tile_seq,
        tile_first,
        k_scale,
        v_scale,
        sinks_arg,
        part_acc,
        part_ml,
        float(scale),
        float(logits_soft_cap or 1.0),
        int(sliding_window or 0),
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *k_side.strides,
        *k_side.aux_strides,
        *v_side.strides,
        *v_side.aux_strides,
        table.stride(0),
        1 if k_scale.numel() > 1 else 0,
        1 if v_scale.numel() > 1 else 0,
        num_heads,
        *rebuild.kernel_args(k_scale),
    ]
    constexprs = dict(
        HEAD_SIZE=head_size,
        HEAD_SIZE_V=head_size_v,
        D_PAD=d_pad,
        DV_PAD=dv_pad,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=tiling.block_m,
        TILE_N=tiling.tile_n,
        FORMAT=code.value,
        BF16_PAGES=key_cache.dtype == torch.bfloat16,
        K_INTERLEAVE4=k_side.interleave4,
        V_INTERLEAVE4=v_side.interleave4,
        SCALE_INLINE=k_scale_cache is None,
        ROW_ALIGN=min(k_side.row_align, v_side.row_align),
        FP32_DOT=query.dtype == torch.float32,
        CAUSAL=causal,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=logits_soft_cap is not None,
        USE_SINKS=sinks is not None,
        NUM_SPLITS=num_splits,
        NUM_STAGES=PIPELINE_STAGES,
        **rebuild.constexprs,
    )
    # The rebuilt keys' fp32 products are rounded one by one, as the reference's.
    fusion = not rebuild.constexprs["REBUILD_KEYS"]
    if num_splits == 1:
        grid = (num_programs, num_kv_heads, 1)
        return PagedAttentionLaunch(
            grid, args, constexprs, None, [], {}, staging, fusion, tiling.num_warps
        )
    merge_args = [out, part_acc, part_ml, out.stride(0), out.stride(1), num_heads]
    merge_constexprs = dict(
        HEAD_SIZE_V=head_size_v,
        DV_PAD=dv_pad,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )
    return PagedAttentionLaunch(
        (num_programs, num_kv_heads, num_splits),
        args,
        constexprs,
        (num_tokens, num_heads),
        merge_args,
        merge_constexprs,
        staging,
        fusion,
        tiling.num_warps,
    )


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
    causal: bool,
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
    use_alibi_sqrt: bool = False,
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    chunk_lookback: int = -1,
    use_td: bool = False,
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

    ``q [T, Hq, D]``, ``out [T, Hq, Dv]``; ``k`` / ``v`` ``(B, N, Hkv, D')`` cache sides;
    ``cu_seqlens_q [num_seqs + 1]``, ``seqused_k [num_seqs]`` keys per sequence,
    ``block_table [num_seqs, max_pages]``; ``window_size (left, right)``: ``(-1, -1)`` or
    ``(W - 1, 0)`` for a window of W keys; ``softcap`` 0 for none; ``k_descale`` /
    ``v_descale`` the FP8 (NVFP4: global) scales. The format comes from ``kv_cache_dtype`` when
    given, else from ``k.dtype`` and ``kv_quant_mode`` (per-token-head: separate fp32 scale
    caches ``[B, N, Hkv]`` when ``k_scale_cache`` / ``v_scale_cache`` are given, else the
    inline scales of this library's rows). The decode path splits keys into
    ``num_par_softmax_segments`` parts when ``max_seqlen_q == 1`` and ``num_seqs <=
    seq_threshold_3D`` (upstream's 3D rule; scratch is allocated here, so the
    ``softmax_segm_*`` buffers are not needed); without ``seq_threshold_3D`` the split count
    is chosen (:func:`choose_num_splits`). Keys stored before RoPE / key sinks: the
    keyword-only ``rope_cos_sin`` .. ``key_hadamard`` of :func:`plan_paged_attention`. ALiBi,
    output scales, q/q bias, prefix-LM ranges, chunked lookback, tensor descriptors and FP8
    queries are not supported (``ValueError``).
    """
    for name, value, default in (
        ("alibi_slopes", alibi_slopes, None),
        ("output_scale", output_scale, None),
        ("qq_bias", qq_bias, None),
        ("mm_prefix_range", mm_prefix_range, None),
        ("q_descale", q_descale, None),
        ("use_alibi_sqrt", use_alibi_sqrt, False),
        ("chunk_lookback", chunk_lookback, -1),
        ("use_td", use_td, False),
    ):
        if value is not default and value != default:
            raise ValueError(f"{name}: expected {default} (not supported), got {value!r}")
    if q.dim() != 3 or q.dtype not in _QUERY_DTYPES or q.stride(-1) != 1:
        raise ValueError(
            f"q: expected a [T, Hq, D] float16 / bfloat16 / float32 tensor with unit last "
            f"stride, got {q.dtype} of shape {list(q.shape)}"
        )
    if out.dim() != 3 or out.shape[:2] != q.shape[:2] or out.dtype != q.dtype:
        raise ValueError(
            f"out: expected [{q.shape[0]}, {q.shape[1]}, Dv] in {q.dtype}, got {out.dtype} of "
            f"shape {list(out.shape)}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"out: expected a unit last stride, got strides {out.stride()}")
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
    name = kv_cache_dtype or _upstream_format(k, kv_quant_mode)
    fmt = lookup(name, include_mla_only=False)
    num_kv_heads = k.shape[2]
    if fmt.is_per_token_head and (k_scale_cache is None) != (v_scale_cache is None):
        raise ValueError("k_scale_cache, v_scale_cache: expected both or neither")
    splits = None
    if seq_threshold_3D is not None:
        use_3d = max_seqlen_q == 1 and num_seqs <= seq_threshold_3D
        splits = min(MAX_SPLITS, max(1, num_par_softmax_segments or 1)) if use_3d else 1
    plan_paged_attention(
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
        num_splits=splits,
        rope_cos_sin=rope_cos_sin,
        rope_is_neox=rope_is_neox,
        key_offset=key_offset,
        sink_keys=sink_keys,
        key_hadamard=key_hadamard,
    )()
