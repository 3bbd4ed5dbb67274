"""Reference FP8 (e4m3 / e5m2) KV-cache codec with per-tensor or per-head scales.

Byte format (docs/design.md §5): ``q = fp8(clamp(x / scale, -MAX, MAX))`` rounded to nearest even,
stored as uint8; a NaN input gives the canonical byte :data:`FP8_NAN_BYTE` whatever its sign.
``scale`` is the *dequantization* scale (fp32, one value in any shape or ``[H]``, see
:mod:`vllm.kv_quant.kv_scale`), in units of "real value per fp8 unit": ``x ≈ float(q) * scale``.

Every operation is a single IEEE fp32 op on the input's device, so CPU and CUDA give the same
bytes, and compiled kernels are tested against these functions bit for bit.
"""

from __future__ import annotations

from enum import Enum

import torch

from vllm.kv_quant.formats import formats, lookup
from vllm.kv_quant.kv_scale import is_per_tensor_scale, kv_scale_as_1d

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn magnitude (byte 0x7E)."""

FP8_E5M2_MAX = 57344.0
"""Largest finite float8_e5m2 magnitude (byte 0x7B)."""

FP8_NAN_BYTE = 0x7F
"""Canonical NaN byte written for any NaN input (a NaN in both e4m3fn and e5m2)."""

_FLOAT_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Fp8Format(str, Enum):
    """An FP8 storage format of the KV cache."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype whose bit pattern the cache bytes hold."""
        return torch.float8_e4m3fn if self is Fp8Format.E4M3 else torch.float8_e5m2

    @property
    def max(self) -> float:
        """Largest finite magnitude of the format (saturation bound)."""
        return FP8_E4M3_MAX if self is Fp8Format.E4M3 else FP8_E5M2_MAX


def fp8_format_from_cache_dtype(kv_cache_dtype: str) -> Fp8Format:
    """FP8 format of an FP8 ``kv_cache_dtype`` string (``fp8``/``fp8_e4m3`` → E4M3, ``fp8_e5m2``
    → E5M2; the registry's ``fp8_variant``); any other string raises ``ValueError``."""
    try:
        variant = lookup(kv_cache_dtype, include_mla_only=False).fp8_variant
    except ValueError:
        variant = None
    if variant is None:
        fp8_names = [
            name
            for fmt in formats()
            if fmt.fp8_variant and not fmt.mla_only
            for name in fmt.accepted_names
        ]
        raise ValueError(
            f"kv_cache_dtype: expected one of {', '.join(fp8_names)} for an FP8 "
            f"cache, got {kv_cache_dtype!r}"
        )
    return Fp8Format(variant)


def as_fp8_format(fmt: Fp8Format | str) -> Fp8Format:
    """Coerce ``fmt`` (an :class:`Fp8Format`, ``"e4m3"``/``"e5m2"`` or an FP8 cache dtype
    string) to an :class:`Fp8Format`."""
    if isinstance(fmt, Fp8Format):
        return fmt
    try:
        return Fp8Format(fmt)
    except ValueError:
        pass
    try:
        return fp8_format_from_cache_dtype(fmt)
    except ValueError:
        raise ValueError(
            f"fmt: expected an Fp8Format, 'e4m3', 'e5m2' or an FP8 kv_cache_dtype string, "
            f"got {fmt!r}"
        ) from None


def fp32_to_fp8_bytes(y: torch.Tensor, fmt: Fp8Format | str) -> torch.Tensor:
    """Saturating round-to-nearest-even conversion of fp32 ``y`` to FP8 bytes (uint8).

    ``|y| > MAX`` and ``±Inf`` give ``±MAX``; NaN (either sign) gives :data:`FP8_NAN_BYTE`.
    Output has ``y``'s shape and device.
    """
    fmt = as_fp8_format(fmt)
    if y.dtype != torch.float32:
        raise ValueError(f"y: expected dtype torch.float32, got {y.dtype}")
    clamped = torch.clamp(y, -fmt.max, fmt.max)  # NaN stays NaN
    q = clamped.to(fmt.torch_dtype).view(torch.uint8)
    return torch.where(torch.isnan(y), torch.full_like(q, FP8_NAN_BYTE), q)


def fp8_bytes_to_fp32(q: torch.Tensor, fmt: Fp8Format | str) -> torch.Tensor:
    """Exact fp32 value of FP8 bytes ``q`` (uint8 or the format's float8 dtype)."""
    fmt = as_fp8_format(fmt)
    if q.dtype == torch.uint8:
        q = q.view(fmt.torch_dtype)
    elif q.dtype != fmt.torch_dtype:
        raise ValueError(f"q: expected dtype torch.uint8 or {fmt.torch_dtype}, got {q.dtype}")
    return q.to(torch.float32)


def _broadcast_scale(scale: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Validate a dequantization scale for ``ref [..., H, D]`` (rule: :mod:`.kv_scale`); return
    it broadcastable to ``ref`` on ``ref``'s device (a per-head ``[H]`` becomes ``[H, 1]``)."""
    heads = ref.shape[-2] if ref.dim() >= 2 else None
    scale = kv_scale_as_1d(scale, "scale", heads).to(ref.device)
    return scale if is_per_tensor_scale(scale) else scale.unsqueeze(-1)


def quantize_fp8(
    x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format | str = Fp8Format.E4M3
) -> torch.Tensor:
    """Quantize ``x [..., H, D]`` (fp32/fp16/bf16) to FP8 bytes (uint8, same shape).

    ``y = float32(x) / scale`` (IEEE fp32 division; a ``[H]`` scale broadcasts over dim -2),
    clamped to ``[-MAX, MAX]``, rounded to nearest even. NaN → :data:`FP8_NAN_BYTE`,
    ``±Inf`` → ``±MAX``. ``scale`` is moved to ``x``'s device (an exact copy).
    """
    if x.dtype not in _FLOAT_INPUT_DTYPES:
        raise ValueError(f"x: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    fmt = as_fp8_format(fmt)
    s = _broadcast_scale(scale, x)
    y = x.to(torch.float32) / s
    return fp32_to_fp8_bytes(y, fmt)


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    fmt: Fp8Format | str = Fp8Format.E4M3,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize FP8 bytes ``q [..., H, D]`` (uint8): ``float32(q) * scale`` (one fp32
    multiply), then cast to ``out_dtype``."""
    fmt = as_fp8_format(fmt)
    s = _broadcast_scale(scale, q)
    return (fp8_bytes_to_fp32(q, fmt) * s).to(out_dtype)
