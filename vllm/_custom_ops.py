"""Python entry points of the compiled cache ops (``torch.ops._C_cache_ops``).

Importing this module loads the extension ``vllm/_C`` built by ``setup.py``
(:mod:`vllm._extension`) and registers the fake (meta) implementations that ``torch.compile``
traces with.
"""

from __future__ import annotations

import os

import torch
from torch._subclasses.fake_tensor import is_fake

from vllm import _cpu_attn_args as cpu_attn_args
from vllm import _extension  # noqa: F401  (loads the compiled ops first)
from vllm._cpu_attn_args import (  # upstream's name, re-exported
    cpu_attn_get_scheduler_metadata as cpu_attn_get_scheduler_metadata,
)
from vllm._mla_cache_ops import *  # noqa: F403  (upstream's MLA cache ops)
from vllm._packed_attention_ops import (  # the compiled packed-slot reader
    packed_paged_attention as packed_paged_attention,
)
from vllm._packed_cache_ops import turboquant_store as turboquant_store  # the compiled writer
from vllm.kv_quant.formats import find_format, kernel_cache_kind
from vllm.kv_quant.kv_scale import kv_scale_as_1d
from vllm.kv_quant.scale_layout import ScaleLayout

DEBUG_CHECKS_ENV = "VLLM_KV_DEBUG_CHECKS"
"""Set to ``1`` to make :func:`reshape_and_cache_flash` check scale values on the host (a device
sync on CUDA)."""


def _is_abstract(t: torch.Tensor) -> bool:
    return t.is_meta or is_fake(t)


def _reject_real_and_meta(
    tensors: dict[str, torch.Tensor | None], reference: str, same_device: bool = True
) -> None:
    """The fake kernels run whenever one argument is on ``meta`` (the dispatcher ranks Meta
    above every real device), so a real cache with a meta argument would write nothing and
    return. Shape propagation and ``torch.compile`` pass only meta / fake tensors; a mix of
    real and meta tensors is a caller bug: ``RuntimeError`` naming the first odd argument."""
    given = {name: t for name, t in tensors.items() if t is not None}
    abstract = {name for name, t in given.items() if _is_abstract(t)}
    if not abstract or len(abstract) == len(given):
        return
    ref = given[reference]
    if reference in abstract:
        name = next(n for n in given if n not in abstract)
        raise RuntimeError(
            f"{name}: expected a meta tensor ({reference} is on meta: shape propagation), "
            f"got a tensor on {given[name].device}"
        )
    name = next(n for n in given if n in abstract)
    if same_device:
        raise RuntimeError(f"{name}: expected device {ref.device} ({reference}'s device), got meta")
    raise RuntimeError(f"{name}: expected a real device ({reference} is on {ref.device}), got meta")


@torch.library.register_fake("_C_cache_ops::reshape_and_cache_flash")
def _reshape_and_cache_flash_fake(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_scale_layout: str | None = None,
    v_scale_layout: str | None = None,
    key_sinks: torch.Tensor | None = None,
    key_sink_scale: torch.Tensor | None = None,
) -> None:
    _reject_real_and_meta(
        dict(
            key_cache=key_cache,
            key=key,
            value=value,
            value_cache=value_cache,
            slot_mapping=slot_mapping,
            k_scale=k_scale,
            v_scale=v_scale,
            key_sinks=key_sinks,
            key_sink_scale=key_sink_scale,
        ),
        "key_cache",
    )
    # Same dtype and scale rules as the compiled op, so that tracing rejects what it would.
    check_kernel_support(kv_cache_dtype)
    check_kv_dtypes(key, value, key_cache, value_cache, kv_cache_dtype)
    if slot_mapping.dtype != torch.int64:
        raise RuntimeError(
            f"slot_mapping: expected dtype int64, got {_dtype_name(slot_mapping.dtype)}"
        )
    kv_scale_as_1d(k_scale, "k_scale", key.shape[1])
    kv_scale_as_1d(v_scale, "v_scale", key.shape[1])
    check_key_sinks(key_sinks, key_sink_scale, key, key_cache)
    return None


