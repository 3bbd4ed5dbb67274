"""Byte layout and registry entries of the Octave KV caches (upstream v0.33's ROCm
``KVQuantMode.OCTAVE_K3V4`` / ``OCTAVE_K3V3`` / ``OCTAVE_K3V3_COMPACT``).

One slot per (token, KV head) packs K and V, ``D`` the head size and ``R`` the model's rotary
dims (both multiples of 64), as rotated Lloyd-Max codes (the codec is
:mod:`vllm.kv_quant.octave_codec`):

- block K (``k3v4``, ``k3v3``): 4-bit codes for the ``R`` RoPE dims, then 3-bit codes for the
  ``D - R`` others, one fp16 scale per 64-dim block;
- compact K (``k3v3_compact``, power-of-two ``D``): 3-bit codes for all ``D`` dims, one scale;
- V: ``v_bits`` codes (4 for ``k3v4``, else 3) for all ``D`` dims, one scale;
- then the fp16 scales (K's, then V's), padded to 8 bytes (4 for compact K).

So the slot is 248 / 216 / 196 bytes at ``D = 256, R = 64``. Block K's size depends on ``R``,
which the cache dtype does not name: as upstream, the model registers it per head size
(:func:`register_rope_dim`) before caches are sized. The registry's rows are per side, so the
row is half the slot and the two-sided page math gives ``block_size * H * slot`` bytes, as
upstream's spec does once its backend sets ``state_content_bytes`` to the slot. Their compiled
writer is upstream's own op, ``_C::octave_cache_store`` (:mod:`vllm._packed_cache_ops`), not
``reshape_and_cache_flash`` (``cache_kind=None``:
:func:`~vllm.kv_quant.formats.kernel_cache_kind` refuses them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.kv_quant.formats import KVCacheFormat, register_format
from vllm.kv_quant.modes import KVQuantMode

__all__ = [
    "HADAMARD_BLOCK",
    "NOPE_BITS",
    "OCTAVE_FORMATS",
    "ROPE_BITS",
    "OctaveFormat",
    "register_rope_dim",
    "registered_rope_dim",
]

HADAMARD_BLOCK = 64
"""Dims per Walsh-Hadamard block of block K (and of V when ``D`` is not a power of two)."""

ROPE_BITS = 4
"""Code width of block K's RoPE dims."""

NOPE_BITS = 3
"""Code width of the other K dims (all of compact K's)."""

_VARIANTS: dict[str, tuple[int, bool, str]] = {
    mode.name.lower(): variant
    for mode, variant in (
        (KVQuantMode.OCTAVE_K3V4, (4, False, "oct_k3v4")),
        (KVQuantMode.OCTAVE_K3V3, (3, False, "oct_k3v3")),
        (KVQuantMode.OCTAVE_K3V3_COMPACT, (3, True, "oct_k3v3c")),
    )
}
"""Cache dtype (the mode's lower-case name, as upstream maps them) → (V code bits, compact K,
display label)."""

_COMPACT_FLAG = 16
"""Added to the V bits in the kernels' format id for compact K."""

_rope_dims: dict[int, int] = {}
"""Head size → the model's rotary dims (process-wide, as upstream's)."""


def register_rope_dim(head_size: int, rope_dim: int) -> None:
    """Record the rotary dims of heads of ``head_size`` (first registration wins; a different
    second one raises)."""
    known = _rope_dims.setdefault(head_size, rope_dim)
    if known != rope_dim:
        raise ValueError(
            f"rope_dim: head size {head_size} already has {known} rotary dims, got {rope_dim}"
        )


def registered_rope_dim(head_size: int) -> int:
    """The rotary dims registered for ``head_size``; ``ValueError`` when none is."""
    if head_size not in _rope_dims:
        raise ValueError(
            f"head_size: an Octave block-K slot depends on the model's rotary dims, none "
            f"registered for head size {head_size} (register_rope_dim(head_size, rope_dim))"
        )
    return _rope_dims[head_size]


