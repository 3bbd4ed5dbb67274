"""KV-cache specs: what one page of a layer's cache holds, and how many bytes it takes.

Units: ``block_size`` is in tokens per page, every ``*_bytes`` quantity is in bytes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.kv_cache_format import (
    FP8_DS_MLA_HEAD_SIZE,  # noqa: F401  (re-exported: its home before the format registry)
    FP8_DS_MLA_RECORD_BYTES,  # noqa: F401
    KVCacheFormat,
    KVQuantMode,
    format_for_storage,
    lookup,
)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(a // -b)


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ≥ ``x``."""
    return cdiv(x, multiple) * multiple


def get_kv_quant_mode(kv_cache_dtype: str) -> KVQuantMode:
    """Quantization mode of a ``kv_cache_dtype`` string (the registry's ``quant_mode``)."""
    return lookup(kv_cache_dtype).quant_mode


def _check_torch_dtype(name: str, value: object) -> None:
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name}: expected a torch.dtype, got {value!r} ({type(value).__name__})")


def _check_positive(spec: object, *names: str) -> None:
    for name in names:
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"{name}: expected a positive int for {type(spec).__name__}, got {value!r}"
            )


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec(ABC):
    """A layer's KV-cache page: ``block_size`` tokens."""

    block_size: int

    @property
    @abstractmethod
    def page_size_bytes(self) -> int:
        """Bytes of one page as allocated (padding included)."""

    @abstractmethod
    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        """Most bytes one request of ``max_model_len`` tokens can hold in this layer."""

    @property
    def storage_block_size(self) -> int:
        """Slots stored per page (equals ``block_size`` unless the spec compresses tokens)."""
        return self.block_size

    @classmethod
    def merge(cls, specs: list[Any]) -> Any:
        """The one spec of a group; all specs must be equal, else ``ValueError``."""
        if not specs:
            raise ValueError("specs: expected at least one spec to merge, got none")
        first = specs[0]
        for other in specs[1:]:
            if type(other) is not type(first):
                raise ValueError(
                    f"specs: cannot merge {type(first).__name__} with {type(other).__name__}"
                )
            for f in fields(first):
                a, b = getattr(first, f.name), getattr(other, f.name)
                if a != b:
                    raise ValueError(
                        f"specs: cannot merge {type(first).__name__}s that differ in "
                        f"{f.name}: {a!r} vs {b!r}"
                    )
        return first

    def copy_with_new_block_size(self, block_size: int) -> Any:
        """The same spec with pages of ``block_size`` tokens."""
        return replace(self, block_size=block_size)


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """A paged K/V cache of ``num_kv_heads`` heads.

    ``dtype`` is the storage dtype (``torch.uint8`` for FP8 and NVFP4). ``head_size_v``
    defaults to ``head_size``. ``page_size_padded`` (bytes) overrides the page size when a
    group needs equal pages.
    """

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None
    head_size_v: int | None = None

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        _check_positive(self, "block_size", "num_kv_heads", "head_size", "head_size_v")
        _check_torch_dtype("dtype", self.dtype)
        if not isinstance(self.kv_quant_mode, KVQuantMode):
            raise ValueError(
                f"kv_quant_mode: expected a KVQuantMode, got {self.kv_quant_mode!r} "
                f"({type(self.kv_quant_mode).__name__})"
            )
        if self.kv_quant_mode.is_quantized and get_dtype_size(self.dtype) != 1:
            raise ValueError(
                f"dtype: {self.kv_quant_mode.name} caches are stored as 1-byte elements "
                f"(torch.uint8), got {self.dtype}"
            )
        # The registry's storage-dtype rule, also for latent specs that name their format.
        format_for_storage(self.kv_quant_mode, self.dtype)
        group = self.kv_cache_format.block_scale_group
        if group is not None:
            for name in ("head_size", "head_size_v"):
                size = getattr(self, name)
                if size % group != 0:
                    raise ValueError(
                        f"{name}: {self.kv_quant_mode.name} KV cache needs a multiple of {group} "
                        f"(one FP8 scale per {group} elements), got {size}"
                    )
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"page_size_padded: a padded page must hold the real page of "
                f"{self.real_page_size_bytes} bytes, got {self.page_size_padded}"
            )

    @property
    def kv_cache_format(self) -> KVCacheFormat:
        """The registry's format of this cache, derived from ``(kv_quant_mode, dtype)`` (FP8 →
        ``fp8_e4m3``: the variant is not a page-size fact and a spec does not record it)."""
        return format_for_storage(self.kv_quant_mode, self.dtype)

    @property
    def head_bytes_per_token(self) -> int:
        """K plus V bytes of one token of one head."""
        assert self.head_size_v is not None
        fmt = self.kv_cache_format
        row_elements = fmt.last_dim(self.head_size) + fmt.last_dim(self.head_size_v)
        return row_elements * get_dtype_size(self.dtype)

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one page without padding."""
        return self.block_size * self.num_kv_heads * self.head_bytes_per_token

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token of the sequence stays in the cache."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Only the last ``sliding_window`` tokens are attended to; older pages can be freed."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "sliding_window")

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        batched = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        num_tokens = min(self.sliding_window - 1 + batched, max_model_len)
        # One extra page: the window may start in the middle of a page.
        return (cdiv(num_tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Tokens attend within chunks of ``attention_chunk_size`` tokens."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "attention_chunk_size")

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        batched = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        num_tokens = min(self.attention_chunk_size + batched, max_model_len)
        return cdiv(num_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class LatentPageSpec(AttentionSpec):
    """Page math of latent (MLA-style) caches: one slot of ``head_size`` per stored token,
    shared by all heads, or a 584-byte record for ``cache_dtype_str="fp8_ds_mla"``.

    ``alignment`` (bytes) pads the page to a multiple of it.
    """

    cache_dtype_str: str | None = None
    alignment: int | None = None

    def __post_init__(self) -> None:
        if self.alignment is not None:
            _check_positive(self, "alignment")
        super().__post_init__()
        if self.kv_quant_mode.is_nvfp4:
            raise ValueError(
                "kv_quant_mode: NVFP4 is not a format for MLA caches (supported: unquantized, "
                "fp8, fp8_ds_mla)"
            )
        self.kv_cache_format.last_dim(self.head_size)  # a record layout checks its head size

    @property
    def kv_cache_format(self) -> KVCacheFormat:
        """The format named by ``cache_dtype_str`` when set (e.g. ``fp8_ds_mla``), else the one
        ``(kv_quant_mode, dtype)`` describe."""
        if self.cache_dtype_str is not None:
            return lookup(self.cache_dtype_str, "cache_dtype_str")
        return super().kv_cache_format

    @property
    def slot_size_bytes(self) -> int:
        """Bytes of one stored slot (all heads): one row of the format's last dim per head."""
        row = self.kv_cache_format.last_dim(self.head_size)
        return self.num_kv_heads * row * get_dtype_size(self.dtype)

    @property
    def real_page_size_bytes(self) -> int:
        return self.storage_block_size * self.slot_size_bytes

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        if self.alignment is not None:
            return round_up(self.real_page_size_bytes, self.alignment)
        return self.real_page_size_bytes


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(LatentPageSpec, FullAttentionSpec):
    """Multi-head latent attention: one latent of ``head_size`` per token, shared by all heads.

    ``compress_ratio`` r > 1 (DeepSeek-V4 compressed layers) keeps one slot per r tokens, so a
    page of ``block_size`` tokens stores ``storage_block_size = block_size // r`` slots.
    """

    compress_ratio: int = 1

    def __post_init__(self) -> None:
        _check_positive(self, "compress_ratio")
        super().__post_init__()
        if self.block_size % self.compress_ratio != 0:
            raise ValueError(
                f"block_size: must be a multiple of compress_ratio={self.compress_ratio}, "
                f"got {self.block_size}"
            )

    @property
    def storage_block_size(self) -> int:
        return self.block_size // self.compress_ratio


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(LatentPageSpec, SlidingWindowSpec):
    """Sliding-window attention over one shared latent per token (DeepSeek-V4's SWA cache):
    latent page math, sliding-window memory bound."""


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Fixed-size recurrent state per request: one page holds every state tensor of a layer.

    ``shapes[i]`` and ``dtypes[i]`` describe state tensor i (e.g. conv and SSM state).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"

    def __post_init__(self) -> None:
        _check_positive(self, "block_size")
        for name, value, what in (
            ("shapes", self.shapes, "state shapes"),
            ("dtypes", self.dtypes, "torch.dtypes"),
        ):
            if not isinstance(value, (tuple, list)):
                raise ValueError(
                    f"{name}: expected a tuple of {what}, got {value!r} ({type(value).__name__})"
                )
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise ValueError(
                f"shapes/dtypes: expected one dtype per state shape, got {len(self.shapes)} "
                f"shapes and {len(self.dtypes)} dtypes"
            )
        for i, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes, strict=True)):
            if not isinstance(shape, (tuple, list)):  # torch.Size is a tuple
                raise ValueError(
                    f"shapes[{i}]: expected a tuple of ints (a state shape), got {shape!r} "
                    f"({type(shape).__name__})"
                )
            if any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
                raise ValueError(
                    f"shapes[{i}]: expected a state shape of positive ints, got {shape!r}"
                )
            _check_torch_dtype(f"dtypes[{i}]", dtype)
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"page_size_padded: a padded page must hold the real page of "
                f"{self.real_page_size_bytes} bytes, got {self.page_size_padded}"
            )

    @property
    def state_sizes_bytes(self) -> tuple[int, ...]:
        """Bytes of each state tensor, in order."""
        return tuple(
            math.prod(shape) * get_dtype_size(dtype)
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def real_page_size_bytes(self) -> int:
        return sum(self.state_sizes_bytes)

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        return self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers that need the same slots (same type and block size) but may differ in page size.

    One "page" of the group is one page of every layer, so its size is the sum.
    """

    kv_cache_specs: dict[str, KVCacheSpec]

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        return sum(
            spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
            for spec in self.kv_cache_specs.values()
        )

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """True when all specs need the same slots: same class, block size and window."""
        specs = list(kv_cache_specs.values())
        if not specs:
            return False
        first = specs[0]

        def slot_key(spec: KVCacheSpec) -> tuple[Any, ...]:
            return (
                type(spec),
                spec.block_size,
                spec.storage_block_size,
                getattr(spec, "sliding_window", None),
                getattr(spec, "attention_chunk_size", None),
            )

        return not isinstance(first, (MambaSpec, UniformTypeKVCacheSpecs)) and all(
            slot_key(spec) == slot_key(first) for spec in specs
        )

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """The group spec of ``kv_cache_specs``, or None when they are not of uniform type."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=dict(kv_cache_specs))

    def copy_with_new_block_size(self, block_size: int) -> UniformTypeKVCacheSpecs:
        return UniformTypeKVCacheSpecs(
            block_size=block_size,
            kv_cache_specs={
                name: spec.copy_with_new_block_size(block_size)
                for name, spec in self.kv_cache_specs.items()
            },
        )


@dataclass
class KVCacheTensor:
    """One raw buffer of ``size`` bytes, shared by the layers in ``shared_by``."""

    size: int
    shared_by: list[str]


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table, and the spec of their pages."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    """How the KV cache is allocated: ``num_blocks`` pages per tensor, and the groups."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]

    def __post_init__(self) -> None:
        n = self.num_blocks
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"num_blocks: expected an int >= 0 (pages per tensor), got {n!r}")


def iter_layer_specs(config: KVCacheConfig) -> Iterator[tuple[str, KVCacheSpec]]:
    """``(layer name, the layer's own spec)`` for every layer of ``config``, group by group.

    A :class:`UniformTypeKVCacheSpecs` group is split per layer; ``ValueError`` when it has no
    spec for one of its layers.
    """
    for group_idx, group in enumerate(config.kv_cache_groups):
        group_spec = group.kv_cache_spec
        for layer_name in group.layer_names:
            if not isinstance(group_spec, UniformTypeKVCacheSpecs):
                yield layer_name, group_spec
            elif layer_name in group_spec.kv_cache_specs:
                yield layer_name, group_spec.kv_cache_specs[layer_name]
            else:
                raise ValueError(
                    f"kv_cache_config: layer {layer_name!r} of group {group_idx} has no "
                    f"spec in its UniformTypeKVCacheSpecs (has: "
                    f"{', '.join(group_spec.kv_cache_specs)})"
                )
