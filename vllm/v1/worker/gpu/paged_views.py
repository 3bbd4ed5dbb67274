"""Typed page views over the KV cache's raw int8 buffers, and the cache-dtype name a backend
is given for a spec (split out of :mod:`vllm.v1.worker.gpu.attn_utils`, which re-exports them).

Units: ``*_elems`` are elements of the view's dtype, ``*_bytes`` bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.kv_quant.formats import AUTO, find_format, format_for_storage
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec, LatentPageSpec

__all__ = ["spec_cache_dtype_str"]


def _is_mla_spec(spec: KVCacheSpec) -> bool:
    """MLA-like specs (one latent slot per stored token): ``MLAAttentionSpec`` and its
    sliding-window sibling."""
    return isinstance(spec, LatentPageSpec)


def spec_cache_dtype_str(spec: KVCacheSpec, cache_dtype: str | None = None) -> str:
    """The ``cache_dtype_str`` a backend gets for ``spec``.

    The spec is the per-layer truth (layers kept unquantized by ``kv_cache_dtype_skip_layers``
    say so in their spec), read through its encoding's format (``spec.kv_cache_format``): a
    format the encoding names beyond ``(kv_quant_mode, dtype)`` → its name (``fp8_e5m2``,
    ``nvfp4_mse``); else the format of ``cache_dtype`` (a dtype string or encoding id) when it
    has the spec's quantization, else the primary name (``"fp8"``, ``"nvfp4"``); unquantized →
    ``"auto"``; MLA specs with ``cache_dtype_str`` (e.g. ``"fp8_ds_mla"``) → that string.
    """
    mla_str = getattr(spec, "cache_dtype_str", None)
    if mla_str is not None:
        return mla_str
    if not isinstance(spec, AttentionSpec) or not spec.kv_cache_format.is_quantized:
        return AUTO.name
    fmt = spec.kv_cache_format
    if fmt is not format_for_storage(fmt.quant_mode, spec.dtype):
        return fmt.name  # the spec's encoding names its format (fp8_e5m2, nvfp4_mse)
    if cache_dtype is not None:
        named = KVCacheEncoding.parse(cache_dtype, "cache_dtype").format
        if named.quant_mode == fmt.quant_mode:  # the variant the request named
            return cache_dtype if find_format(cache_dtype) is named else named.name
    return fmt.accepted_names[0]  # the format's primary name: "fp8" for FP8


def _view_nbytes(shape: Sequence[int], strides: Sequence[int], offset: int, itemsize: int) -> int:
    """Bytes of storage a view needs: ``(last element offset + 1) * itemsize`` (0 if empty)."""
    if any(s == 0 for s in shape):
        return 0
    last = offset + sum((s - 1) * st for s, st in zip(shape, strides, strict=True))
    return (last + 1) * itemsize


def _paged_view(
    raw: torch.Tensor,
    dtype: torch.dtype,
    logical_shape: Sequence[int],
    stride_order: Sequence[int],
    block_stride_elems: int,
    offset_elems: int,
    what: str,
) -> torch.Tensor:
    """A view of the int8 buffer ``raw`` as ``dtype`` with ``logical_shape``.

    Dim 0 (pages) has stride ``block_stride_elems``; within a page the dims are dense in the
    physical order ``stride_order`` (``stride_order[i]`` = the logical dim that is i-th
    outermost; ``stride_order[0]`` must be 0). The view starts ``offset_elems`` in.
    """
    ndim = len(logical_shape)
    if sorted(stride_order) != list(range(ndim)) or stride_order[0] != 0:
        raise ValueError(
            f"{what}: stride order {tuple(stride_order)} is not a permutation of the "
            f"{ndim} cache dims with the page dim (0) outermost"
        )
    phys_shape = [logical_shape[d] for d in stride_order]
    phys_strides = [0] * ndim
    running = 1
    for i in range(ndim - 1, 0, -1):
        phys_strides[i] = running
        running *= phys_shape[i]
    phys_strides[0] = block_stride_elems
    if running > block_stride_elems:
        raise ValueError(
            f"{what}: a page of {running} elements does not fit the page stride of "
            f"{block_stride_elems} elements"
        )
    strides = [0] * ndim
    for i, d in enumerate(stride_order):
        strides[d] = phys_strides[i]
    itemsize = get_dtype_size(dtype)
    usable_bytes = raw.numel() // itemsize * itemsize
    needed = _view_nbytes(logical_shape, strides, offset_elems, itemsize)
    if needed > usable_bytes:
        raise ValueError(
            f"{what}: the view {tuple(logical_shape)} with strides {tuple(strides)} needs "
            f"{needed} bytes, the buffer has {raw.numel()}"
        )
    typed = raw[:usable_bytes].view(dtype)
    return typed.as_strided(
        tuple(logical_shape), tuple(strides), typed.storage_offset() + offset_elems
    )