@dataclass(frozen=True)
class OctaveFormat:
    """Geometry of one Octave slot: head size and rotary dims (elements), V code bits, compact
    K. Offsets and sizes are bytes within the slot."""

    head_size: int
    rope_dim: int
    v_bits: int
    compact: bool = False

    def __post_init__(self) -> None:
        d, r = self.head_size, self.rope_dim
        if self.v_bits not in (3, 4):
            raise ValueError(f"v_bits: expected 3 or 4, got {self.v_bits}")
        if d <= 0 or d % HADAMARD_BLOCK or r < 0 or r % HADAMARD_BLOCK or r > d:
            raise ValueError(
                f"head_size: Octave needs head_size and rope_dim in multiples of "
                f"{HADAMARD_BLOCK} (rope_dim <= head_size), got head_size={d}, rope_dim={r}"
            )
        if self.compact and d & (d - 1):
            raise ValueError(f"head_size: compact Octave K needs a power of two, got {d}")

    @classmethod
    def from_cache_dtype(cls, cache_dtype: str, head_size: int, rope_dim: int) -> OctaveFormat:
        """The geometry of ``cache_dtype`` (an ``octave_*`` name) for a model's head."""
        if cache_dtype not in _VARIANTS:
            raise ValueError(
                f"cache_dtype: expected one of {', '.join(_VARIANTS)}, got {cache_dtype!r}"
            )
        v_bits, compact, _ = _VARIANTS[cache_dtype]
        return cls(head_size, rope_dim, v_bits, compact)

    @property
    def kernel_code(self) -> int:
        """The kernels' format id: V bits, plus 16 for compact K."""
        return self.v_bits + (_COMPACT_FLAG if self.compact else 0)

    @property
    def k_rotation_block(self) -> int:
        """Dims per K Hadamard block."""
        return self.head_size if self.compact else HADAMARD_BLOCK

    @property
    def k_wide_dim(self) -> int:
        """K dims stored with 4-bit codes (the RoPE dims of block K; none for compact K)."""
        return 0 if self.compact else self.rope_dim

    @property
    def nope_dim(self) -> int:
        return self.head_size - self.rope_dim

    @property
    def num_k_blocks(self) -> int:
        return self.head_size // HADAMARD_BLOCK

    @property
    def num_rope_blocks(self) -> int:
        return self.rope_dim // HADAMARD_BLOCK

    @property
    def off_k_nope(self) -> int:
        """Byte offset of K's 3-bit codes."""
        return self.k_wide_dim * ROPE_BITS // 8

    @property
    def off_v(self) -> int:
        """Byte offset of V's codes."""
        return self.off_k_nope + (self.head_size - self.k_wide_dim) * NOPE_BITS // 8

    @property
    def off_scales(self) -> int:
        """Byte offset of the fp16 scales."""
        return self.off_v + self.head_size * self.v_bits // 8

    @property
    def num_k_scales(self) -> int:
        return 1 if self.compact else self.num_k_blocks

    @property
    def num_scales(self) -> int:
        return self.num_k_scales + 1

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (one token, one KV head), padded to 8 (4 for compact K)."""
        align = 4 if self.compact else 8
        return -(-(self.off_scales + 2 * self.num_scales) // align) * align


def _row_dim(cache_dtype: str) -> Callable[[int], int]:
    """The registry's per-side row (half the slot) of ``cache_dtype`` by head size."""

    def row_dim(head_size: int) -> int:
        compact = _VARIANTS[cache_dtype][1]
        rope = 0 if compact else registered_rope_dim(head_size)
        return OctaveFormat.from_cache_dtype(cache_dtype, head_size, rope).slot_bytes // 2

    return row_dim


OCTAVE_FORMATS: tuple[KVCacheFormat, ...] = tuple(
    register_format(
        KVCacheFormat(
            name=name,
            accepted_names=(name,),
            storage_dtype=torch.uint8,
            quant_mode=KVQuantMode[name.upper()],
            label=_VARIANTS[name][2],
            row_dim=_row_dim(name),
            # Written by _C::octave_cache_store, not by reshape_and_cache_flash.
            cache_kind=None,
            has_kernel=False,
        )
    )
    for name in _VARIANTS
)
"""The three Octave formats, in upstream's order."""
