"""Reference codecs of the packed-slot formats: K and V of one (token, KV head) in one slot.

TurboQuant, UltraQuant and Octave do not store a K side and a V side (the per-side
:class:`~vllm.kv_quant.codecs.KVCodec` interface); each (token, KV head) is one slot of
``slot_bytes`` bytes holding both, with its scales inside. :func:`slot_codec` gives the
reference codec of such a format for one head size: ``encode(key, value) -> slots`` and
``decode(slots) -> (key, value)`` in the original (unrotated) domain, in fp32. The compiled
writers are the extension's own ops (:func:`compiled_store_op`; Octave's is upstream's
``_C::octave_cache_store``). The compiled reader (:mod:`vllm._packed_attention_ops`) reads
every one of them with its :class:`SlotReader`: keys in their rotated frame, against a query
rotated the same way.

Octave's block K depends on the model's rotary dims: the ones registered for the head size
(:func:`vllm.kv_quant.octave.register_rope_dim`, as a model does), else the caller's
``default_rope_dim`` (the tools pass :data:`OCTAVE_CHECK_ROPE_DIM`, upstream's kernels' value),
else a ``ValueError`` naming the head size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.kv_quant.formats import KVCacheFormat, find_format
from vllm.kv_quant.modes import KVQuantMode
from vllm.kv_quant.octave import HADAMARD_BLOCK, NOPE_BITS, OctaveFormat, registered_rope_dim
from vllm.kv_quant.octave_codec import (
    LUT,
    octave_decode,
    octave_encode,
    rotate,
    signs,
    unrotate,
    v_block,
)
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

__all__ = [
    "OCTAVE_CHECK_ROPE_DIM",
    "SlotCodec",
    "SlotReader",
    "compiled_store_op",
    "is_packed",
    "packed_cache_codec",
    "slot_codec",
]

OCTAVE_CHECK_ROPE_DIM = HADAMARD_BLOCK
"""Rotary dims of an Octave block K when the head size has none registered (64, the value
upstream's ROCm kernels take)."""


Frame = Callable[[torch.Tensor], torch.Tensor]


def _same_frame(x: torch.Tensor) -> torch.Tensor:
    return x


def _hadamard_frame(head_size: int) -> Frame:
    """``q -> q @ H^T`` with ``H`` the normalised Hadamard matrix (cached per device): the key
    frame of keys stored as ``k @ H^T`` and read back as ``k_read @ H``."""

    def key_frame(q: torch.Tensor) -> torch.Tensor:
        return q.float() @ hadamard_matrix(head_size, q.device).T

    return key_frame


@dataclass(frozen=True)
class SlotReader:
    """How the compiled reader (``_C_cache_ops::packed_paged_attention``) takes a packed-slot
    format: its arguments (``key_bits``, ``value_bits``, ``norm_correction``, ``rope_dim``, and
    ``codebook``, fp32 on the CPU or None), and the frames it reads in. A slot's key decodes to
    ``k = K(k_read)`` with ``K`` orthogonal, so ``q . k = key_frame(q) . k_read``; its value to
    ``v = value_out(v_read)``, linear, so attention's output is ``value_out`` of the output over
    the values as read. Both map fp32 ``[..., D]`` rows."""

    key_bits: int
    value_bits: int
    norm_correction: bool
    rope_dim: int
    codebook: torch.Tensor | None
    key_frame: Frame
    value_out: Frame


@dataclass(frozen=True)
class SlotCodec:
    """Reference codec of one packed-slot format at one head size (elements).

    ``encode(key, value)``: ``[T, H, D]`` each → uint8 slots ``[T, H, slot_bytes]``.
    ``decode(slots)``: uint8 ``[..., slot_bytes]`` → fp32 ``(key, value)`` ``[..., D]``.
    ``source`` names the implementation (the check prints it next to the row); ``reader`` is
    what the compiled reader needs."""

    dtype: str
    head_size: int
    slot_bytes: int
    encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    source: str
    reader: SlotReader


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

    # Lloyd-Max keys decode to (norm * c) @ Pi, Pi = rotation, the normalised Hadamard matrix.
    key_frame = _same_frame if cfg.key_fp8 else _hadamard_frame(head_size)
    reader = SlotReader(
        cfg.key_quant_bits,
        cfg.value_quant_bits,
        cfg.norm_correction and not cfg.key_fp8,
        0,
        None if cfg.key_fp8 else centroids,
        key_frame,
        _same_frame,
    )
    return SlotCodec(
        fmt.name,
        head_size,
        cfg.slot_size_aligned,
        encode,
        decode,
        "reference codec (vllm.kv_quant.turboquant.codec)",
        reader,
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

    reader = SlotReader(4, 4, False, 0, None, _hadamard_frame(head_size), _same_frame)
    return SlotCodec(
        fmt.name,
        head_size,
        ultraquant_slot_size(head_size),
        encode,
        decode,
        "reference codec (vllm.kv_quant.ultraquant_codec)",
        reader,
    )


def _octave_rope_dim(fmt: KVCacheFormat, head_size: int, default_rope_dim: int | None) -> int:
    """Octave's rotary dims for heads of ``head_size``: 0 for compact K (one rotation), else the
    registered ones, else ``default_rope_dim`` (``ValueError`` when that is None too)."""
    if fmt.quant_mode == KVQuantMode.OCTAVE_K3V3_COMPACT:
        return 0
    try:
        return registered_rope_dim(head_size)
    except ValueError:
        if default_rope_dim is None:
            raise
        return default_rope_dim


def _octave(fmt: KVCacheFormat, head_size: int, rope: int) -> SlotCodec:
    geometry = OctaveFormat.from_cache_dtype(fmt.name, head_size, rope)

    def decode(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = slots.shape
        k, v = octave_decode(slots.reshape(-1, shape[-2], shape[-1]), geometry)
        return k.view(*shape[:-1], head_size), v.view(*shape[:-1], head_size)

    # Keys and values decode to unrotate(read) (signs times an orthonormal symmetric transform).
    reader = SlotReader(
        NOPE_BITS,
        geometry.v_bits,
        False,
        geometry.rope_dim,
        torch.tensor(LUT[3] + LUT[4], dtype=torch.float32),
        lambda q: rotate(q, signs(head_size, q.device), geometry.k_rotation_block),
        lambda o: unrotate(o, signs(head_size, o.device), v_block(head_size)),
    )
    return SlotCodec(
        fmt.name,
        head_size,
        geometry.slot_bytes,
        lambda key, value: octave_encode(key, value, geometry),
        decode,
        f"reference codec (vllm.kv_quant.octave_codec, {rope} rotary dims)",
        reader,
    )


def is_packed(fmt: KVCacheFormat) -> bool:
    """Whether ``fmt`` stores K and V of a (token, head) in one slot read by :func:`slot_codec`."""
    mode = fmt.quant_mode
    return mode.is_turboquant or mode.is_ultraquant or mode.is_octave


def compiled_store_op(fmt: KVCacheFormat) -> str | None:
    """The extension op (``<namespace>::<name>``) that writes the packed-slot format ``fmt``:
    ``_C_cache_ops::turboquant_store`` for TurboQuant's presets, ``_C_cache_ops::ultraquant_store``
    for ``ultraquant_4bit``, upstream's ``_C::octave_cache_store`` for Octave; None for any
    other format."""
    mode = fmt.quant_mode
    if mode.is_turboquant:
        return "_C_cache_ops::turboquant_store"
    if mode.is_ultraquant:
        return "_C_cache_ops::ultraquant_store"
    return "_C::octave_cache_store" if mode.is_octave else None


def slot_codec(
    fmt: KVCacheFormat, head_size: int, default_rope_dim: int | None = None
) -> SlotCodec:
    """The reference codec of the packed-slot format ``fmt`` for heads of ``head_size``;
    ``default_rope_dim``: Octave's rotary dims when the model registered none for the head size.
    ``ValueError`` for another format, or a head size the format cannot hold."""
    if not is_packed(fmt):
        raise ValueError(f"format: expected a packed-slot format, got {fmt.name!r}")
    rope = _octave_rope_dim(fmt, head_size, default_rope_dim) if fmt.quant_mode.is_octave else 0
    return _built_codec(fmt, head_size, rope)


@functools.lru_cache(maxsize=64)
def _built_codec(fmt: KVCacheFormat, head_size: int, rope: int) -> SlotCodec:
    """The codec of ``fmt`` at ``head_size`` (Octave: ``rope`` rotary dims), built once: the
    readers ask for it on every call, and its tables are not rebuilt for that."""
    mode = fmt.quant_mode
    if mode.is_turboquant:
        return _turboquant(fmt, head_size)
    if mode.is_ultraquant:
        return _ultraquant(fmt, head_size)
    return _octave(fmt, head_size, rope)


def packed_cache_codec(
    kv_cache_dtype: str,
    kv_cache: torch.Tensor,
    head_size: int,
    default_rope_dim: int | None = None,
) -> tuple[KVCacheFormat, SlotCodec]:
    """The format and codec of a packed-slot cache ``kv_cache`` (uint8, logical ``(num_blocks,
    num_kv_heads, block_size, slot_bytes)``) of ``kv_cache_dtype`` for heads of ``head_size``, as
    the compiled readers take it; ``ValueError`` naming ``kv_cache_dtype`` (not a packed-slot
    format) or ``kv_cache`` (another type, dtype or shape)."""
    fmt = find_format(kv_cache_dtype)
    if fmt is None or not is_packed(fmt):
        raise ValueError(
            f"kv_cache_dtype: expected a packed-slot format (turboquant_*, ultraquant_4bit, "
            f"octave_*), got {kv_cache_dtype!r}"
        )
    codec = slot_codec(fmt, head_size, default_rope_dim)
    if not isinstance(kv_cache, torch.Tensor):
        got = type(kv_cache).__name__
    elif (
        kv_cache.dtype != torch.uint8
        or kv_cache.dim() != 4
        or kv_cache.shape[3] != codec.slot_bytes
    ):
        got = f"{kv_cache.dtype} {list(kv_cache.shape)}"
    else:
        return fmt, codec
    raise ValueError(
        f"kv_cache: expected a uint8 (num_blocks, num_kv_heads, block_size, {codec.slot_bytes}) "
        f"tensor for {fmt.name} at head size {head_size}, got {got}"
    )
