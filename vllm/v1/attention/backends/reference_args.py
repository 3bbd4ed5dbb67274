"""Argument checks of the reference attention impl (and the impls built on it): the
constructor's plain arguments, the NVFP4 block-scale layouts and a forward call's output."""

from __future__ import annotations

import math

import torch

from vllm.kv_quant import ScaleLayout, kv_scale_as_1d
from vllm.kv_quant.formats import KVCacheFormat
from vllm.utils import check_positive_int

__all__ = ["check_impl_args", "check_output", "check_scale", "check_side", "one_layout"]


def check_impl_args(
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    sinks: torch.Tensor | None,
) -> None:
    """``ValueError`` for the first bad constructor argument that needs no format: positive
    head counts and sizes (elements), ``num_heads`` a multiple of ``num_kv_heads``, a positive
    ``sliding_window`` (tokens) and ``logits_soft_cap``, ``sinks`` of shape ``[num_heads]``."""
    for name, value in (
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
        ("head_size_v", head_size_v),
    ):
        check_positive_int(name, value)
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads: expected a multiple of num_kv_heads={num_kv_heads} (GQA), got {num_heads}"
        )
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window <= 0
    ):
        raise ValueError(
            f"sliding_window: expected None or a positive int (tokens), got {sliding_window!r}"
        )
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(
            f"logits_soft_cap: expected None or a positive float, got {logits_soft_cap!r}"
        )
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != num_heads):
        raise ValueError(
            f"sinks: expected shape [num_heads] = [{num_heads}], got {list(sinks.shape)}"
        )


def one_layout(
    name: str, given: ScaleLayout | str | None, encoded: ScaleLayout | None
) -> ScaleLayout | None:
    """A side's block-scale layout from the constructor argument and the encoding (either may
    name it; ``ValueError`` when both do, differently)."""
    layout = None if given is None else ScaleLayout.parse(given)
    if layout is not None and encoded is not None and layout is not encoded:
        raise ValueError(
            f"{name}: expected the encoding's {encoded.value} (or None), got {layout.value}"
        )
    return layout if layout is not None else encoded


def check_output(
    output: torch.Tensor, query: torch.Tensor, num_tokens: int, num_heads: int, head_size_v: int
) -> None:
    """``output [>= num_tokens, num_heads, head_size_v]`` in the query's dtype and device."""
    if output.dim() != 3 or tuple(output.shape[1:]) != (num_heads, head_size_v):
        raise ValueError(
            f"output: expected shape [T, {num_heads}, {head_size_v}], got {list(output.shape)}"
        )
    if output.shape[0] < num_tokens:
        raise ValueError(
            f"output: expected at least num_actual_tokens={num_tokens} rows, got {output.shape[0]}"
        )
    if output.dtype != query.dtype or output.device != query.device:
        raise ValueError(
            f"output: expected dtype {query.dtype} on {query.device} (the query's), "
            f"got {output.dtype} on {output.device}"
        )


def check_side(
    side: torch.Tensor,
    name: str,
    num_kv_heads: int,
    row_dim: int,
    head_size: int,
    fmt: KVCacheFormat,
    kv_cache_dtype: str,
) -> None:
    """A ``(B, N, num_kv_heads, row_dim)`` cache side in ``fmt``'s storage dtype (any float
    dtype for an unquantized format); ``head_size`` (elements) and ``kv_cache_dtype`` name it
    in the error."""
    if side.dim() != 4 or side.shape[2] != num_kv_heads or side.shape[3] != row_dim:
        raise ValueError(
            f"{name}: expected a (B, N, {num_kv_heads}, {row_dim}) cache side for "
            f"kv_cache_dtype={kv_cache_dtype!r}, head size {head_size}, got shape "
            f"{list(side.shape)}"
        )
    storage = fmt.storage_dtype
    if fmt.is_quantized and side.dtype != storage:
        raise ValueError(
            f"{name}: expected dtype {storage} for a {kv_cache_dtype} cache, got {side.dtype}"
        )
    if not fmt.is_quantized and not side.dtype.is_floating_point:
        raise ValueError(
            f"{name}: expected a floating dtype for kv_cache_dtype={kv_cache_dtype!r}, "
            f"got {side.dtype}"
        )


def check_scale(scale: torch.Tensor, name: str, num_kv_heads: int) -> torch.Tensor:
    """``scale`` as a 1-D ``[1]`` or ``[num_kv_heads]`` tensor of finite values > 0."""
    scale = kv_scale_as_1d(scale, name, num_kv_heads)
    # One host copy of the (at most num_kv_heads) values: cheaper per call than tensor ops.
    values = scale.tolist()
    if not all(0 < v < math.inf for v in values):  # NaN fails too
        raise ValueError(f"{name}: a quantized KV cache needs finite scales > 0, got {values}")
    return scale