@torch.library.register_fake("_C_cache_ops::swap_blocks")
def _swap_blocks_fake(
    src: torch.Tensor, dst: torch.Tensor, block_size_in_bytes: int, block_mapping: torch.Tensor
) -> None:
    _reject_real_and_meta(
        dict(dst=dst, src=src, block_mapping=block_mapping), "dst", same_device=False
    )


@torch.library.register_fake("_C_cache_ops::swap_blocks_batch")
def _swap_blocks_batch_fake(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, *_) -> None:
    return None  # raw addresses: nothing a fake tensor can check


@torch.library.register_fake("_C_cache_ops::convert_fp8")
def _convert_fp8_fake(
    dst_cache: torch.Tensor, src_cache: torch.Tensor, scale: float, kv_cache_dtype: str
) -> None:
    # The dtype, shape and scale rules live in the C++ op only (csrc/convert_fp8_torch.cpp): a
    # test helper does not need them twice, and a traced bad call fails when it runs.
    _reject_real_and_meta(dict(dst_cache=dst_cache, src_cache=src_cache), "dst_cache")


@torch.library.register_fake("_C_cache_ops::paged_attention")
def _paged_attention_fake(
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
    sliding_window: int,
    logits_soft_cap: float,
    sinks: torch.Tensor | None,
    causal: bool,
    k_scale_layout: str | None = None,
    v_scale_layout: str | None = None,
    simd: str = "auto",
    rope_cos_sin: torch.Tensor | None = None,
    rope_is_neox: bool = True,
    key_offset: torch.Tensor | None = None,
    sink_keys: torch.Tensor | None = None,
    key_hadamard: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    seq_causal: torch.Tensor | None = None,
    key_split: bool = True,
) -> None:
    _reject_real_and_meta(
        dict(
            key_cache=key_cache,
            out=out,
            query=query,
            value_cache=value_cache,
            block_table=block_table,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            k_scale=k_scale,
            v_scale=v_scale,
            sinks=sinks,
            rope_cos_sin=rope_cos_sin,
            key_offset=key_offset,
            sink_keys=sink_keys,
            alibi_slopes=alibi_slopes,
            seq_causal=seq_causal,
        ),
        "key_cache",
    )


def check_kernel_support(kv_cache_dtype: str) -> None:
    """``ValueError`` for a registered format the compiled kernels do not write (the registry's
    :func:`~vllm.kv_quant.formats.kernel_cache_kind`). A string that names no format goes on
    to the op, whose own parser rejects it with the same list of accepted names."""
    if find_format(kv_cache_dtype) is not None:
        kernel_cache_kind(kv_cache_dtype)


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_kv_dtypes(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    kv_cache_dtype: str,
) -> None:
    """The dtype rule of ``reshape_and_cache_flash`` (docs/design.md §6), the twin of the
    compiled op's check in ``csrc/cache_ops_torch.cpp`` with the same messages
    (``RuntimeError``): ``key`` float32, float16 or bfloat16 and ``value`` of the key's dtype,
    for every format; an unquantized cache holds the float dtype its string names (``auto``:
    any of the three, ``value_cache`` as ``key_cache``) whatever the key's, the op rounding each
    element to it as ``.to()`` does; a quantized cache holds its format's storage dtype. A string
    that names no format is left to the op's own error."""
    if key.dtype not in _FLOAT_DTYPES:
        raise RuntimeError(
            f"key: expected dtype float32, float16 or bfloat16, got {_dtype_name(key.dtype)}"
        )
    if value.dtype != key.dtype:
        raise RuntimeError(
            f"value: expected dtype {_dtype_name(key.dtype)} (key's dtype), "
            f"got {_dtype_name(value.dtype)}"
        )
    fmt = find_format(kv_cache_dtype)
    if fmt is None:
        return
    reason = f"for kv_cache_dtype '{kv_cache_dtype}'"
    expected = fmt.storage_dtype
    if expected is None:  # auto: the cache's own float dtype
        if key_cache.dtype not in _FLOAT_DTYPES:
            raise RuntimeError(
                f"key_cache: expected dtype float32, float16 or bfloat16 {reason}, "
                f"got {_dtype_name(key_cache.dtype)}"
            )
        expected, reason = key_cache.dtype, "(key_cache's dtype)"
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype != expected:
            raise RuntimeError(
                f"{name}: expected dtype {_dtype_name(expected)} {reason}, "
                f"got {_dtype_name(cache.dtype)}"
            )


