"""Reference codec of the per-token-head caches (``int8_per_token_head``, ``fp8_per_token_head``).

Each cached row (one token, one KV head, one side) is ``D`` one-byte values followed by their
own fp32 dequantization scale, little-endian, in the row's last 4 bytes (upstream vLLM's inline
layout: the cache's last dim is ``D + 4``). The writer computes the scale from the row itself, so
``k_scale`` / ``v_scale`` play no part. For one row ``x[0..D-1]`` (widened to fp32 exactly), in
fp32 (docs/design.md §5.4, docs/formats.md §4):

1. ``amax = max |x_i|`` over the finite ``x_i`` (0 when there are none);
2. ``scale = max(amax / QMAX, 1e-6)``, ``QMAX`` 127 (int8) or 448 (e4m3); the floor keeps a
   zero row's inverse finite;
3. ``inv = 1 / scale``, ``y_i = x_i * inv`` (upstream multiplies by the inverse: two roundings);
4. int8: ``q_i = round_half_even(clamp(y_i, -127, 127))``; fp8: ``q_i = e4m3(clamp(y_i, -448,
   448))`` rounded to nearest even. ``±Inf`` saturates to ``±QMAX`` through the clamp;
5. a row holding a NaN gets scale NaN (``0x7FC00000``) and all-zero value bytes, so it reads back
   as NaN everywhere instead of passing for data.

Reading: ``float(q_i) * scale``. Every step is one IEEE fp32 operation between tensors (never a
tensor and a Python scalar, which CUDA torch turns into a multiply by the inverse), so CPU and
CUDA give the same bytes and the compiled kernels are tested against these functions bit for bit.
"""

from __future__ import annotations

import torch

from vllm.kv_quant.formats import PER_TOKEN_HEAD_SCALE_BYTES, KVCacheFormat, KVQuantMode, lookup
from vllm.kv_quant.fp8 import (
    _FLOAT_INPUT_DTYPES,
    Fp8Format,
    fp8_bytes_to_fp32,
    fp32_to_fp8_bytes,
)
from vllm.kv_quant.nvfp4_cache import check_slot_mapping

INT8_PER_TOKEN_HEAD_MAX = 127.0
"""Largest int8 magnitude a per-token-head scale maps ``amax`` to."""

PER_TOKEN_HEAD_SCALE_FLOOR = 1e-6
"""Smallest scale the writer stores (as fp32): rows with ``amax < 1e-6 * QMAX`` share it."""

NAN_SCALE_BITS = 0x7FC00000
"""The scale's bits in a row that held a NaN."""


def per_token_head_format(kv_cache_dtype: str | KVCacheFormat) -> KVCacheFormat:
    """The registry's per-token-head format named by ``kv_cache_dtype``; ``ValueError``
    otherwise."""
    fmt = kv_cache_dtype if isinstance(kv_cache_dtype, KVCacheFormat) else lookup(kv_cache_dtype)
    if not fmt.is_per_token_head:
        raise ValueError(
            f"kv_cache_dtype: expected a per-token-head format (int8_per_token_head, "
            f"fp8_per_token_head), got {fmt.name!r}"
        )
    return fmt


def per_token_head_qmax(kv_cache_dtype: str | KVCacheFormat) -> float:
    """``QMAX`` of a per-token-head format: 127 (int8) or 448 (e4m3)."""
    fmt = per_token_head_format(kv_cache_dtype)
    if fmt.quant_mode == KVQuantMode.INT8_PER_TOKEN_HEAD:
        return INT8_PER_TOKEN_HEAD_MAX
    return Fp8Format.E4M3.max


