"""Reference codecs of the packed-slot formats: K and V of one (token, KV head) in one slot.

TurboQuant, UltraQuant and Octave do not store a K side and a V side (the per-side
:class:`~vllm.kv_quant.codecs.KVCodec` interface); each (token, KV head) is one slot of
``slot_bytes`` bytes holding both, with its scales inside. :func:`slot_codec` gives the
reference codec of such a format for one head size: ``encode(key, value) -> slots`` and
``decode(slots) -> (key, value)`` in the original (unrotated) domain, in fp32. The compiled
writers of TurboQuant and UltraQuant are the extension's own ops (:mod:`vllm._packed_cache_ops`);
Octave has none, and no compiled reader takes these formats yet.

Octave's block K depends on the model's rotary dims: the ones registered for the head size
(:func:`vllm.kv_quant.octave.register_rope_dim`, as a model does), else the caller's
``default_rope_dim`` (the tools pass :data:`OCTAVE_CHECK_ROPE_DIM`, upstream's kernels' value),
else a ``ValueError`` naming the head size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.kv_quant.formats import KVCacheFormat
from vllm.kv_quant.modes import KVQuantMode
from vllm.kv_quant.octave import HADAMARD_BLOCK, OctaveFormat, registered_rope_dim
from vllm.kv_quant.octave_codec import octave_decode, octave_encode
from vllm.kv_quant.turboquant import (
    TurboQuantConfig,
    turboquant_decode_slots,
    turboquant_encode_slots,
)
from vllm.kv_quant.turboquant.centroids import turboquant_tables
from vllm.kv_quant.ultraquant import ultraquant_slot_size
from vllm.kv_quant.ultraquant_codec import (
    UltraQuantEncoded,
    hadamard_matrix,
    ultraquant_dequant,
    ultraquant_encode,
)

__all__ = ["OCTAVE_CHECK_ROPE_DIM", "SlotCodec", "compiled_store_op", "is_packed", "slot_codec"]

OCTAVE_CHECK_ROPE_DIM = HADAMARD_BLOCK
"""Rotary dims of an Octave block K when the head size has none registered (64, the value
upstream's ROCm kernels take)."""


@dataclass(frozen=True)
class SlotCodec:
    """Reference codec of one packed-slot format at one head size (elements).

    ``encode(key, value)``: ``[T, H, D]`` each → uint8 slots ``[T, H, slot_bytes]``.
    ``decode(slots)``: uint8 ``[..., slot_bytes]`` → fp32 ``(key, value)`` ``[..., D]``.
    ``source`` names the implementation (the check prints it next to the row)."""

    dtype: str
    head_size: int
    slot_bytes: int
    encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    source: str


def _turboquant(fmt: KVCacheFormat, head_size: int) -> SlotCodec:
    cfg = TurboQuantConfig.from_cache_dtype(fmt.name, head_size)
    tables = turboquant_tables(head_size, cfg.centroid_bits)
    rotation, centroids, midpoints = tables.rotation, tables.centroids, tables.midpoints

    def encode(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        dev = key.device
        return turboquant_encode_slots(
            key, value, cfg, rotation.to(dev), midpoints.to(dev) if not cfg.key_fp8 else None
        )

    def decode(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dev = slots.device
        if cfg.key_fp8:
            return turboquant_decode_slots(slots, cfg)
        return turboquant_decode_slots(slots, cfg, centroids.to(dev), rotation.to(dev))

    return SlotCodec(
        fmt.name,
        head_size,
        cfg.slot_size_aligned,
        encode,
        decode,
        "reference codec (vllm.kv_quant.turboquant.codec)",
    )


def _ultraquant(fmt: KVCacheFormat, head_size: int) -> SlotCodec:
    half = head_size // 2
    groups = (ultraquant_slot_size(head_size) - head_size) // 2
    side = half + groups

    def encode(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        k, v = ultraquant_encode(key), ultraquant_encode(value, rotate=False)
        return torch.cat((k.codes_packed, k.scale_bytes, v.codes_packed, v.scale_bytes), dim=-1)

    def decode(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = (
            ultraquant_dequant(
                UltraQuantEncoded(slots[..., at : at + half], slots[..., at + half : at + side]),
                head_size,
            )
            for at in (0, side)
        )
        # K was stored rotated (x @ H^T); H is orthonormal and symmetric.
        return k.float() @ hadamard_matrix(head_size, slots.device), v.float()

    return SlotCodec(
        fmt.name,
        head_size,
        ultraquant_slot_size(head_size),
        encode,
        decode,
        "reference codec (vllm.kv_quant.ultraquant_codec)",
    )


def _octave(fmt: KVCacheFormat, head_size: int, default_rope_dim: int | None) -> SlotCodec:
    compact = fmt.quant_mode == KVQuantMode.OCTAVE_K3V3_COMPACT
    try:
        rope = 0 if compact else registered_rope_dim(head_size)  # compact K: one rotation
    except ValueError:
        if default_rope_dim is None:
            raise
        rope = default_rope_dim
    geometry = OctaveFormat.from_cache_dtype(fmt.name, head_size, rope)

    def decode(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = slots.shape
        k, v = octave_decode(slots.reshape(-1, shape[-2], shape[-1]), geometry)
        return k.view(*shape[:-1], head_size), v.view(*shape[:-1], head_size)

    return SlotCodec(
        fmt.name,
        head_size,
        geometry.slot_bytes,
        lambda key, value: octave_encode(key, value, geometry),
        decode,
        f"reference codec (vllm.kv_quant.octave_codec, {rope} rotary dims)",
    )


def is_packed(fmt: KVCacheFormat) -> bool:
    """Whether ``fmt`` stores K and V of a (token, head) in one slot read by :func:`slot_codec`."""
    mode = fmt.quant_mode
    return mode.is_turboquant or mode.is_ultraquant or mode.is_octave


def compiled_store_op(fmt: KVCacheFormat) -> str | None:
    """The name of the extension op (``_C_cache_ops::<name>``) that writes the packed-slot format
    ``fmt``: ``turboquant_store`` for TurboQuant's presets, ``ultraquant_store`` for
    ``ultraquant_4bit``; None for Octave and any other format."""
    mode = fmt.quant_mode
    if mode.is_turboquant:
        return "turboquant_store"
    return "ultraquant_store" if mode.is_ultraquant else None


def slot_codec(
    fmt: KVCacheFormat, head_size: int, default_rope_dim: int | None = None
) -> SlotCodec:
    """The reference codec of the packed-slot format ``fmt`` for heads of ``head_size``;
    ``default_rope_dim``: Octave's rotary dims when the model registered none for the head size.
    ``ValueError`` for another format, or a head size the format cannot hold."""
    mode = fmt.quant_mode
    if mode.is_turboquant:
        return _turboquant(fmt, head_size)
    if mode.is_ultraquant:
        return _ultraquant(fmt, head_size)
    if mode.is_octave:
        return _octave(fmt, head_size, default_rope_dim)
    raise ValueError(f"format: expected a packed-slot format, got {fmt.name!r}")
