"""Ahead-of-time compile cases of the Triton paged attention (:mod:`.triton_paged_attention`):
every cache format x decode, split-K decode, prefill with window / soft cap / sinks, non-causal
fp32 and the rebuilt-key variant, compiled as launches run them (the launch's tiling from
:func:`~.triton_paged_attention.choose_tiling`, the divisibility hints of a real cache's views),
FP8 queries / output, tensor-descriptor loads, and the segment reduction per output dtype
(design.md §11.4)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm.kv_quant import ScaleLayout
from vllm.kv_quant.formats import CacheKind, formats, lookup
from vllm.triton_utils.aot import TritonCompileCase
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.attention.backends.abstract import kv_cache_dim
from vllm.v1.attention.ops.triton_attention_plan import _TD_KINDS, _side, _td_tiling, kernel_format
from vllm.v1.attention.ops.triton_attention_reduce import reduce_segments
from vllm.v1.attention.ops.triton_paged_attention import (
    PIPELINE_STAGES,
    Tiling,
    choose_tiling,
    paged_attention_kernel,
)


def side_divisibility(
    kv_cache_dtype: str,
    head_size: int,
    side: str,
    *,
    num_kv_heads: int = 8,
    block_size: int = 16,
    scale_cache: bool = False,
    scale_layout: ScaleLayout | str | None = None,
) -> dict[str, bool]:
    """Which of one cache side's kernel arguments (``{side}_ptr``, ``{side}_aux_ptr`` and the
    ``stride_{side}_*`` / ``stride_{side}a_*`` strides; ``side`` is ``"k"`` or ``"v"``) a launch
    over a ``kv_cache_dtype`` cache of this geometry passes as multiples of 16 (bytes of
    address, elements of stride): Triton specialises those as divisible by 16, which lets it
    vectorise the page loads. The ahead-of-time compile cases take the same hints, so they
    compile the code that such a launch runs. ``scale_cache``: per-token-head scales in
    upstream's separate fp32 cache; ``scale_layout``: NVFP4's (``None``: the default)."""
    fmt = lookup(kv_cache_dtype, include_mla_only=False)
    dtype = STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype]
    cache = torch.zeros(2, block_size, num_kv_heads, kv_cache_dim(head_size, kv_cache_dtype))
    cache = cache.to(dtype)  # zeros of any storage dtype; the base is 64-byte aligned
    scales = torch.zeros(2, block_size, num_kv_heads) if scale_cache else None
    layout = ScaleLayout.resolve(scale_layout, block_size, head_size)
    kernel_side = _side(cache, kernel_format(fmt), head_size, layout, scales)
    base = cache.data_ptr()
    aux_base = scales.data_ptr() if scales is not None else base
    hints = {
        f"{side}_ptr": (kernel_side.data.data_ptr() - base) % 16 == 0,
        f"{side}_aux_ptr": (kernel_side.aux.data_ptr() - aux_base) % 16 == 0,
    }
    for dim, data_stride, aux_stride in zip(
        ("page", "tok", "head"), kernel_side.strides, kernel_side.aux_strides, strict=True
    ):
        hints[f"stride_{side}_{dim}"] = data_stride % 16 == 0
        hints[f"stride_{side}a_{dim}"] = aux_stride % 16 == 0
    return hints


class _FormatCase(NamedTuple):
    """One cache format as the kernels see it: case name, ``FORMAT`` (the row encoding),
    bf16 pages, cache / aux pointer types, inline scales, K / V interleave4, and the
    ``kv_cache_dtype`` of the launch it stands for."""

    name: str
    kind: CacheKind
    bf16_pages: bool
    cache_type: str
    aux_type: str
    inline: bool
    interleave4: bool
    kv_cache_dtype: str


_BIAS_KINDS = (CacheKind.UNQUANTIZED, CacheKind.FP8_E4M3)

_POINTER_TYPES = {torch.float16: "*fp16", torch.float32: "*fp32", torch.bfloat16: "*bf16"}


def _format_cases() -> list[_FormatCase]:
    """Every row encoding the registry's kernel formats use, once (a writer-only variant such
    as ``nvfp4_mse`` reads as its kind): unquantized pages per float storage dtype (bf16 read
    as int16 bits), each quantized kind with its scales inline, per-token-head rows also with
    upstream's separate fp32 scale cache, NVFP4 per block-scale layout."""
    cases: list[_FormatCase] = []
    seen: set[tuple[CacheKind, torch.dtype | None]] = set()
    for fmt in formats():
        kind, storage = fmt.cache_kind, fmt.storage_dtype
        if kind is None or not fmt.has_kernel or fmt.mla_only or (kind, storage) in seen:
            continue
        if kind is CacheKind.INT4_PER_TOKEN_HEAD:
            continue  # rotated rows: the packed kernel's cases (triton_packed_attention)
        if kind is CacheKind.UNQUANTIZED and storage is None:
            continue  # auto: one of the float storage dtypes
        seen.add((kind, storage))
        if kind is CacheKind.UNQUANTIZED:
            assert storage is not None
            bf16 = storage == torch.bfloat16
            ptr = "*i16" if bf16 else _POINTER_TYPES[storage]
            cases.append(
                _FormatCase(fmt.label, kind, bf16, ptr, _POINTER_TYPES[storage], True, False,
                            fmt.name)
            )  # fmt: skip
        elif fmt.scale_layouts:
            for layout in fmt.scale_layouts:
                cases.append(
                    _FormatCase(f"{fmt.name}/{layout}", kind, False, "*u8", "*u8", True,
                                layout == ScaleLayout.INTERLEAVE4.value, fmt.name)
                )  # fmt: skip
        else:
            cases.append(_FormatCase(fmt.name, kind, False, "*u8", "*u8", True, False, fmt.name))
            if fmt.is_per_token_head:
                cases.append(
                    _FormatCase(f"{fmt.name}/scale_cache", kind, False, "*u8", "*fp32", False,
                                False, fmt.name)
                )  # fmt: skip
    return cases


