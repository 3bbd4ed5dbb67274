"""A fixed orthonormal Hadamard rotation of K/V head vectors, defined to the last bit.

Rotating keys before they are quantized spreads a few large channels over all of them, and
rotating the query by the same matrix leaves every score unchanged in exact arithmetic:
``(c H q) . (c H k) = c^2 D (q . k)`` with ``H`` the ``D x D`` Sylvester Hadamard matrix
(``H H^T = D I``) and ``c = fp32(1 / sqrt(D))``, so ``c^2 D = 1`` up to the rounding of ``c``
(relative 2^-24). What it does to a real model's perplexity (keys only; rotating values as well
measured worse) is in docs/accuracy.md.

The bytes are fixed by one sequence of fp32 operations, the same on every device that keeps
subnormals (IEEE adds, subtracts and one multiply per element, no reassociation): the input is
widened to fp32, then for ``h = 1, 2, 4, ..., D/2`` every pair ``(i, i + h)`` with
``i % 2h < h`` becomes ``(x_i + x_{i+h}, x_i - x_{i+h})``, then every element is multiplied by
``c``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["HADAMARD", "check_hadamard_head_size", "hadamard_matrix", "hadamard_rotate"]

HADAMARD = "hadamard"
"""The name of the rotation (``key_rotation="hadamard"``)."""


def check_hadamard_head_size(head_size: int) -> None:
    """``ValueError`` unless ``head_size`` is a power of two ≥ 2 (what the rotation needs)."""
    if head_size < 2 or head_size & (head_size - 1):
        raise ValueError(
            f"head_size: expected a power of two ≥ 2 for the Hadamard rotation, got {head_size}"
        )


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``c H x`` over the last dim of ``x`` (fp32, fp16 or bf16), as fp32 (module docstring).
    Applying it twice gives ``x`` back up to rounding (``H`` is symmetric, ``(cH)^2 = I``)."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    dim = x.shape[-1] if x.dim() else 0
    check_hadamard_head_size(dim)
    y = x.to(torch.float32)
    lead = y.shape[:-1]
    h = 1
    while h < dim:
        pairs = y.reshape(*lead, dim // (2 * h), 2, h)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((first + second, first - second), dim=-2).reshape(*lead, dim)
        h *= 2
    scale = torch.tensor(1.0 / math.sqrt(dim), dtype=torch.float32, device=y.device)
    return y * scale


_HADAMARD_CACHE: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def hadamard_matrix(
    dim: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The ``dim x dim`` Sylvester Hadamard matrix scaled by ``1 / sqrt(dim)`` (orthonormal), built
    in fp64 and cast once to ``dtype``; cached per ``(dim, device, dtype)``."""
    if dim <= 0 or dim & (dim - 1):
        raise ValueError(f"dim: expected a power of two, got {dim}")
    key = (dim, torch.device(device), dtype)
    h = _HADAMARD_CACHE.get(key)
    if h is None:
        h64 = torch.ones(1, 1, dtype=torch.float64)
        while h64.shape[0] < dim:
            h64 = torch.cat([torch.cat([h64, h64], 1), torch.cat([h64, -h64], 1)], 0)
        h = (h64 / dim**0.5).to(device=device, dtype=dtype).contiguous()
        _HADAMARD_CACHE[key] = h
    return h
