"""A fixed orthonormal Hadamard rotation of K/V head vectors, defined to the last bit.

Rotating keys before they are quantized spreads a few large channels over all of them, and
rotating the query by the same matrix leaves every score unchanged in exact arithmetic:
``(c H q) . (c H k) = c^2 D (q . k)`` with ``H`` the ``D x D`` Sylvester Hadamard matrix
(``H H^T = D I``) and ``c = fp32(1 / sqrt(D))``, so ``c^2 D = 1`` up to the rounding of ``c``
(relative 2^-24). On SmolLM2-135M with its attention on the paged cache it takes the FP8 cache
from +2.1% / +2.0% perplexity over the bf16 cache to +0.7% / +0.4% on the two texts of
docs/accuracy.md (keys only; rotating values as well measured worse).

The bytes are fixed by one sequence of fp32 operations, the same on every device that keeps
subnormals (IEEE adds, subtracts and one multiply per element, no reassociation): the input is
widened to fp32, then for ``h = 1, 2, 4, ..., D/2`` every pair ``(i, i + h)`` with
``i % 2h < h`` becomes ``(x_i + x_{i+h}, x_i - x_{i+h})``, then every element is multiplied by
``c``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["HADAMARD", "hadamard_rotate", "check_hadamard_head_size"]

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
