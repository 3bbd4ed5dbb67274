"""Test helpers for packed NVFP4 KV caches.

:func:`dequant_nvfp4_kv_cache` has upstream vLLM's signature and semantics (HND planes, scales
in upstream's 4x4-swizzled order); its un-swizzle is written out here independently of
``vllm.kv_quant.scale_layout`` so that tests can check that module against it.
:func:`dequant_nvfp4_kv_cache_nhd` reads the split views of one side in our NHD-logical order
with any :class:`~vllm.kv_quant.scale_layout.ScaleLayout`.
"""

from __future__ import annotations

import torch

from vllm.kv_quant.nvfp4 import NVFP4_GROUP_SIZE, dequantize_nvfp4, e2m1_decode
from vllm.kv_quant.scale_layout import ScaleLayout, from_layout


def unswizzle_4x4(stored: torch.Tensor) -> torch.Tensor:
    """Linear ``[..., T, S]`` scale planes from planes in upstream's 4x4 swizzle: the stored
    plane viewed as ``(T/4, 4, S/4, 4)`` and read in ``(0, 3, 1, 2)`` order is linear."""
    *batch, tokens, scales = stored.shape
    tiles = stored.reshape(*batch, tokens // 4, 4, scales // 4, 4)
    n = tiles.dim()
    order = [*range(n - 4), n - 4, n - 1, n - 3, n - 2]
    return tiles.permute(*order).reshape(*batch, tokens, scales)


def dequant_nvfp4_kv_cache(
    fp4_data: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: float | torch.Tensor,
    head_size: int,
    block_size: int,
) -> torch.Tensor:
    """Upstream's test helper: dequantize HND NVFP4 planes to fp32 ``[..., T, head_size]``.

    ``fp4_data [..., T, D/2]`` (uint8 packed E2M1) and ``block_scale [..., T, D/16]`` (uint8 or
    float8_e4m3fn, 4x4-swizzled per ``[T, S]`` plane, as upstream writes it) end in the
    ``(block_size, last_dim)`` plane: permute NHD caches to HND first. ``global_scale`` is the
    side's per-tensor scale (a float or one-value tensor).
    """
    num_scales = head_size // NVFP4_GROUP_SIZE
    if tuple(fp4_data.shape[-2:]) != (block_size, head_size // 2):
        raise ValueError(
            f"fp4_data: expected shape [..., {block_size}, {head_size // 2}], "
            f"got {list(fp4_data.shape)}"
        )
    if tuple(block_scale.shape) != (*fp4_data.shape[:-1], num_scales):
        raise ValueError(
            f"block_scale: expected shape {[*fp4_data.shape[:-1], num_scales]}, "
            f"got {list(block_scale.shape)}"
        )
    linear = unswizzle_4x4(block_scale.view(torch.uint8))
    group_scale = linear.view(torch.float8_e4m3fn).float() * global_scale
    codes = torch.stack((fp4_data & 0x0F, fp4_data >> 4), dim=-1)  # low nibble first
    values = e2m1_decode(codes).reshape(*fp4_data.shape[:-1], num_scales, NVFP4_GROUP_SIZE)
    return (values * group_scale.unsqueeze(-1)).reshape(*fp4_data.shape[:-1], head_size)


def dequant_nvfp4_kv_cache_nhd(
    fp4_data: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    head_size: int,
    block_size: int,
    scale_layout: ScaleLayout | str | None = None,
) -> torch.Tensor:
    """Dequantize one side of a packed NVFP4 cache to fp32 ``(B, N, H, D)``.

    ``fp4_data (B, N, H, D/2)`` and ``block_scale (B, N, H, D/16)`` are the views that
    :func:`vllm.utils.torch_utils.nvfp4_kv_cache_split_views` returns for the side;
    ``global_scale`` is the side's fp32 one-value or ``[H]`` scale; ``scale_layout`` is the
    layout the cache was written with (``None``: the default for the geometry).
    """
    num_scales = head_size // NVFP4_GROUP_SIZE
    expected = (block_size, head_size // 2)
    if (fp4_data.shape[1], fp4_data.shape[3]) != expected:
        raise ValueError(
            f"fp4_data: expected shape (B, {block_size}, H, {head_size // 2}), "
            f"got {tuple(fp4_data.shape)}"
        )
    if tuple(block_scale.shape) != (*fp4_data.shape[:3], num_scales):
        raise ValueError(
            f"block_scale: expected shape {(*fp4_data.shape[:3], num_scales)}, "
            f"got {tuple(block_scale.shape)}"
        )
    layout = ScaleLayout.resolve(scale_layout, block_size, head_size)
    scales = block_scale.view(torch.uint8)
    # One [N, S] plane per (page, head) holds the scales in the cache's layout.
    linear = from_layout(scales.permute(0, 2, 1, 3), layout).permute(0, 2, 1, 3)
    return dequantize_nvfp4(fp4_data, linear, global_scale.reshape(-1))
