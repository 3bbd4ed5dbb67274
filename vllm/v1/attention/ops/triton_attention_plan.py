"""Host side of the Triton paged attention: :func:`plan_paged_attention` (this library's
caches, named by ``kv_cache_dtype``; the plan is called to run). Upstream's
:func:`~vllm.v1.attention.ops.triton_unified_attention.unified_attention` runs over it.

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

from vllm.kv_quant import ScaleLayout
from vllm.kv_quant.formats import CacheKind, KVCacheFormat, lookup
from vllm.triton_utils import row_alignment, triton, triton_interpreted
from vllm.utils.torch_utils import nvfp4_split_data_scale
from vllm.v1.attention.ops.triton_attention_reduce import reduce_segments
from vllm.v1.attention.ops.triton_key_rebuild import key_rebuild_args
from vllm.v1.attention.ops.triton_paged_attention import (
    PIPELINE_STAGES,
    TILE_N,
    Tiling,
    choose_tiling,
    paged_attention_kernel,
)

MAX_SPLITS = 32
"""Most key splits of one query tile (split-K): a batch-1 decode over 8 KV heads fills twice
the 132 SMs of an H100 (256 programs of 256 keys at 8k context), so more of the cache is in
flight at once; the partial sums it costs are 1-2 % of a bf16 cache read there."""

_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_TD_KINDS = (CacheKind.UNQUANTIZED, CacheKind.FP8_E4M3, CacheKind.FP8_E5M2)
"""Row encodings whose tiles tensor descriptors load (one element per value, no scales)."""


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
    benchmark or under a CUDA graph capture (the inputs are read in place at each call).
    ``kernel`` / ``reducer`` are the attention and segment-reduction kernels it launches
    (upstream's wrapper launches through its module's names)."""

    def __init__(
        self,
        grid: tuple[int, int, int],
        args: list[Any],
        constexprs: dict[str, Any],
        reduce_args: list[Any] | None = None,
        reduce_kwargs: dict[str, Any] | None = None,
        staging: FP32Staging | None = None,
        fp_fusion: bool = True,
        num_warps: int = 4,
    ) -> None:
        self.grid = grid
        self.fp_fusion = fp_fusion
        self.num_warps = num_warps
        self.args = args
        self.constexprs = constexprs
        self.reduce_args = reduce_args
        self.reduce_kwargs = reduce_kwargs or {}
        self.staging = staging
        self.kernel: Any = paged_attention_kernel
        self.reducer: Any = reduce_segments

    @property
    def num_splits(self) -> int:
        """Key segments per query tile (1 and no reduction: the 2D launch)."""
        return self.grid[2]

    @property
    def is_3d(self) -> bool:
        """Whether the launch writes segments that :func:`reduce_segments` combines."""
        return self.reduce_args is not None

    def __call__(self) -> None:
        if self.grid[0] == 0:
            return
        if self.staging is not None:
            self.staging.stage_in()
        self.kernel[self.grid](
            *self.args, **self.constexprs, enable_fp_fusion=self.fp_fusion, num_warps=self.num_warps
        )
        if self.reduce_args is not None:
            reduce_grid = (self.args[0].shape[0], self.args[0].shape[1])
            self.reducer[reduce_grid](*self.reduce_args, **self.reduce_kwargs)
        if self.staging is not None:
            self.staging.stage_out()


class FP32Staging(NamedTuple):
    """fp32 stand-ins of a bf16 query and / or output under Triton's interpreter, which
    multiplies bf16 bit patterns as integers: the kernels run on the fp32 copies (a side not in
    bf16 is its own stand-in), the launch copies the query in and the output back (rounded to
    nearest even by torch) at each call. On a GPU there is none."""

    query: torch.Tensor
    query_fp32: torch.Tensor
    out: torch.Tensor
    out_fp32: torch.Tensor

    @classmethod
    def needed(cls, query: torch.Tensor, out: torch.Tensor) -> FP32Staging | None:
        if torch.bfloat16 not in (query.dtype, out.dtype) or not triton_interpreted():
            return None

        def stand_in(x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.bfloat16:
                return x
            return torch.empty(x.shape, dtype=torch.float32, device=x.device)

        return cls(query, stand_in(query), out, stand_in(out))

    def stage_in(self) -> None:
        if self.query_fp32 is not self.query:
            self.query_fp32.copy_(self.query)

    def stage_out(self) -> None:
        if self.out_fp32 is not self.out:
            self.out.copy_(self.out_fp32)


@functools.cache
def _set_td_allocator() -> None:
    """Tensor descriptors built in a kernel need global scratch on sm_90+: Triton asks the
    allocator set here for it (torch memory on the launch's device)."""

    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)