class _Feature(NamedTuple):
    """One launch shape: case name, query / output pointer types (``u8``: float8_e4m3fn seen as
    bytes), longest query (1: decode), NUM_SPLITS (> 1: split-K), and the feature flags; the
    tiling is choose_tiling's, as launched."""

    name: str
    q_type: str
    out_type: str
    query_len: int
    splits: int
    causal: bool = True
    window: bool = False
    soft_cap: bool = False
    sinks: bool = False
    out_scale: bool = False
    td: bool = False
    per_seq_causal: bool = False
    chunks_and_prefix_ranges: bool = False
    biases: str = ""  # "alibi" / "alibi_sqrt": with the q/q bias and R-SWA


_FEATURE_CASES: tuple[_Feature, ...] = (
    _Feature("decode/bf16", "bf16", "bf16", 1, 1),
    _Feature("decode_split4/fp16", "fp16", "fp16", 1, 4),
    _Feature("prefill_window_softcap_sinks/bf16", "bf16", "bf16", 64, 1, True, True, True, True),
    _Feature("noncausal_window/fp32", "fp32", "fp32", 64, 1, False, True),
    # FP8 queries (dequantized in the kernel) and an FP8 output (rounded in integers)
    _Feature("decode_split4_fp8q/bf16", "u8", "bf16", 1, 4),
    _Feature("prefill_fp8out/fp16", "fp16", "u8", 64, 1, out_scale=True),
    _Feature(
        "prefill_per_seq_window/bf16", "bf16", "bf16", 64, 1, window=True, per_seq_causal=True
    ),
    # chunked attention (a 128-key window in 2 chunks) with 2 window-clamped prefix ranges
    _Feature(
        "prefill_chunks_mm_prefix/bf16",
        "bf16",
        "bf16",
        64,
        1,
        window=True,
        chunks_and_prefix_ranges=True,
    ),  # fmt: skip
)

_TD_CASES: tuple[_Feature, ...] = (
    _Feature("prefill_td/bf16", "bf16", "bf16", 64, 1, td=True),
    _Feature("decode_split4_td_window/fp16", "fp16", "fp16", 1, 4, window=True, td=True),
)
"""Tensor-descriptor tile loads, for the formats they read (unquantized, FP8)."""