def quantize_per_token_head(
    x: torch.Tensor, kv_cache_dtype: str | KVCacheFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` (fp32/fp16/bf16) row by row (steps 1-5 above).

    Returns ``(q, scale)``: ``q [..., D]`` (int8 for ``int8_per_token_head``, uint8 FP8 e4m3
    bytes for ``fp8_per_token_head``) and the fp32 dequantization scales ``[...]``.
    """
    fmt = per_token_head_format(kv_cache_dtype)
    if x.dtype not in _FLOAT_INPUT_DTYPES:
        raise ValueError(f"x: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x: expected a tensor [..., D], got a 0-d tensor")
    xf = x.to(torch.float32)
    has_nan = torch.isnan(xf).any(dim=-1)
    finite_abs = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf))
    amax = finite_abs.amax(dim=-1) if xf.shape[-1] > 0 else xf.new_zeros(xf.shape[:-1])
    scale = torch.maximum(
        amax / torch.full_like(amax, per_token_head_qmax(fmt)),
        torch.full_like(amax, PER_TOKEN_HEAD_SCALE_FLOOR),
    )
    inv = torch.ones_like(scale) / scale
    y = xf * inv.unsqueeze(-1)
    if fmt.quant_mode == KVQuantMode.INT8_PER_TOKEN_HEAD:
        # Symmetric bounds: -Inf mirrors +Inf (upstream's -128 bound is reachable by no finite
        # value, since |y| <= 127 up to rounding). torch.round: ties to even.
        q = torch.round(torch.clamp(y, -127.0, 127.0)).to(torch.int8)
    else:
        q = fp32_to_fp8_bytes(y, Fp8Format.E4M3)
    q = torch.where(has_nan.unsqueeze(-1), torch.zeros_like(q), q)
    nan = torch.tensor(NAN_SCALE_BITS, dtype=torch.int32, device=x.device).view(torch.float32)
    return q, torch.where(has_nan, nan, scale)


def pack_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Cache rows ``[..., D + 4]`` (the format's storage dtype) from values ``q [..., D]`` and
    scales ``[...]``: the values, then the scale's 4 bytes in little-endian order."""
    if scale.dtype != torch.float32 or tuple(scale.shape) != tuple(q.shape[:-1]):
        raise ValueError(
            f"scale: expected float32 of shape {list(q.shape[:-1])}, got {scale.dtype} "
            f"of shape {list(scale.shape)}"
        )
    scale_bytes = scale.contiguous().unsqueeze(-1).view(torch.uint8).view(q.dtype)
    return torch.cat([q, scale_bytes], dim=-1)


def unpack_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [..., D], scale [...] fp32)`` of cache rows ``[..., D + 4]`` (int8 or uint8)."""
    if rows.dtype not in (torch.int8, torch.uint8) or rows.dim() == 0:
        raise ValueError(
            f"rows: expected int8 or uint8 rows [..., D + 4], got {rows.dtype} "
            f"of shape {list(rows.shape)}"
        )
    if rows.shape[-1] <= PER_TOKEN_HEAD_SCALE_BYTES:
        raise ValueError(f"rows: expected a last dim D + 4 > 4, got {rows.shape[-1]}")
    head_size = rows.shape[-1] - PER_TOKEN_HEAD_SCALE_BYTES
    scale = rows[..., head_size:].contiguous().view(torch.uint8).view(torch.float32)
    return rows[..., :head_size], scale.squeeze(-1)


def dequantize_per_token_head(
    rows: torch.Tensor,
    kv_cache_dtype: str | KVCacheFormat,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Values ``[..., D]`` of cache rows ``[..., D + 4]``: ``float32(q) * scale`` (one fp32
    multiply), cast to ``out_dtype``."""
    fmt = per_token_head_format(kv_cache_dtype)
    if rows.dtype != fmt.storage_dtype:
        raise ValueError(
            f"rows: expected dtype {fmt.storage_dtype} for {fmt.name}, got {rows.dtype}"
        )
    q, scale = unpack_rows(rows)
    if fmt.quant_mode == KVQuantMode.INT8_PER_TOKEN_HEAD:
        values = q.to(torch.float32)
    else:
        values = fp8_bytes_to_fp32(q, Fp8Format.E4M3)
    return (values * scale.unsqueeze(-1)).to(out_dtype)


def per_token_head_write_cache(
    x: torch.Tensor,
    cache_side: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str | KVCacheFormat,
) -> None:
    """Quantize the first ``T`` tokens of ``x [T_pad, H, D]`` and write their rows into
    ``cache_side (B, N, H, D + 4)`` in place (any strides).

    Token ``i`` goes to page ``slot_mapping[i] // N``, row ``slot_mapping[i] % N``; negative
    slots are skipped; a slot ``>= B*N`` raises ``ValueError`` before anything is written.
    """
    fmt = per_token_head_format(kv_cache_dtype)
    if x.dtype not in _FLOAT_INPUT_DTYPES:
        raise ValueError(f"x: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    if cache_side.dim() != 4 or cache_side.dtype != fmt.storage_dtype:
        raise ValueError(
            f"cache_side: expected a {fmt.storage_dtype} (B, N, H, D + 4) tensor, got "
            f"{cache_side.dtype} of shape {list(cache_side.shape)}"
        )
    num_blocks, block_size, num_heads, row = cache_side.shape
    if x.dim() != 3 or x.shape[1] != num_heads or fmt.last_dim(x.shape[2]) != row:
        raise ValueError(
            f"x: expected shape [T_pad, {num_heads}, {row - PER_TOKEN_HEAD_SCALE_BYTES}] to "
            f"match cache_side, got {list(x.shape)}"
        )
    if x.device != cache_side.device:
        raise ValueError(f"x: expected device {cache_side.device} (the cache's), got {x.device}")
    check_slot_mapping(slot_mapping, x.shape[0], num_blocks * block_size, cache_side.device)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    q, scale = quantize_per_token_head(x[: slot_mapping.shape[0]][keep], fmt)
    cache_side[slots // block_size, slots % block_size] = pack_rows(q, scale)


def per_token_head_read_cache(
    cache_side: torch.Tensor,
    kv_cache_dtype: str | KVCacheFormat,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize a whole per-token-head cache side ``(B, N, H, D + 4)`` to ``(B, N, H, D)``."""
    if cache_side.dim() != 4:
        raise ValueError(
            f"cache_side: expected a (B, N, H, D + 4) tensor, got shape {list(cache_side.shape)}"
        )
    return dequantize_per_token_head(cache_side, kv_cache_dtype, out_dtype)
