"""Quantization helpers that upstream vLLM's kernel tests import (``scaled_dequantize``,
``get_fp8_min_max``, ``group_broadcast``).

``x = x_q * x_s`` in fp32, then cast: ``x_s`` is one value (per-tensor, any shape) or a grid of
per-group scales, each covering a ``group_shape = (rows, cols)`` tile of the last two dims of
``x_q`` (``-1`` in ``group_shape`` means the whole extent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


def get_fp8_min_max() -> tuple[float, float]:
    """``(min, max)`` of the platform's FP8 dtype (``current_platform.fp8_dtype()``: e4m3fn, so
    ``(-448.0, 448.0)``), the saturation bounds of FP8 quantization."""
    from vllm.platforms import current_platform

    finfo = torch.finfo(current_platform.fp8_dtype())
    return float(finfo.min), float(finfo.max)


def group_broadcast(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` repeated along each dim where its size (missing trailing dims count as 1) divides
    but differs from ``shape``'s, so that it broadcasts against a tensor of ``shape``: a grid of
    per-group scales becomes one scale per element (dims of size 1 stay for broadcasting)."""
    for dim, size in enumerate(shape):
        have = t.shape[dim] if dim < t.dim() else 1
        if have in (1, size):
            continue
        if size % have:
            raise ValueError(
                f"t: expected dim {dim} of size dividing {size} (or 1), got {have} "
                f"(t {list(t.shape)}, shape {list(shape)})"
            )
        t = t.repeat_interleave(size // have, dim=dim)
    return t


class GroupShape(NamedTuple):
    """Elements of ``x_q``'s last two dims that share one scale; ``-1`` is the full extent."""

    group_rows: int
    group_cols: int


def _full_group_shape(x_q: torch.Tensor, group_shape: tuple[int, int]) -> tuple[int, int]:
    rows, cols = group_shape
    return (x_q.shape[-2] if rows == -1 else rows, x_q.shape[-1] if cols == -1 else cols)


def scaled_dequantize(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    group_shape: GroupShape | tuple[int, int] | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x_q`` (any numeric dtype, ``[..., M, N]``) times its scales, as ``out_dtype``.

    ``group_shape=None``: ``x_s`` is one value (0-d, ``[1]``, ...) or already broadcastable.
    Otherwise ``x_s`` is ``[..., M / rows, N / cols]``; a 1-D ``x_s`` is one scale per column
    group when ``rows == M`` and per row group when ``cols == N``. ``ValueError`` on a scale
    grid that does not tile ``x_q``.
    """
    scale = x_s.to(torch.float32)
    if group_shape is not None:
        if x_q.dim() < 2:
            raise ValueError(f"x_q: expected at least 2 dims [..., M, N], got {list(x_q.shape)}")
        rows, cols = _full_group_shape(x_q, tuple(group_shape))
        m, n = x_q.shape[-2], x_q.shape[-1]
        if scale.dim() == 0:
            scale = scale.reshape(1, 1)
        elif scale.dim() == 1:
            if rows == m:
                scale = scale.unsqueeze(-2)
            elif cols == n:
                scale = scale.unsqueeze(-1)
            else:
                raise ValueError(
                    f"x_s: a 1-D scale needs group_shape to span all rows ({m}) or all "
                    f"columns ({n}), got {(rows, cols)}"
                )
        if m % rows or n % cols or tuple(scale.shape[-2:]) != (m // rows, n // cols):
            raise ValueError(
                f"x_s: expected [..., {m}/{rows}, {n}/{cols}] scales for group_shape "
                f"{(rows, cols)} and x_q {list(x_q.shape)}, got {list(x_s.shape)}"
            )
        scale = scale.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)
    elif scale.numel() == 1:
        scale = scale.reshape(())
    return (x_q.to(torch.float32) * scale).to(out_dtype)