def check_key_sinks(
    key_sinks: torch.Tensor | None,
    key_sink_scale: torch.Tensor | None,
    key: torch.Tensor,
    key_cache: torch.Tensor,
) -> None:
    """The key sink rules of ``reshape_and_cache_flash`` (docs/design.md §6), the twin of the
    compiled op's ``make_key_sinks`` (csrc/cache_ops_torch.cpp) with its messages
    (``RuntimeError``): both given or neither; ``key_sinks`` uint8 ``[B, S, H, D]`` (``B`` and
    ``N`` of ``key_cache``, ``H, D`` of ``key``) with ``1 <= S <= N`` and a contiguous last dim;
    ``key_sink_scale`` by the scale rule (``ValueError`` from
    :func:`~vllm.kv_quant.kv_scale.kv_scale_as_1d`, as for ``k_scale``)."""
    if (key_sinks is None) != (key_sink_scale is None):
        names = ["key_sinks", "key_sink_scale"]
        missing, given = names if key_sinks is None else names[::-1]
        raise RuntimeError(f"{missing}: expected a tensor with {given} (both or neither), got None")
    if key_sinks is None or key_sink_scale is None:
        return
    if key_sinks.dtype != torch.uint8:
        raise RuntimeError(f"key_sinks: expected dtype uint8, got {_dtype_name(key_sinks.dtype)}")
    blocks, block_size = key_cache.shape[:2]
    heads, head_size = key.shape[1], key.shape[-1]
    shape = list(key_sinks.shape)
    if not (
        len(shape) == 4
        and shape[0] == blocks
        and 1 <= shape[1] <= block_size
        and shape[2:] == [heads, head_size]
    ):
        raise RuntimeError(
            f"key_sinks: expected shape [num_blocks, S, H, D] = [{blocks}, S, {heads}, "
            f"{head_size}] with 1 <= S <= block_size = {block_size}, got shape {shape}"
        )
    if head_size > 1 and key_sinks.stride(3) != 1:
        raise RuntimeError(
            "key_sinks: expected a contiguous last dim (stride 1), got strides "
            f"{list(key_sinks.stride())}"
        )
    kv_scale_as_1d(key_sink_scale, "key_sink_scale", heads)


def _layout_name(layout: ScaleLayout | str | None) -> str | None:
    return layout.value if isinstance(layout, ScaleLayout) else layout


