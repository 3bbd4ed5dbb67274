"""Each format's reference codec, reached from its registry entry: write a cache side, read it
back, and the ``MAX`` of its scale rule.

The registry (:mod:`vllm.kv_quant.formats`) names each format's row encoding
(:class:`~vllm.kv_quant.formats.CacheKind`); :func:`codec_for` turns an entry into the codec of
that encoding, configured by the entry (FP8 variant, NVFP4 block-scale search, per-token-head
element). Writers and readers that need a format's bytes in torch (the reference backend, the
accuracy harness) ask this one table instead of branching on the format themselves.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from vllm.kv_quant.formats import CacheKind, KVCacheFormat, KVQuantMode, formats
from vllm.kv_quant.fp8 import Fp8Format
from vllm.kv_quant.fp8_cache import fp8_read_cache, fp8_write_cache
from vllm.kv_quant.int4_per_token_head import (
    INT4_QMAX,
    int4_per_token_head_read_cache,
    int4_per_token_head_write_cache,
)
from vllm.kv_quant.nvfp4 import NVFP4_SCALE_MAX
from vllm.kv_quant.nvfp4_cache import check_slot_mapping, nvfp4_read_cache, nvfp4_write_cache
from vllm.kv_quant.per_token_head import (
    per_token_head_qmax,
    per_token_head_read_cache,
    per_token_head_write_cache,
)
from vllm.kv_quant.scale_layout import ScaleLayout

__all__ = ["KVCodec", "codec_dtype_names", "codec_for", "has_codec"]


class KVCodec(ABC):
    """The pure-torch writer and reader of one row encoding.

    ``scale_max`` is ``MAX`` in the format's scale rule ``scale = amax / MAX`` (FP8: the variant's
    largest value; NVFP4: ``448 * 6``; per-token-head: the row's ``QMAX``, computed by the writer
    per row), ``None`` for an unquantized format. ``reads_kv_scale`` says whether ``k_scale`` /
    ``v_scale`` decide the bytes (False for unquantized and per-token-head formats)."""

    scale_max: float | None = None
    reads_kv_scale: bool = False

    @abstractmethod
    def write(
        self,
        x: torch.Tensor,
        side: torch.Tensor,
        slot_mapping: torch.Tensor,
        scale: torch.Tensor,
        layout: ScaleLayout | None,
    ) -> None:
        """Encode the first ``T`` tokens of ``x [T_pad, H, D]`` into slots ``slot_mapping [T]``
        (negative: skipped) of the cache side ``side (B, N, H, D')``, at dequantization scale
        ``scale`` (one value or ``[H]``) and NVFP4 block-scale ``layout``."""

    @abstractmethod
    def read(
        self,
        pages: torch.Tensor,
        scale: torch.Tensor,
        head_size: int,
        layout: ScaleLayout | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """The values ``(p, N, H, head_size)`` of cache pages ``(p, N, H, D')`` in
        ``out_dtype``."""


class _PlainCodec(KVCodec):
    """Unquantized pages: each value rounded to the cache's float dtype, as ``.to()`` does."""

    def write(
        self,
        x: torch.Tensor,
        side: torch.Tensor,
        slot_mapping: torch.Tensor,
        scale: torch.Tensor,
        layout: ScaleLayout | None,
    ) -> None:
        num_blocks, block_size = side.shape[:2]
        check_slot_mapping(slot_mapping, x.shape[0], num_blocks * block_size, side.device)
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        rows = x[: slot_mapping.shape[0]][keep].to(side.dtype)
        side[slots // block_size, slots % block_size] = rows

    def read(
        self,
        pages: torch.Tensor,
        scale: torch.Tensor,
        head_size: int,
        layout: ScaleLayout | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return pages.to(out_dtype)


class _Fp8Codec(KVCodec):
    reads_kv_scale = True

    def __init__(self, variant: Fp8Format) -> None:
        self.variant = variant
        self.scale_max = variant.max

    def write(
        self,
        x: torch.Tensor,
        side: torch.Tensor,
        slot_mapping: torch.Tensor,
        scale: torch.Tensor,
        layout: ScaleLayout | None,
    ) -> None:
        fp8_write_cache(x, side, slot_mapping, scale.to(side.device), self.variant)

    def read(
        self,
        pages: torch.Tensor,
        scale: torch.Tensor,
        head_size: int,
        layout: ScaleLayout | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return fp8_read_cache(pages, scale, self.variant, out_dtype)


class _Nvfp4Codec(KVCodec):
    reads_kv_scale = True
    scale_max = NVFP4_SCALE_MAX

    def __init__(self, scale_search: bool | str) -> None:
        self.scale_search = scale_search

    def write(
        self,
        x: torch.Tensor,
        side: torch.Tensor,
        slot_mapping: torch.Tensor,
        scale: torch.Tensor,
        layout: ScaleLayout | None,
    ) -> None:
        nvfp4_write_cache(
            x, side, slot_mapping, scale.to(side.device), layout, scale_search=self.scale_search
        )

    def read(
        self,
        pages: torch.Tensor,
        scale: torch.Tensor,
        head_size: int,
        layout: ScaleLayout | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return nvfp4_read_cache(pages, scale, head_size, layout, out_dtype)


class _PerTokenHeadCodec(KVCodec):
    """Rows with their own inline scale: ``scale`` is not read."""

    def __init__(self, fmt: KVCacheFormat) -> None:
        self.fmt = fmt
        self.scale_max = per_token_head_qmax(fmt)

    def write(
        self,
        x: torch.Tensor,
        side: torch.Tensor,
        slot_mapping: torch.Tensor,
        scale: torch.Tensor,
        layout: ScaleLayout | None,
    ) -> None:
        per_token_head_write_cache(x, side, slot_mapping, self.fmt)

    def read(
        self,
        pages: torch.Tensor,
        scale: torch.Tensor,
        head_size: int,
        layout: ScaleLayout | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return per_token_head_read_cache(pages, self.fmt, out_dtype)


class _Int4PerTokenHeadCodec(KVCodec):
    """Packed 4-bit rows with their own scale word (no compiled kernel, so no ``CacheKind``):
    ``scale`` is not read; reads rotate back to the original domain."""

    scale_max = INT4_QMAX

    def write(
        self,
        x: torch.Tensor,
        side: torch.Tensor,
        slot_mapping: torch.Tensor,
        scale: torch.Tensor,
        layout: ScaleLayout | None,
    ) -> None:
        int4_per_token_head_write_cache(x, side, slot_mapping)

    def read(
        self,
        pages: torch.Tensor,
        scale: torch.Tensor,
        head_size: int,
        layout: ScaleLayout | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return int4_per_token_head_read_cache(pages, out_dtype)


_CODECS: dict[CacheKind, Callable[[KVCacheFormat], KVCodec]] = {
    CacheKind.UNQUANTIZED: lambda fmt: _PlainCodec(),
    CacheKind.FP8_E4M3: lambda fmt: _Fp8Codec(Fp8Format.E4M3),
    CacheKind.FP8_E5M2: lambda fmt: _Fp8Codec(Fp8Format.E5M2),
    CacheKind.NVFP4: lambda fmt: _Nvfp4Codec(fmt.scale_search),
    CacheKind.INT8_PER_TOKEN_HEAD: _PerTokenHeadCodec,
    CacheKind.FP8_PER_TOKEN_HEAD: _PerTokenHeadCodec,
}
"""Row encoding → its codec, configured by the format."""


@functools.cache
def codec_for(fmt: KVCacheFormat) -> KVCodec:
    """The reference codec of ``fmt`` (by its :attr:`~KVCacheFormat.cache_kind`); ``ValueError``
    for a format no codec reads (a record layout such as ``fp8_ds_mla``, or a platform's
    ``KVQuantMode.CUSTOM`` dtype)."""
    if fmt.quant_mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        return _Int4PerTokenHeadCodec()
    if fmt.cache_kind is None:
        raise ValueError(
            f"kv_cache_dtype: expected a format with a reference codec, got {fmt.name!r} (its "
            "bytes are read by its own kernels only)"
        )
    return _CODECS[fmt.cache_kind](fmt)


def has_codec(fmt: KVCacheFormat) -> bool:
    """Whether :func:`codec_for` gives ``fmt`` a reference codec (torch writers and readers)."""
    try:
        codec_for(fmt)
    except ValueError:
        return False
    return True


def codec_dtype_names() -> tuple[str, ...]:
    """Every accepted name of the user-selectable formats that have a reference codec (not the
    MLA record layouts, nor formats only their own kernels read), in listing order."""
    return tuple(
        name
        for fmt in formats()
        if not fmt.mla_only and has_codec(fmt)
        for name in fmt.accepted_names
    )