_BIAS_CASES: tuple[_Feature, ...] = (
    _Feature("prefill_alibi_qq_rswa_window_sinks/bf16", "bf16", "bf16", 64, 1, window=True,
             sinks=True, biases="alibi"),
    _Feature("decode_split4_alibi_sqrt_qq_rswa/fp16", "fp16", "fp16", 1, 4, biases="alibi_sqrt"),
)  # fmt: skip
"""ALiBi (both variants), the q/q bias and R-SWA, all on: score arithmetic that is the same
for every cache format, compiled over the unquantized and e4m3 readers."""

# Keys rebuilt (REBUILD_KEYS, every transform on): (case name, query dtype, longest query,
# NUM_SPLITS, neox RoPE, Hadamard rotation)
_REBUILD_CASES: tuple[tuple[str, str, int, int, bool, bool], ...] = (
    ("decode/bf16", "bf16", 1, 1, True, True),
    ("prefill_split4_gptj/fp16", "fp16", 64, 4, False, False),
)


def _attention_signature(
    q_type: str, cache_type: str, aux_type: str, out_type: str | None = None
) -> dict[str, str]:
    pointers = {
        "out_ptr": out_type or q_type,
        "q_ptr": q_type,
        "k_ptr": cache_type,
        "v_ptr": cache_type,
        "k_aux_ptr": aux_type,
        "v_aux_ptr": aux_type,
        "block_table_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "query_start_ptr": "*i32",
        "tile_seq_ptr": "*i32",
        "tile_first_ptr": "*i32",
        "k_scale_ptr": "*fp32",
        "v_scale_ptr": "*fp32",
        "sinks_ptr": "*fp32",
        "q_scale_ptr": "*fp32",
        "out_scale_ptr": "*fp32",
        "causal_ptr": "*i32",
        "mm_prefix_ptr": "*i32",
        "segm_output_ptr": "*fp32",
        "segm_max_ptr": "*fp32",
        "segm_expsum_ptr": "*fp32",
    }
    scalars = {"softmax_scale": "fp32", "soft_cap": "fp32", "window": "i32", "num_seqs": "i32"}
    rebuild = {
        "rope_ptr": "*fp32",
        "key_offset_ptr": "*fp32",
        "sink_keys_ptr": "*fp32",
        "hadamard_scale": "fp32",
        "rotary_dim": "i32",
        "num_sink_keys": "i32",
    }
    biases = {
        "alibi_ptr": "*fp32",
        "qq_bias_ptr": "*fp32",
        "rswa_prefix_ptr": "*i32",
        "qq_bias_stride": "i32",
        "qq_bias_cols": "i32",
        "rswa_window": "i32",
    }
    strides = [
        "stride_q_tok",
        "stride_q_head",
        "stride_o_tok",
        "stride_o_head",
        *(f"stride_{s}_{d}" for s in ("k", "ka", "v", "va") for d in ("page", "tok", "head")),
        "stride_bt",
        "k_scale_stride",
        "v_scale_stride",
        "num_heads",
    ]
    return {**pointers, **scalars, **dict.fromkeys(strides, "i32"), **rebuild, **biases}


def _attention_hints(
    kv_cache_dtype: str, inline: bool, interleave4: bool, cache_view_aligned: bool = True
) -> tuple[str, ...]:
    """The arguments a launch over the compile cases' geometry (8 KV heads, pages of 16 tokens,
    head sizes 128 / 64) passes as multiples of 16: every pointer but the cache sides' (torch
    allocations), the query / output strides (multiples of the head size) and, per cache side,
    what :func:`side_divisibility` finds (none of them for a cache view off its allocation's
    alignment, ``cache_view_aligned=False``)."""
    sides = {}
    for side, head_size in (("k", 128), ("v", 64)):
        sides.update(
            side_divisibility(
                kv_cache_dtype,
                head_size,
                side,
                scale_cache=not inline,
                scale_layout="interleave4" if interleave4 else "linear",
            )
        )
    pointers = [n for n in _attention_signature("*fp16", "*u8", "*u8") if n.endswith("_ptr")]
    always = [n for n in pointers if n not in sides]
    always += ["stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head"]
    if not cache_view_aligned:
        return tuple(always)
    return (*always, *(name for name, divisible in sides.items() if divisible))