class SegmentScratch(NamedTuple):
    """A split-K launch's fp32 scratch (upstream's ``softmax_segm_*`` buffers): ``output
    [rows, Hq, segments, DV_PAD]``, ``max`` / ``expsum [rows, Hq, segments]``, contiguous, at
    least one row per query token."""

    output: torch.Tensor
    max: torch.Tensor
    expsum: torch.Tensor

    @classmethod
    def empty(
        cls, tokens: int, heads: int, segments: int, dv_pad: int, device: torch.device
    ) -> SegmentScratch:
        return cls(
            torch.empty(tokens, heads, segments, dv_pad, device=device),
            torch.empty(tokens, heads, segments, device=device),
            torch.empty(tokens, heads, segments, device=device),
        )

    def check(self, tokens: int, heads: int, segments: int, dv_pad: int) -> None:
        """``ValueError`` unless the buffers fit a launch of these sizes."""
        rows = max(tokens, self.output.shape[0])
        for name, x, shape in (
            ("softmax_segm_output", self.output, (rows, heads, segments, dv_pad)),
            ("softmax_segm_max", self.max, (rows, heads, segments)),
            ("softmax_segm_expsum", self.expsum, (rows, heads, segments)),
        ):
            if tuple(x.shape) != shape or x.dtype != torch.float32 or not x.is_contiguous():
                raise ValueError(
                    f"{name}: expected a contiguous float32 tensor of shape {list(shape)} "
                    f"(rows >= {tokens} query tokens), got {x.dtype} of shape {list(x.shape)}"
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
    causal: bool | torch.Tensor = True,
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
    q_scale: torch.Tensor | None = None,
    output_scale: torch.Tensor | None = None,
    segment_scratch: SegmentScratch | None = None,
    use_td: bool = False,
    chunk_lookback: int = -1,
    mm_prefix_range: torch.Tensor | None = None,
    mm_prefix_clamp_sliding_window: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    alibi_sqrt: bool = False,
    qq_bias: torch.Tensor | None = None,
    rswa_prefix_lens: torch.Tensor | None = None,
    rswa_window: int | None = None,
) -> PagedAttentionLaunch:
    """The launches that write attention of ``query [T, Hq, D]`` over the paged cache into
    ``out [T, Hq, Dv]`` (nothing runs until the result is called).

    Sequence ``i`` has ``seq_lens[i]`` keys and the queries ``query_start_loc[i] ..
    query_start_loc[i+1] - 1`` at its last positions; ``block_table [num_seqs, max_pages]``
    (int32) maps its pages. ``key_cache`` / ``value_cache`` are ``(B, N, Hkv, D')`` sides of a
    ``kv_cache_dtype`` cache; ``k_scale`` / ``v_scale`` fp32 ``[1]`` or ``[Hkv]`` (FP8 scales,
    NVFP4 global scales; unread otherwise). Per-token-head caches read their inline scales, or
    ``k_scale_cache`` / ``v_scale_cache`` (fp32 ``[B, N, Hkv]``, upstream's separate layout).
    ``num_splits`` forces the split-K segment count (``None``: :func:`choose_num_splits`);
    more than one, or ``segment_scratch`` (the caller's buffers, else allocated here), makes
    the launch split-K (``IS_3D``, then :func:`reduce_segments`).

    A float8_e4m3fn ``query`` is dequantized by ``q_scale`` (fp32 ``[1]``); ``output_scale``
    (fp32 ``[1]``) divides the output, clamped to e4m3's range (a float8_e4m3fn ``out`` is
    rounded to nearest even). ``use_td`` loads unquantized / FP8 tiles through tensor
    descriptors, tiles of at most ``block_size`` keys. ``causal`` may be a ``[num_seqs]`` tensor
    of per-sequence flags (non-zero: causal). ``chunk_lookback >= 0`` (with a window W):
    chunks of ``W // (chunk_lookback + 1)`` keys in place of the window; ``mm_prefix_range
    [num_seqs, R, 2]`` (int): bidirectional prefix-LM ranges, inclusive, seen whatever the
    causal / window mask (within the window with ``mm_prefix_clamp_sliding_window``).
    ``alibi_slopes [Hq]`` add ``slope * (key - first query position)`` to the scores
    (``alibi_sqrt``: ``-slope * sqrt(query - key)`` for past keys); ``qq_bias [>= max_query_len,
    C]`` adds ``qq_bias[i, j]`` to query ``i``'s score of the sequence's query ``j < C``;
    ``rswa_prefix_lens [num_seqs]`` with ``rswa_window`` (R-SWA, both or neither): keys below a
    sequence's prefix length stay visible, later ones within ``rswa_window`` keys of the
    query, in place of ``sliding_window`` (which still sizes chunks and clamps prefix ranges).

    Keys stored before RoPE / key sinks (``rope_cos_sin``, ``rope_is_neox``, ``key_offset``,
    ``sink_keys``, ``key_hadamard``: as :func:`vllm._custom_ops.paged_attention`, e.g.
    :meth:`~vllm.v1.attention.backends.key_rebuild.KeyRebuild.kernel_args`) are checked here
    (:func:`~.triton_key_rebuild.key_rebuild_args`, ``ValueError`` before any launch); any of
    them rebuilds every key tile in fp32 (real units) and dots it with the query in IEEE fp32,
    launched without FMA contraction. Other arguments are assumed checked (the backend's impl
    and :func:`~.triton_unified_attention.unified_attention` check them).
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
        return PagedAttentionLaunch((0, 0, 1), [], {})
    device = query.device
    code = kernel_format(fmt)
    q_fp8 = query.dtype == torch.float8_e4m3fn
    per_seq_causal = isinstance(causal, torch.Tensor)
    chunked = sliding_window is not None and chunk_lookback >= 0
    k_layout = ScaleLayout.resolve(k_scale_layout, block_size, head_size)
    v_layout = ScaleLayout.resolve(v_scale_layout, block_size, head_size_v)
    k_side = _side(key_cache, code, head_size, k_layout, k_scale_cache)
    v_side = _side(value_cache, code, head_size_v, v_layout, v_scale_cache)

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # fp8 queries dot in fp16 units, or in the dtype of unquantized pages (bf16: fp32 under
    # the interpreter, whose bf16 is wrong)
    fp32_dot = query.dtype == torch.float32 or (
        q_fp8
        and code is CacheKind.UNQUANTIZED
        and (
            key_cache.dtype == torch.float32
            or (triton_interpreted() and key_cache.dtype == torch.bfloat16)
        )
    )
    exact = fp32_dot or rebuild.constexprs["REBUILD_KEYS"]
    split_k = segment_scratch is not None or (num_splits or 1) > 1
    tiling = choose_tiling(group_pad, 1 if split_k else max_query_len, exact)
    if use_td:
        tiling = _td_tiling(tiling, code, block_size, rebuild.constexprs["REBUILD_KEYS"])
        if device.type == "cuda":
            _set_td_allocator()
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
    is_3d = segment_scratch is not None or num_splits > 1
    if segment_scratch is not None:
        segment_scratch.check(num_tokens, num_heads, num_splits, dv_pad)
    elif is_3d:
        segment_scratch = SegmentScratch.empty(num_tokens, num_heads, num_splits, dv_pad, device)
    table = block_table.to(device=device, dtype=torch.int32)
    k_scale = k_scale.to(device=device, dtype=torch.float32)

    def fp32_or_unread(x: torch.Tensor | None) -> torch.Tensor:
        # unread pointers: an fp32 tensor on the kernels' device
        return x.to(device=device, dtype=torch.float32) if x is not None else k_scale

    out_scale_inv = None if output_scale is None else 1.0 / fp32_or_unread(output_scale)
    v_scale = v_scale.to(device=device, dtype=torch.float32)
    out_arg = out.view(torch.uint8) if out.dtype == torch.float8_e4m3fn else out
    seq_lens_arg = seq_lens.to(device=device, dtype=torch.int32)
    args = [
        out_arg,
        query.view(torch.uint8) if q_fp8 else query,
        k_side.data,
        v_side.data,
        k_side.aux,
        v_side.aux,
        table,
        seq_lens_arg,
        qsl,
        tile_seq,
        tile_first,
        k_scale,
        v_scale,
        fp32_or_unread(sinks),
        fp32_or_unread(q_scale),
        fp32_or_unread(out_scale_inv),
        causal.to(device=device, dtype=torch.int32) if per_seq_causal else k_scale,
        table if mm_prefix_range is None else mm_prefix_range.to(device, torch.int32).contiguous(),
        *(segment_scratch or (k_scale, k_scale, k_scale)),
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
        fp32_or_unread(alibi_slopes).contiguous(),
        k_scale if qq_bias is None else qq_bias.to(device),
        table if rswa_prefix_lens is None else rswa_prefix_lens.to(device, torch.int32),
        0 if qq_bias is None else qq_bias.stride(0),
        0 if qq_bias is None else qq_bias.shape[1],
        int(rswa_window or 0),
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
        FP32_DOT=fp32_dot,
        CAUSAL=per_seq_causal or bool(causal),
        PER_SEQ_CAUSAL=per_seq_causal,
        CHUNK_LOOKBACK=chunk_lookback if chunked else -1,
        CHUNK_SIZE=sliding_window // (chunk_lookback + 1) if chunked else -1,
        MAX_MM_RANGES=0 if mm_prefix_range is None else mm_prefix_range.shape[1],
        MM_PREFIX_CLAMP=mm_prefix_clamp_sliding_window,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=logits_soft_cap is not None,
        USE_SINKS=sinks is not None,
        NUM_SPLITS=num_splits,
        IS_3D=is_3d,
        Q_FP8=q_fp8,
        OUT_SCALE=output_scale is not None,
        USE_TD=use_td,
        NUM_STAGES=PIPELINE_STAGES,
        **rebuild.constexprs,
        USE_ALIBI=alibi_slopes is not None,
        ALIBI_SQRT=alibi_slopes is not None and alibi_sqrt,
        USE_QQ_BIAS=qq_bias is not None,
        USE_RSWA=rswa_prefix_lens is not None,
    )
    reduce_args = None
    if segment_scratch is not None:
        reduce_args = [
            out_arg,
            *segment_scratch,
            seq_lens_arg,
            num_seqs,
            num_heads,
            fp32_or_unread(out_scale_inv),
            out.stride(0),
            out.stride(1),
            table.stride(0),
        ]
    reduce_kwargs = dict(
        TILE_SIZE=tiling.tile_n,
        HEAD_SIZE=head_size_v,
        HEAD_SIZE_PADDED=dv_pad,
        query_start_len_ptr=qsl,
        BLOCK_Q=block_q,
        NUM_SEGMENTS_PER_SEQ=num_splits,
        USE_FP8=output_scale is not None,
    )
    # The rebuilt keys' fp32 products are rounded one by one, as the reference's.
    fusion = not rebuild.constexprs["REBUILD_KEYS"]
    return PagedAttentionLaunch(
        (num_programs, num_kv_heads, num_splits),
        args,
        constexprs,
        reduce_args,
        reduce_kwargs,
        staging,
        fusion,
        tiling.num_warps,
    )


def _td_tiling(tiling: Tiling, code: CacheKind, block_size: int, rebuild: bool) -> Tiling:
    """``tiling`` with its key tiles inside one page, as tensor-descriptor loads need (tiles
    of at most ``block_size`` keys dividing it, 16 at least for ``tl.dot``); ``ValueError``
    for the caches they do not read."""
    if code not in _TD_KINDS or rebuild:
        raise ValueError(
            f"use_td: expected an unquantized or FP8 cache with keys stored as read, got "
            f"{code.name}{' with rebuilt keys' if rebuild else ''}"
        )
    tile_n = min(tiling.tile_n, block_size)
    if tile_n < 16 or block_size % tile_n:
        raise ValueError(
            f"use_td: expected a block size that is a multiple of 16, got {block_size}"
        )
    return tiling._replace(tile_n=tile_n)
