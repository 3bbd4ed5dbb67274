"""Rotary position embedding (RoPE) of keys, for caches that store keys before RoPE.

A key's post-RoPE value rotates its channel pairs by angles that grow with the token's position,
so a channel whose mean is large before RoPE spins around zero after it: the per-channel key
offset of docs/design.md §5.5 then removes only what does not spin. Stored before RoPE (offset
subtracted, quantized), a key is rebuilt by the reader as ``rope(p)(dequantized + offset)`` at
its position ``p`` in the sequence (with FP8 key sinks, :mod:`vllm.kv_quant.key_sinks`: the
NVFP4 key options of docs/accuracy.md).

The table follows the usual ``cos_sin_cache`` layout: row ``p`` holds ``cos(p f_i)`` for the
``rotary_dim / 2`` frequencies ``f_i``, then ``sin(p f_i)``. Neox style pairs channels
``(i, i + rotary_dim / 2)``, GPT-J style ``(2i, 2i + 1)``; pair ``i`` turns by angle ``p f_i``:
``(a, b) -> (a cos - b sin, b cos + a sin)``. Channels past ``rotary_dim`` are not rotated.
Every device computes the same fp32 products and sums (one multiply per product, then one add
or subtract, no fused multiply-add) from the same table.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import torch

from vllm.kv_quant.index_tensor import check_integer_tensor

__all__ = ["KeyRope"]


@dataclass(frozen=True, eq=False)
class KeyRope:
    """RoPE by a table ``cos_sin [max_positions, rotary_dim]`` (fp32; see the module
    docstring), neox style (``is_neox_style``) or GPT-J style."""

    cos_sin: torch.Tensor
    is_neox_style: bool = True

    def __post_init__(self) -> None:
        table = self.cos_sin
        if not isinstance(table, torch.Tensor) or table.dim() != 2:
            got = list(table.shape) if isinstance(table, torch.Tensor) else table
            raise ValueError(f"cos_sin: expected a tensor [max_positions, rotary_dim], got {got}")
        if table.shape[0] < 1 or table.shape[1] < 2 or table.shape[1] % 2:
            raise ValueError(
                "cos_sin: expected at least one position and an even rotary_dim >= 2, got "
                f"{list(table.shape)}"
            )
        if not table.dtype.is_floating_point or not bool(torch.isfinite(table).all()):
            raise ValueError(f"cos_sin: expected finite float values, got {table.dtype}")
        object.__setattr__(self, "cos_sin", table.to(torch.float32).contiguous())

    @classmethod
    def from_base(
        cls,
        rotary_dim: int,
        max_positions: int,
        base: float = 10000.0,
        is_neox_style: bool = True,
    ) -> KeyRope:
        """The standard table: ``f_i = base^(-2i / rotary_dim)``, angles ``p f_i`` in fp32 (as
        Llama-style models compute them)."""
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"rotary_dim: expected an even int >= 2, got {rotary_dim}")
        if max_positions < 1:
            raise ValueError(f"max_positions: expected a positive int, got {max_positions}")
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        inv_freq = 1.0 / (base**exponents)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        return cls(torch.cat([angles.cos(), angles.sin()], dim=1), is_neox_style)

    def to(self, device: torch.device | str) -> KeyRope:
        """The same RoPE with its table on ``device`` (itself when already there)."""
        if self.cos_sin.device == torch.device(device):
            return self
        return KeyRope(self.cos_sin.to(device), self.is_neox_style)

    @cached_property
    def table_digest(self) -> str:
        """Hex SHA-256 (first 16 bytes) of the table's fp32 bytes, row-major: computed once
        per instance (the table is fixed), as encodings compare RoPE identities often."""
        table = self.cos_sin.detach().to("cpu").contiguous()
        return hashlib.sha256(table.numpy().tobytes()).hexdigest()[:32]

    @property
    def rotary_dim(self) -> int:
        """Channels rotated (the first ones of each head)."""
        return self.cos_sin.shape[1]

    @property
    def max_positions(self) -> int:
        """Positions the table covers (0 to ``max_positions - 1``)."""
        return self.cos_sin.shape[0]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fp32 ``x [T, H, D]`` with each token's channels turned forward by its position
        (``positions [T]`` int)."""
        return self._turn(x, positions, 1.0)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`rotate` (turned back by each token's position): post-RoPE keys
        to pre-RoPE keys."""
        return self._turn(x, positions, -1.0)

    def _check_positions(self, positions: torch.Tensor) -> None:
        """Every position a row of the table. On the CPU a ``ValueError`` names the range; on an
        accelerator the check stays on the device (a host round trip per layer would stall
        every step and break CUDA-graph capture), and a bad position stops the step with a
        device-side assertion carrying the same expectation."""
        if not positions.numel():
            return
        expected = f"positions: expected values in [0, {self.max_positions}) (the table's rows)"
        if positions.device.type != "cpu":
            in_range = ((positions >= 0) & (positions < self.max_positions)).all()
            torch._assert_async(in_range, expected)
            return
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= self.max_positions:
            raise ValueError(f"{expected}, got {low}..{high}")

    def _turn(self, x: torch.Tensor, positions: torch.Tensor, direction: float) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] < self.rotary_dim:
            raise ValueError(
                f"key: expected [T, H, D] with D >= rotary_dim={self.rotary_dim}, got "
                f"{list(x.shape)}"
            )
        check_integer_tensor("positions", positions)
        if positions.dim() != 1 or positions.shape[0] != x.shape[0]:
            raise ValueError(
                f"positions: expected [{x.shape[0]}] (one per token), got {list(positions.shape)}"
            )
        self._check_positions(positions)
        half = self.rotary_dim // 2
        table = self.cos_sin.to(x.device)[positions.to(device=x.device, dtype=torch.int64)]
        cos = table[:, None, :half]
        sin = table[:, None, half:] * direction  # exact: a sign flip
        out = x.to(torch.float32).clone()
        if self.is_neox_style:
            a, b = out[..., :half], out[..., half : 2 * half]
        else:
            a, b = out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2]
        a, b = a.clone(), b.clone()
        new_a = a * cos - b * sin
        new_b = b * cos + a * sin
        if self.is_neox_style:
            out[..., :half], out[..., half : 2 * half] = new_a, new_b
        else:
            out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = new_a, new_b
        return out