def _attention_constexprs(
    fmt: _FormatCase, q_type: str, tiling: Tiling, splits: int
) -> dict[str, object]:
    """The compile cases' constexprs (GQA group 4, head sizes 128 / 64, pages of 16 tokens),
    keys read as stored."""
    return {
        "HEAD_SIZE": 128,
        "HEAD_SIZE_V": 64,
        "D_PAD": 128,
        "DV_PAD": 64,
        "BLOCK_SIZE": 16,
        "GROUP": 4,
        "GROUP_PAD": 4,
        "BLOCK_M": tiling.block_m,
        "TILE_N": tiling.tile_n,
        "FORMAT": fmt.kind.value,
        "BF16_PAGES": fmt.bf16_pages,
        "K_INTERLEAVE4": fmt.interleave4,
        "V_INTERLEAVE4": fmt.interleave4,
        "SCALE_INLINE": fmt.inline,
        "ROW_ALIGN": 4,
        "FP32_DOT": q_type == "fp32",
        "CAUSAL": True,
        "PER_SEQ_CAUSAL": False,
        "CHUNK_LOOKBACK": -1,
        "CHUNK_SIZE": -1,
        "MAX_MM_RANGES": 0,
        "MM_PREFIX_CLAMP": False,
        "USE_WINDOW": False,
        "USE_SOFT_CAP": False,
        "USE_SINKS": False,
        "NUM_SPLITS": splits,
        "IS_3D": splits > 1,
        "Q_FP8": q_type == "u8",
        "OUT_SCALE": False,
        "USE_TD": False,
        "NUM_STAGES": PIPELINE_STAGES,
        "REBUILD_KEYS": False,
        "USE_ROPE": False,
        "ROPE_NEOX": True,
        "KEY_HADAMARD": False,
        "USE_KEY_OFFSET": False,
        "USE_SINK_KEYS": False,
        "USE_ALIBI": False,
        "ALIBI_SQRT": False,
        "USE_QQ_BIAS": False,
        "USE_RSWA": False,
    }


def _attention_case(
    name: str,
    q_type: str,
    cache_type: str,
    aux_type: str,
    constexprs: dict[str, object],
    tiling: Tiling,
    hints: tuple[str, ...],
    out_type: str | None = None,
    **options: bool,
) -> TritonCompileCase:
    """One :func:`paged_attention_kernel` case, launched with ``tiling``'s warps."""
    return TritonCompileCase(
        name,
        paged_attention_kernel,
        _attention_signature(f"*{q_type}", cache_type, aux_type, f"*{out_type or q_type}"),
        constexprs,
        num_warps=tiling.num_warps,
        divisible_by_16=hints,
        **options,
    )