def _check_scale_values(name: str, scale: torch.Tensor, kv_cache_dtype: str) -> None:
    scale = scale.reshape(-1)
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name}: expected finite values > 0 for kv_cache_dtype {kv_cache_dtype!r}, "
            f"got {name}[{index}] = {scale[index].item()}"
        )


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_scale_layout: ScaleLayout | str | None = None,
    v_scale_layout: ScaleLayout | str | None = None,
    key_sinks: torch.Tensor | None = None,
    key_sink_scale: torch.Tensor | None = None,
    *,
    debug_checks: bool | None = None,
) -> None:
    """Write ``key [T_pad, H, D]`` / ``value [T_pad, H, Dv]`` token ``i < T`` into slot
    ``slot_mapping[i]`` of the paged caches (logical ``[B, N, H, D']``, NHD or HND), quantizing
    for ``kv_cache_dtype`` (docs/design.md §6). NVFP4 block-scale layouts: ``None`` is
    upstream's default, :meth:`ScaleLayout.default_for` the side's geometry (interleave4 where it
    fits, else linear); ``v_scale_layout=None`` with a named ``k_scale_layout`` means "same as K".

    ``key_sinks`` (uint8 ``[B, S, H, D]``, any strides but the last) with ``key_sink_scale``
    (fp32, one value or ``[H]``): a token written to page row ``t < S`` also gets
    ``key_sinks[page, t] = e4m3(key / key_sink_scale)`` in the same pass, for every format
    (:func:`vllm.kv_quant.key_sinks.write_key_sinks`'s bytes).

    ``debug_checks`` (default: env ``VLLM_KV_DEBUG_CHECKS=1``) checks on the host that the
    scales of a quantized cache (per-token-head caches store their own and ignore these) and
    ``key_sink_scale`` are finite and > 0 before the op runs; on CUDA this syncs.
    """
    check_kernel_support(kv_cache_dtype)
    if debug_checks is None:
        debug_checks = os.environ.get(DEBUG_CHECKS_ENV, "0") == "1"
    fmt = find_format(kv_cache_dtype)  # an unknown name goes on to the op's own error
    if debug_checks and fmt is not None and fmt.is_quantized and not fmt.is_per_token_head:
        _check_scale_values("k_scale", k_scale, kv_cache_dtype)
        _check_scale_values("v_scale", v_scale, kv_cache_dtype)
    if debug_checks and key_sink_scale is not None:
        _check_scale_values("key_sink_scale", key_sink_scale, kv_cache_dtype)
    torch.ops._C_cache_ops.reshape_and_cache_flash(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        kv_cache_dtype,
        k_scale,
        v_scale,
        _layout_name(k_scale_layout),
        _layout_name(v_scale_layout),
        key_sinks,
        key_sink_scale,
    )


def swap_blocks(
    src: torch.Tensor, dst: torch.Tensor, block_size_in_bytes: int, block_mapping: torch.Tensor
) -> None:
    """Copy whole pages: for each row ``(s, d)`` of ``block_mapping`` (int64 CPU ``[n, 2]``),
    bytes ``[s*block_size_in_bytes, (s+1)*block_size_in_bytes)`` of ``src``'s storage (from its
    data_ptr) go to page ``d`` of ``dst``. CPU↔CPU, CPU↔CUDA and CUDA→CUDA."""
    torch.ops._C_cache_ops.swap_blocks(src, dst, block_size_in_bytes, block_mapping)


def swap_blocks_batch(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    is_src_access_order_any: bool = False,
) -> None:
    """``sizes[i]`` bytes from address ``src_ptrs[i]`` to ``dst_ptrs[i]`` (int64 CPU vectors):
    host memory, or on a CUDA build any memory its devices reach, copied in stream order (which
    makes ``is_src_access_order_any``, leave to read sources out of order, moot)."""
    torch.ops._C_cache_ops.swap_blocks_batch(src_ptrs, dst_ptrs, sizes, is_src_access_order_any)


def convert_fp8(
    output: torch.Tensor, input: torch.Tensor, scale: float = 1.0, kv_dtype: str = "fp8"
) -> None:
    """Upstream's FP8 conversion helper: ``torch.ops._C_cache_ops.convert_fp8`` (docs/design.md
    §6), whose bytes are the reference codec's (:mod:`vllm.kv_quant.fp8`).

    The dtypes pick the direction: ``input`` fp32/fp16/bf16 and ``output`` FP8 bytes (uint8 or
    the variant's float8 dtype) quantizes, ``input / scale`` saturated; FP8 ``input`` and float
    ``output`` dequantizes, ``fp8(input) * scale`` in ``output``'s dtype. ``kv_dtype`` is ``fp8``
    / ``fp8_e4m3`` (E4M3), ``fp8_e5m2``, or ``auto`` (a plain float -> float cast, scale
    ignored). Shapes must match; either side may be non-contiguous.
    """
    torch.ops._C_cache_ops.convert_fp8(output, input, float(scale), kv_dtype)


