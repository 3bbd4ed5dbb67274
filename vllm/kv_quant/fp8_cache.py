"""Whole-page reference writer and reader of an FP8 KV-cache side.

A side is a uint8 tensor with logical shape ``(B, N, H, D)`` (any strides: NHD, HND or a page
stride larger than one side) holding FP8 bytes as produced by :func:`quantize_fp8`.
"""

from __future__ import annotations

import torch

from vllm.kv_quant.fp8 import Fp8Format, dequantize_fp8, quantize_fp8
from vllm.kv_quant.nvfp4_cache import check_slot_mapping

_FLOAT_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_side(cache_side: torch.Tensor) -> None:
    if cache_side.dim() != 4 or cache_side.dtype != torch.uint8:
        raise ValueError(
            f"cache_side: expected a uint8 (B, N, H, D) tensor, got {cache_side.dtype} "
            f"of shape {list(cache_side.shape)}"
        )


def fp8_write_cache(
    x: torch.Tensor,
    cache_side: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor,
    fmt: Fp8Format | str = Fp8Format.E4M3,
) -> None:
    """Quantize the first ``T`` tokens of ``x [T_pad, H, D]`` with :func:`quantize_fp8` and
    write them into ``cache_side (B, N, H, D)`` in place.

    Token ``i`` goes to page ``slot_mapping[i] // N``, row ``slot_mapping[i] % N``; negative
    slots are skipped; a slot ``>= B*N`` raises ``ValueError`` before anything is written.
    ``scale`` is the fp32 dequantization scale: one value (any shape) or ``[H]``.
    """
    _check_side(cache_side)
    if x.dtype not in _FLOAT_INPUT_DTYPES:
        raise ValueError(f"x: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    num_blocks, block_size, num_heads, head_size = cache_side.shape
    if x.dim() != 3 or tuple(x.shape[1:]) != (num_heads, head_size):
        raise ValueError(
            f"x: expected shape [T_pad, {num_heads}, {head_size}] to match cache_side, "
            f"got {list(x.shape)}"
        )
    if x.device != cache_side.device:
        raise ValueError(f"x: expected device {cache_side.device} (the cache's), got {x.device}")
    check_slot_mapping(slot_mapping, x.shape[0], num_blocks * block_size, cache_side.device)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    q = quantize_fp8(x[: slot_mapping.shape[0]][keep], scale, fmt)
    cache_side[slots // block_size, slots % block_size] = q


def fp8_read_cache(
    cache_side: torch.Tensor,
    scale: torch.Tensor,
    fmt: Fp8Format | str = Fp8Format.E4M3,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize a whole FP8 cache side ``(B, N, H, D)``: ``float32(q) * scale``, cast to
    ``out_dtype``. ``scale``: fp32, one value or ``[H]``."""
    _check_side(cache_side)
    return dequantize_fp8(cache_side, scale, fmt, out_dtype)
