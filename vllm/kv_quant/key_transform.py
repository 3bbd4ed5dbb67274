"""What a cache does to keys before writing them and to queries before reading: an optional
RoPE undone, an optional key offset and an optional Hadamard rotation (docs/design.md §5.5),
one definition for every user. The encoding's key spec
(:class:`~vllm.kv_quant.encoding.KeySpec`) says which; :meth:`KeyTransform.bind` adds the
calibrated offset and the model's RoPE table, and the attention impl applies the result.

The writer receives ``round_to_key_dtype(rotate(unrope(fp32(key)) - offset))``. Without RoPE
the reader rotates the query alike: scores are kept by the rotation and moved by
``q . offset`` per query by the offset, which softmax ignores. With RoPE (keys stored before
it, :mod:`vllm.kv_quant.key_rope`) the reader rebuilds each key instead
(:meth:`KeyTransform.rebuild_key`): rotated back, offset added, RoPE applied at the key's
position. The page bytes stay in the format's own encoding; key sinks (the encoding's
``sink_tokens``, :mod:`vllm.kv_quant.key_sinks`) are FP8 copies of stored keys, so they are not
part of the transform.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.kv_quant.encoding import KeySpec, RopeIdentity
from vllm.kv_quant.hadamard import HADAMARD, check_hadamard_head_size, hadamard_rotate
from vllm.kv_quant.index_tensor import check_integer_tensor
from vllm.kv_quant.key_rope import KeyRope

__all__ = ["KeyTransform"]


@dataclass(frozen=True, eq=False)
class KeyTransform:
    """``rotation``: ``None`` or ``"hadamard"``; ``offset``: ``None`` or fp32 ``[H, D]``
    subtracted from every key (e.g. :meth:`vllm.kv_quant.KVScaleObserver.key_mean`; with
    ``rope``, of the pre-RoPE keys); ``rope``: ``None`` or the model's RoPE, undone before the
    keys are stored."""

    rotation: str | None = None
    offset: torch.Tensor | None = None
    rope: KeyRope | None = None

    def __post_init__(self) -> None:
        if self.rotation not in (None, HADAMARD):
            raise ValueError(f"key_rotation: expected None or {HADAMARD!r}, got {self.rotation!r}")
        if self.rope is not None and not isinstance(self.rope, KeyRope):
            got = type(self.rope).__name__
            raise ValueError(f"key_rope: expected None or a KeyRope, got {got}")
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

    @classmethod
    def bind(
        cls, key: KeySpec, rope: KeyRope | None = None, offset: torch.Tensor | None = None
    ) -> KeyTransform:
        """The transform of an encoding's key spec with its runtime parts: the model's RoPE
        (needed exactly when keys are stored before RoPE, and the table the spec names when it
        names one) and the calibrated offset (``None``: none yet, i.e. zero; only with
        ``+offset``). ``ValueError`` naming the part otherwise."""
        if key.prerope and rope is None:
            raise ValueError(
                "key_rope: expected the model's KeyRope (the encoding stores keys before RoPE), "
                "got None"
            )
        if rope is not None:
            if not key.prerope:
                raise ValueError(
                    "key_rope: expected None (the encoding stores keys after RoPE), got a KeyRope"
                )
            if key.rope is not None and RopeIdentity.of(rope) != key.rope:
                raise ValueError(
                    f"key_rope: expected the RoPE table the encoding names ({key.rope}), got "
                    f"{RopeIdentity.of(rope)}"
                )
        if offset is not None and not key.offset:
            raise ValueError("offset: expected None (the encoding has no +offset), got a tensor")
        return cls(key.rotation, offset, rope)

    @property
    def is_identity(self) -> bool:
        """Keys and queries pass unchanged."""
        return self.rotation is None and self.offset is None and self.rope is None

    @property
    def rebuilds_keys(self) -> bool:
        """The reader rebuilds each key (:meth:`rebuild_key`) instead of rotating the query:
        keys are stored before RoPE."""
        return self.rope is not None

    def stored_key(self, key: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``key [..., H, D]`` as the writer receives it (``key`` itself when
        :attr:`is_identity`); ``positions`` (int ``[T]``, each key's position in its sequence)
        are needed with :attr:`rope`."""
        if positions is not None:  # refused even where unread: a caller's bug either way
            check_integer_tensor("positions", positions)
        if self.is_identity:
            return key
        stored = key.to(torch.float32)
        if self.rope is not None:
            if positions is None:
                raise ValueError(
                    "positions: expected each key's position in its sequence (keys are stored "
                    "before RoPE), got None"
                )
            stored = self.rope.unrotate(stored, positions)
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
        offset needs nothing: softmax ignores the shift it makes); unchanged when the reader
        rebuilds the keys."""
        if self.rotation is None or self.rebuilds_keys:
            return query
        return hadamard_rotate(query).to(query.dtype)

    def rebuild_key(self, stored: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fp32 post-RoPE keys ``[T, H, D]`` from stored ones (dequantized, fp32) at
        ``positions [T]``: rotated back, offset added, RoPE applied (see
        :attr:`rebuilds_keys`)."""
        assert self.rope is not None, "rebuild_key: keys are stored after RoPE"
        key = stored.to(torch.float32)
        if self.rotation is not None:
            key = hadamard_rotate(key)  # orthonormal and symmetric: its own inverse
        if self.offset is not None:
            key = key + self.offset.to(key.device)
        return self.rope.rotate(key, positions)
