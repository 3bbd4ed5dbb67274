"""The one rule for a KV-cache dequantization scale (``k_scale`` / ``v_scale``).

A scale is a float32 tensor that is either *per-tensor* (exactly one element, in any shape:
upstream engines keep ``layer._k_scale`` as a 0-d tensor, reductions such as ``key.amax()`` are
0-d, older code uses ``[1]``) or *per-head* (shape ``[H]``, one value per KV head). The C++ op
applies the same rule in ``check_scale`` (csrc/cache_ops_torch.cpp).
"""

from __future__ import annotations

import torch


def is_per_tensor_scale(scale: torch.Tensor) -> bool:
    """True when ``scale`` holds one value (0-d, ``[1]``, ``[1, 1]``, ...)."""
    return scale.numel() == 1


def kv_scale_as_1d(scale: object, name: str, num_heads: int | None) -> torch.Tensor:
    """Check ``scale`` against the scale rule and return it as a 1-D float32 view.

    Returns ``[1]`` for a per-tensor scale and ``[H]`` for a per-head one. ``num_heads=None``
    means the caller has no head dimension, so only a per-tensor scale is accepted. Raises
    ``ValueError`` naming ``name`` otherwise.
    """
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"{name}: expected a torch.float32 tensor, got {got}")
    if is_per_tensor_scale(scale):
        return scale if scale.dim() == 1 else scale.reshape(1)
    if num_heads is not None and scale.dim() == 1 and scale.shape[0] == num_heads:
        return scale
    per_head = "" if num_heads is None else f" or [H] = [{num_heads}]"
    raise ValueError(
        f"{name}: expected one value (shape [], [1], ...){per_head}, got shape {list(scale.shape)}"
    )
