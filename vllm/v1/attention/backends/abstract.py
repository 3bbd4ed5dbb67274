"""The backend base classes under their older path, and helpers for writing a backend.

:class:`AttentionBackend`, :class:`AttentionImpl` and the types they share are defined in
:mod:`vllm.v1.attention.backend` (upstream's path) and re-exported here. Defined here: the
layer-scale holder an engine hands the impls (:class:`AttentionLayerScales`), an impl's softmax
scale, and the paged K/V cache shape that most backends return.
"""

from __future__ import annotations

import contextlib
import math
import numbers

import torch

from vllm.kv_quant.formats import lookup
from vllm.kv_quant.kv_scale import kv_scale_as_1d
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    DeviceCapability,
    KVCacheScaleLayouts,
    MultipleOf,
    as_device_capability,
    get_device_capability,
)

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionLayer",
    "AttentionLayerScales",
    "DeviceCapability",
    "KVCacheScaleLayouts",
    "MultipleOf",
    "as_device_capability",
    "check_kv_cache_shape_args",
    "get_device_capability",
    "kv_cache_dim",
    "paged_kv_cache_shape",
    "softmax_scale",
]


class AttentionLayerScales:
    """A minimal :class:`AttentionLayer`: holds ``k_scale`` / ``v_scale``, the dequantization
    scales of a quantized cache (fp32, one value in any shape, e.g. 0-d as upstream layers hold
    them, or ``[H]``; default ``[1.0]``).

    The impls read upstream's private ``_k_scale`` / ``_v_scale``; an engine reads
    :attr:`k_scale` / :attr:`v_scale` and sets both with :meth:`set_kv_scales` (e.g. from
    :meth:`vllm.kv_quant.KVScaleObserver.scales`). The constructor stores what it is given
    unchecked (the impls check at each call). Everything else an encoding needs (key offset,
    RoPE, sink rows) is the impl's or the pages'."""

    def __init__(
        self, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
    ) -> None:
        self._k_scale = torch.ones(1, dtype=torch.float32) if k_scale is None else k_scale
        self._v_scale = torch.ones(1, dtype=torch.float32) if v_scale is None else v_scale

    @property
    def k_scale(self) -> torch.Tensor:
        """The K dequantization scale the impls read (``_k_scale``)."""
        return self._k_scale

    @property
    def v_scale(self) -> torch.Tensor:
        """The V dequantization scale the impls read (``_v_scale``)."""
        return self._v_scale

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Replace both scales after checking both (nothing changes on an error): fp32, one
        value in any shape or ``[H]``, finite and > 0 (a host sync for a device tensor)."""
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            per_head = isinstance(scale, torch.Tensor) and scale.dim() == 1
            kv_scale_as_1d(scale, name, scale.shape[0] if per_head else None)
            if not bool((torch.isfinite(scale) & (scale > 0)).all()):
                raise ValueError(
                    f"{name}: expected finite scales > 0, got {scale.flatten().tolist()}"
                )
        self._k_scale, self._v_scale = k_scale, v_scale


def softmax_scale(scale: float | None, head_size: int) -> float:
    """An impl's softmax scale: ``1/sqrt(head_size)`` for ``None``, else ``scale`` as a float.
    Any finite value is taken, as upstream's impls take it (``float(scale)``); ``ValueError``
    for anything else: a NaN or infinite scale turns every output into NaN, and the compiled
    kernels would refuse it only after the new K/V were written."""
    if scale is None:
        return 1.0 / math.sqrt(head_size)
    # A real number or a one-element tensor, as float(scale) takes them; not str or bool.
    value = math.nan
    if isinstance(scale, numbers.Real | torch.Tensor) and not isinstance(scale, bool):
        # 10**400 overflows; a tensor of several values has no float.
        with contextlib.suppress(OverflowError, RuntimeError, ValueError):
            value = float(scale)
    if not math.isfinite(value):
        raise ValueError(
            f"scale: expected None or a finite float (the softmax scale), got {scale!r}"
        )
    return value


def kv_cache_dim(head_size: int, cache_dtype_str: str) -> int:
    """Last dim ``D'`` of a paged K/V cache (the registry's row size): ``F(D)`` bytes for NVFP4,
    else ``D``."""
    return lookup(cache_dtype_str, "cache_dtype_str").last_dim(head_size)


def check_kv_cache_shape_args(
    name: str, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> None:
    """``ValueError`` naming the first non-positive shape argument (``num_blocks`` ≥ 0)."""
    for arg, value, low in (
        ("num_blocks", num_blocks, 0),
        ("block_size", block_size, 1),
        ("num_kv_heads", num_kv_heads, 1),
        ("head_size", head_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(
                f"{arg}: {name}.get_kv_cache_shape expects an int >= {low}, got {value!r}"
            )


def paged_kv_cache_shape(
    name: str,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    cache_dtype_str: str = "auto",
) -> tuple[int, ...]:
    """The paged K/V cache shape ``(num_blocks, 2, block_size, num_kv_heads, D')`` (``D'`` from
    :func:`kv_cache_dim`), after :func:`check_kv_cache_shape_args` on the arguments."""
    check_kv_cache_shape_args(name, num_blocks, block_size, num_kv_heads, head_size)
    return (num_blocks, 2, block_size, num_kv_heads, kv_cache_dim(head_size, cache_dtype_str))
