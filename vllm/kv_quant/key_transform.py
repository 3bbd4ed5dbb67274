"""What a cache does to keys before writing them and to queries before reading: an optional key
offset and an optional Hadamard rotation (docs/design.md §5.5), one definition for every user.

The writer receives ``round_to_key_dtype(rotate(fp32(key) - offset))``; the reader rotates the
query alike. Scores are kept by the rotation and moved by ``q . offset`` per query by the offset,
which softmax ignores; both leave the page bytes in the format's own encoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.kv_quant.hadamard import HADAMARD, check_hadamard_head_size, hadamard_rotate

__all__ = ["KeyTransform"]


@dataclass(frozen=True, eq=False)
class KeyTransform:
    """``rotation``: ``None`` or ``"hadamard"``; ``offset``: ``None`` or fp32 ``[H, D]``
    subtracted from every key (e.g. :meth:`vllm.kv_quant.KVScaleObserver.key_mean`)."""

    rotation: str | None = None
    offset: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.rotation not in (None, HADAMARD):
            raise ValueError(f"key_rotation: expected None or {HADAMARD!r}, got {self.rotation!r}")
        offset = self.offset
        if offset is not None:
            if not isinstance(offset, torch.Tensor) or offset.dim() != 2:
                got = list(offset.shape) if isinstance(offset, torch.Tensor) else offset
                raise ValueError(f"offset: expected a tensor [H, D], got {got}")
            if not offset.dtype.is_floating_point:
                raise ValueError(f"offset: expected a float tensor, got {offset.dtype}")
            if not torch.isfinite(offset).all():
                raise ValueError("offset: expected finite values, got NaN or Inf")
            object.__setattr__(self, "offset", offset.to(torch.float32))
            if self.rotation is not None:
                check_hadamard_head_size(offset.shape[1])

    @property
    def is_identity(self) -> bool:
        """Keys and queries pass unchanged."""
        return self.rotation is None and self.offset is None

    def stored_key(self, key: torch.Tensor) -> torch.Tensor:
        """``key [..., H, D]`` as the writer receives it (``key`` itself when
        :attr:`is_identity`)."""
        if self.is_identity:
            return key
        stored = key.to(torch.float32)
        if self.offset is not None:
            if tuple(key.shape[-2:]) != tuple(self.offset.shape):
                raise ValueError(
                    f"key: expected [..., {self.offset.shape[0]}, {self.offset.shape[1]}] like "
                    f"the key offset, got {list(key.shape)}"
                )
            stored = stored - self.offset.to(stored.device)
        if self.rotation is not None:
            stored = hadamard_rotate(stored)
        return stored.to(key.dtype)

    def reader_query(self, query: torch.Tensor) -> torch.Tensor:
        """``query`` as the reader receives it: rotated like the keys, in its own dtype (the
        offset needs nothing: softmax ignores the shift it makes)."""
        if self.rotation is None:
            return query
        return hadamard_rotate(query).to(query.dtype)