def paged_attention(
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
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    k_scale_layout: ScaleLayout | str | None = None,
    v_scale_layout: ScaleLayout | str | None = None,
    simd: str = "auto",
    rope_cos_sin: torch.Tensor | None = None,
    rope_is_neox: bool = True,
    key_offset: torch.Tensor | None = None,
    sink_keys: torch.Tensor | None = None,
    key_hadamard: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    seq_causal: torch.Tensor | None = None,
    key_split: bool = True,
) -> None:
    """Paged attention of ``query [T, Hq, D]`` over the cache sides ``key_cache`` /
    ``value_cache`` (logical ``[B, N, Hkv, D']``, NHD or HND, any format
    ``reshape_and_cache_flash`` writes), into ``out [T, Hq, Dv]`` (query's dtype).

    ``block_table`` int32 ``[num_seqs, max_blocks]``, ``seq_lens`` int32 ``[num_seqs]`` (tokens
    in the cache), ``query_start_loc`` int32 ``[num_seqs + 1]`` (each sequence's query tokens are
    its last ones). ``k_scale`` / ``v_scale``: fp32, one value in any shape or ``[Hkv]``.
    ``sliding_window`` in tokens, ``logits_soft_cap`` and ``sinks`` (fp32 ``[Hq]`` logits)
    optional. Scale layouts as for :func:`reshape_and_cache_flash` (``None``: the default for the
    geometry). ``simd`` picks the CPU kernels' instruction set: ``"auto"`` or one of
    :func:`paged_attention_simd_levels`.

    Keys stored before RoPE (all optional, fp32, contiguous, on the cache's device): the key at
    position ``t`` (0-based, in its sequence) of KV head ``h`` of sequence ``s`` is
    ``sink_keys[s, t, h]`` (``[num_seqs, S, Hkv, D]``, real units) when ``t < S``, else the
    cache's dequantized key; rotated back by the fixed Hadamard rotation when ``key_hadamard``
    (:func:`vllm.kv_quant.hadamard_rotate`, its own inverse; power-of-two ``D``); plus
    ``key_offset[h]`` (``[Hkv, D]``, real units); then rotated by
    row ``t`` of ``rope_cos_sin`` (``[max_positions, rotary_dim]``: ``cos`` of the
    ``rotary_dim / 2`` frequencies, then their ``sin``, as upstream's ``cos_sin_cache``;
    ``rotary_dim`` even, at most ``D``; every ``seq_len <= max_positions``). ``rope_is_neox``
    rotates channel pairs ``(i, i + rotary_dim / 2)``, else ``(2i, 2i + 1)``; channels past
    ``rotary_dim`` are unchanged. Values are never transformed. Any of the three takes the
    kernels' slower decode-into-tile path.

    ``alibi_slopes`` (fp32 ``[Hq]``) adds ``slope * (key position - query position)`` to each
    score, after the soft cap. ``seq_causal`` (int32 ``[num_seqs]``, nonzero: causal) overrides
    ``causal`` per sequence. ``key_split=False`` keeps each (sequence, KV head, query block) on
    one thread instead of splitting its keys and merging the partial results.
    """
    torch.ops._C_cache_ops.paged_attention(
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        kv_cache_dtype,
        k_scale,
        v_scale,
        float(scale),
        0 if sliding_window is None else int(sliding_window),
        0.0 if logits_soft_cap is None else float(logits_soft_cap),
        sinks,
        causal,
        _layout_name(k_scale_layout),
        None if v_scale_layout is None else _layout_name(v_scale_layout),
        simd,
        rope_cos_sin,
        rope_is_neox,
        key_offset,
        sink_keys,
        key_hadamard,
        alibi_slopes,
        seq_causal,
        key_split,
    )


def paged_attention_simd_levels() -> list[str]:
    """Instruction-set levels of the CPU attention kernels in this build, widest first
    (``avx512``, ``avx2``, ``generic``; which exist depends on the compile target)."""
    return list(torch.ops._C_cache_ops.paged_attention_simd_levels())


