"""Test helpers for packed NVFP4 KV caches, built on the reference codecs in vllm.kv_quant."""

from __future__ import annotations

import torch

from vllm.kv_quant.nvfp4 import NVFP4_GROUP_SIZE, dequantize_nvfp4
from vllm.kv_quant.scale_layout import ScaleLayout, from_layout


def dequant_nvfp4_kv_cache(
    fp4_data: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    head_size: int,
    block_size: int,
    scale_layout: ScaleLayout | str = ScaleLayout.LINEAR,
) -> torch.Tensor:
    """Dequantize one side of a packed NVFP4 cache to fp32 ``(B, N, H, D)``.

    ``fp4_data (B, N, H, D/2)`` and ``block_scale (B, N, H, D/16)`` are the views that
    :func:`vllm.utils.torch_utils.nvfp4_kv_cache_split_views` returns for the side;
    ``global_scale`` is the side's fp32 ``[1]`` or ``[H]`` scale; ``scale_layout`` is the layout
    the cache was written with.
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
    scales = block_scale.view(torch.uint8) if block_scale.dtype != torch.uint8 else block_scale
    # One [N, S] plane per (page, head) holds the scales in the cache's layout.
    linear = from_layout(scales.permute(0, 2, 1, 3), scale_layout).permute(0, 2, 1, 3)
    return dequantize_nvfp4(fp4_data, linear, global_scale)