def triton_compile_cases() -> list[TritonCompileCase]:
    """Every cache format x {decode, split-K decode, prefill with window / soft cap / sinks,
    non-causal fp32, and the rebuilt keys of :data:`_REBUILD_CASES`} of
    :func:`paged_attention_kernel` (:func:`_attention_constexprs`: FP8 queries / output and,
    for unquantized / FP8 caches, tensor-descriptor loads among them), and
    :func:`reduce_segments` per output dtype."""
    cases = []
    for fmt in _format_cases():
        hints = _attention_hints(fmt.kv_cache_dtype, fmt.inline, fmt.interleave4)
        types = (fmt.cache_type, fmt.aux_type)
        td_cases = _TD_CASES if fmt.kind in _TD_KINDS else ()
        bias_cases = _BIAS_CASES if fmt.kind in _BIAS_KINDS else ()
        for feat in (*_FEATURE_CASES, *td_cases, *bias_cases):
            fp32_dot = feat.q_type == "fp32" or (feat.q_type == "u8" and fmt.cache_type == "*fp32")
            split_k = feat.splits > 1
            tiling = choose_tiling(4, 1 if split_k else feat.query_len, exact=fp32_dot)
            if feat.td:
                tiling = _td_tiling(tiling, fmt.kind, 16, False)
            constexprs = _attention_constexprs(fmt, feat.q_type, tiling, feat.splits)
            constexprs.update(
                CAUSAL=feat.causal,
                USE_WINDOW=feat.window,
                USE_SOFT_CAP=feat.soft_cap,
                USE_SINKS=feat.sinks,
                FP32_DOT=fp32_dot,
                OUT_SCALE=feat.out_scale,
                USE_TD=feat.td,
                PER_SEQ_CAUSAL=feat.per_seq_causal,
            )
            if feat.biases:
                constexprs.update(
                    USE_ALIBI=True,
                    ALIBI_SQRT=feat.biases == "alibi_sqrt",
                    USE_QQ_BIAS=True,
                    USE_RSWA=True,
                )
            if feat.chunks_and_prefix_ranges:
                constexprs.update(
                    CHUNK_LOOKBACK=1, CHUNK_SIZE=64, MAX_MM_RANGES=2, MM_PREFIX_CLAMP=True
                )
            name = f"paged_attention/{fmt.name}/{feat.name}"
            cases.append(
                _attention_case(name, feat.q_type, *types, constexprs, tiling, hints, feat.out_type)
            )
        for feat_name, q_type, query_len, splits, neox, hadamard in _REBUILD_CASES:
            tiling = choose_tiling(4, query_len, exact=True)
            constexprs = _attention_constexprs(fmt, q_type, tiling, splits)
            constexprs.update(
                REBUILD_KEYS=True,
                USE_ROPE=True,
                ROPE_NEOX=neox,
                KEY_HADAMARD=hadamard,
                USE_KEY_OFFSET=True,
                USE_SINK_KEYS=True,
            )
            name = f"paged_attention_rebuild/{fmt.name}/{feat_name}"
            # as launched: the rebuild's products rounded one by one (no FMA contraction)
            case = _attention_case(
                name, q_type, *types, constexprs, tiling, hints, enable_fp_fusion=False
            )
            cases.append(case)
    # Per-token-head rows off 4-byte boundaries (a cache view one byte off): byte loads, and
    # no cache pointer or stride known to be a multiple of 16.
    for fmt in _format_cases():
        if fmt.kind.name.endswith("PER_TOKEN_HEAD") and fmt.inline:
            tiling = choose_tiling(4, 1, exact=False)
            constexprs = _attention_constexprs(fmt, "bf16", tiling, 1)
            constexprs.update(ROW_ALIGN=1)
            hints = _attention_hints(fmt.kv_cache_dtype, True, False, False)
            name = f"paged_attention/{fmt.name}/unaligned_rows/decode/bf16"
            cases.append(_attention_case(name, "bf16", "*u8", "*u8", constexprs, tiling, hints))
    for out_type in ("fp16", "bf16", "fp32", "u8"):
        cases.append(
            TritonCompileCase(
                f"reduce_segments/{out_type}",
                reduce_segments,
                {
                    "output_ptr": f"*{out_type}",
                    "segm_output_ptr": "*fp32",
                    "segm_max_ptr": "*fp32",
                    "segm_expsum_ptr": "*fp32",
                    "seq_lens_ptr": "*i32",
                    "num_seqs": "i32",
                    "out_scale_inv": "*fp32",
                    "output_stride_0": "i32",
                    "output_stride_1": "i32",
                    "block_table_stride": "i32",
                    "query_start_len_ptr": "*i32",
                },
                {
                    "num_query_heads": 32,
                    "TILE_SIZE": 32,
                    "HEAD_SIZE": 64,
                    "HEAD_SIZE_PADDED": 64,
                    "BLOCK_Q": 4,
                    "NUM_SEGMENTS_PER_SEQ": 16,
                    "USE_FP8": out_type == "u8",
                },
            )
        )
    return cases
