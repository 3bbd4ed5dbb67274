"""The reference backend's packed-slot caches: TurboQuant, UltraQuant and Octave keep K and V
of one (token, KV head) in one uint8 slot of ``slot_bytes`` bytes
(:mod:`vllm.kv_quant.slot_codecs`).

The cache is the TURBOQUANT backend's: logical ``(num_blocks, num_kv_heads, block_size,
slot_bytes)`` stored block, token, head, slot (stride order :data:`PACKED_STRIDE_ORDER`), so a
page (``block_size * num_kv_heads * slot_bytes`` bytes) moves between the two backends byte for
byte. :class:`PackedSlots` writes slots with the format's compiled store (the reference codec
where the extension has none) and decodes a sequence's pages to fp32 K and V for the reference
reader.

Octave's block K follows the model's rotary dims: the ones registered for the head size, else
:data:`~vllm.kv_quant.slot_codecs.OCTAVE_CHECK_ROPE_DIM` (upstream's kernels' value), as the
tools read these formats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm.kv_quant.formats import KVCacheFormat
from vllm.kv_quant.nvfp4_cache import check_slot_mapping
from vllm.kv_quant.slot_codecs import OCTAVE_CHECK_ROPE_DIM, SlotCodec, slot_codec
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.backends.reference_attend import check_codec_write

if TYPE_CHECKING:  # importing it loads the extension
    from vllm._packed_cache_ops import PackedStore

__all__ = ["PACKED_STRIDE_ORDER", "PackedSlots", "packed_kv_cache_shape", "packed_slot_codec"]

PACKED_STRIDE_ORDER: tuple[int, ...] = (0, 2, 1, 3)
"""Physical order of the logical ``(B, H, N, slot)`` dims: block, token, head, slot (TURBOQUANT's
``LBNHC``)."""


def packed_slot_codec(fmt: KVCacheFormat, head_size: int) -> SlotCodec:
    """The reference codec of packed-slot format ``fmt`` for heads of ``head_size`` elements
    (``ValueError`` naming ``head_size`` for a head size the format cannot hold)."""
    try:
        return slot_codec(fmt, head_size, OCTAVE_CHECK_ROPE_DIM)
    except ValueError as exc:
        if str(exc).startswith("head_size:"):
            raise
        raise ValueError(
            f"head_size: expected a head size {fmt.name} can hold, got {head_size} ({exc})"
        ) from None


def packed_kv_cache_shape(
    fmt: KVCacheFormat, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, int, int, int]:
    """``(num_blocks, num_kv_heads, block_size, slot_bytes)`` uint8, TURBOQUANT's logical shape."""
    slot = packed_slot_codec(fmt, head_size).slot_bytes
    return (num_blocks, num_kv_heads, block_size, slot)


class PackedSlots:
    """One layer's packed-slot codec: the cache check, the slot writer and the page reader."""

    def __init__(self, fmt: KVCacheFormat, num_kv_heads: int, head_size: int) -> None:
        self.fmt = fmt
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.codec = packed_slot_codec(fmt, head_size)
        self._stores: dict[torch.device, PackedStore | None] = {}

    def _store(self, device: torch.device) -> PackedStore | None:
        """The kernel store of this format on ``device``: the extension's where it has one
        there, else on a GPU with Triton the Triton store, else None (the codec writes); looked
        up once per device."""
        if device not in self._stores:
            store = None
            try:
                from vllm._packed_cache_ops import compiled_packed_store
            except (ImportError, OSError, RuntimeError):
                pass
            else:
                store = compiled_packed_store(self.fmt, self.head_size, device)
            if store is None and device.type == "cuda" and HAS_TRITON:
                from vllm.v1.attention.ops.triton_packed_store import triton_packed_store

                rope_dim = self.codec.reader.rope_dim
                store = triton_packed_store(self.fmt, self.head_size, rope_dim)
            self._stores[device] = store
        return self._stores[device]

    def cache_view(self, kv_cache: object) -> torch.Tensor:
        """The ``(B, N, H, slot)`` view of a logical ``(B, H, N, slot)`` uint8 cache
        (``ValueError`` for another tensor)."""
        shape = f"(num_blocks, {self.num_kv_heads}, block_size, {self.codec.slot_bytes})"
        if not isinstance(kv_cache, torch.Tensor):
            raise ValueError(
                f"kv_cache: expected a uint8 {shape} tensor for kv_cache_dtype="
                f"{self.fmt.name!r}, got {type(kv_cache).__name__}"
            )
        if (
            kv_cache.dtype != torch.uint8
            or kv_cache.dim() != 4
            or kv_cache.shape[1] != self.num_kv_heads
            or kv_cache.shape[3] != self.codec.slot_bytes
        ):
            raise ValueError(
                f"kv_cache: expected a uint8 {shape} tensor for kv_cache_dtype="
                f"{self.fmt.name!r}, head size {self.head_size}, got {kv_cache.dtype} of shape "
                f"{list(kv_cache.shape)}"
            )
        return kv_cache.transpose(1, 2)

    def write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        view: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Encode the first ``T`` tokens of ``key`` / ``value [T_pad, H, D]`` into the slots
        ``slot_mapping [T]`` (int64; negative: skipped) of ``view`` (:meth:`cache_view`); every
        argument is checked before the first byte is written. Uses the kernel store of the
        format for the cache's device (:meth:`_store`) where there is one, else the codec (the
        same bytes by contract)."""
        sizes = (self.head_size, self.head_size)
        check_codec_write(key, value, sizes, view, None)
        num_blocks, block_size = view.shape[0], view.shape[1]
        check_slot_mapping(slot_mapping, key.shape[0], num_blocks * block_size, view.device)
        n = slot_mapping.shape[0]
        store = self._store(view.device)
        if store is not None:
            store(key[:n], value[:n], view, slot_mapping)
            return
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        if slots.numel() == 0:
            return
        encoded = self.codec.encode(key[:n][keep], value[:n][keep])
        view[slots // block_size, slots % block_size] = encoded

    def read(self, view: torch.Tensor, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(key, value)`` ``[len(pages) * N, H, D]`` of the pages ``pages`` of ``view``,
        token after token."""
        slots = view.index_select(0, pages)
        return self.codec.decode(slots.reshape(-1, self.num_kv_heads, self.codec.slot_bytes))