# Upstream's CPU attention ops, on the kernels above (their arguments: vllm/_cpu_attn_args.py).


def cpu_attn_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    isa: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """Write ``key`` / ``value`` ``[T, num_kv_heads, head_size]`` token ``i`` into slot
    ``slot_mapping[i]`` (negative: skipped) of ``key_cache`` / ``value_cache``
    (``[num_blocks, num_kv_heads, block_size, head_size]``), quantizing for ``kv_cache_dtype``
    with the per-tensor ``k_scale`` / ``v_scale`` (FP8: uint8 caches, ``value / scale`` rounded
    to nearest even)."""
    cpu_attn_args.check_isa(isa)
    reshape_and_cache_flash(
        key,
        value,
        cpu_attn_args.cache_view(key_cache, "key_cache"),
        cpu_attn_args.cache_view(value_cache, "value_cache"),
        slot_mapping,
        kv_cache_dtype,
        cpu_attn_args.scale_arg(k_scale),
        cpu_attn_args.scale_arg(v_scale),
    )


def cpu_attention_with_kv_cache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    block_table: torch.Tensor,
    softcap: float,
    scheduler_metadata: torch.Tensor,
    s_aux: torch.Tensor | None,
    dynamic_causal: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """Paged attention of ``query [T, num_heads, head_size]`` over the caches of
    :func:`cpu_attn_reshape_and_cache` into ``output`` (same shape and dtype). Sequence ``i``
    has ``seq_lens[i]`` tokens, its queries are its last ones (rows ``query_start_loc[i]`` ..
    ``query_start_loc[i + 1] - 1``); ``block_table [num_reqs, max_blocks]`` names its pages.
    ``causal`` (or per sequence, ``dynamic_causal``: nonzero is causal), ``sliding_window``
    (``-1``: none; without causality the window reaches both ways), ``softcap`` (``0``: none),
    ``alibi_slopes [num_heads]`` (score ``+= slope * (key position - query position)``) and
    the sink logits ``s_aux [num_heads]`` as upstream defines them; ``k_scale`` / ``v_scale``
    dequantize an FP8 cache."""
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if query.dim() != 3:
        raise ValueError(
            f"query: expected a 3-D tensor [T, num_heads, head_size], got shape "
            f"{tuple(query.shape)}"
        )
    fields = cpu_attn_args.check_metadata(
        scheduler_metadata,
        {
            "num_reqs": num_reqs,
            "num_heads": query.shape[1],
            "num_kv_heads": key_cache.shape[1] if key_cache.dim() == 4 else -1,
            "head_dim": query.shape[2],
            "causal": int(causal),
            "sliding_window": sliding_window,
            "dynamic_causal": int(dynamic_causal is not None),
        },
    )
    if softcap < 0:
        raise ValueError(f"softcap: expected a cap > 0 or 0 (none), got {softcap}")
    sinks = None if s_aux is None else s_aux.to(torch.float32).contiguous()
    slopes = None if alibi_slopes is None else alibi_slopes.to(torch.float32).contiguous()
    paged_attention(
        output,
        query,
        cpu_attn_args.cache_view(key_cache, "key_cache"),
        cpu_attn_args.cache_view(value_cache, "value_cache"),
        block_table,
        seq_lens,
        query_start_loc,
        kv_cache_dtype,
        cpu_attn_args.scale_arg(k_scale),
        cpu_attn_args.scale_arg(v_scale),
        scale,
        sliding_window=cpu_attn_args.window_arg("sliding_window", sliding_window),
        logits_soft_cap=float(softcap) if softcap > 0 else None,
        sinks=sinks,
        causal=causal,
        alibi_slopes=slopes,
        seq_causal=cpu_attn_args.dynamic_causal_arg(dynamic_causal, num_reqs),
        key_split=bool(fields["enable_kv_split"]),
    )
