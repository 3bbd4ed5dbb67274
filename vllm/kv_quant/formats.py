"""The KV-cache format registry: what a ``kv_cache_dtype`` string means, in one place.

Every fact about a cache format lives in its :class:`KVCacheFormat` entry: the strings that name
it (aliases included), its storage dtype, whether and how it is quantized
(:class:`KVQuantMode`, FP8 variant, block-scale group and scale layouts), the size of a cached
row as a function of the head size, whether it is an MLA-only record layout, its display label,
and its row encoding (:class:`CacheKind`, the one enum of format kinds that the reference codecs,
the compiled kernels and the Triton kernels share). Every other module asks this one; none
compares dtype strings itself. :func:`lookup` resolves any accepted name (aliases in
one place) and raises the one "unknown KV-cache dtype" error.

The compiled op parses ``kv_cache_dtype`` strings itself (upstream engines call
``torch.ops._C_cache_ops.reshape_and_cache_flash`` directly), with its own table in
``csrc/dispatch_utils.h``. The Python side of that mapping is :attr:`KVCacheFormat.cache_kind`;
``tests/kv_quant/test_formats.py`` pins the two tables equal, and :func:`kernel_cache_kind`
is the one check that rejects a registered format the kernels do not write.

This module sits at the bottom of the dependency graph: it imports torch and, from vllm, only
the enums of :mod:`vllm.kv_quant.modes`. How a layer encodes its cache beyond the dtype
(scales, layouts, key transforms, sinks) is :class:`vllm.kv_quant.encoding.KVCacheEncoding`,
built on these entries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from vllm.kv_quant.modes import CacheKind, KVQuantMode

__all__ = [
    "AUTO",
    "BFLOAT16",
    "FLOAT16",
    "FLOAT32",
    "FP8_DS_MLA",
    "FP8_E4M3",
    "FP8_E5M2",
    "FP8_PER_TOKEN_HEAD",
    "INT8_PER_TOKEN_HEAD",
    "NVFP4",
    "accepted_names_of",
    "FP8_DS_MLA_HEAD_SIZE",
    "FP8_DS_MLA_RECORD_BYTES",
    "FP8_DS_MLA_RECORDS",
    "FP8_DS_MLA_V32_HEAD_SIZE",
    "FP8_DS_MLA_V32_RECORD_BYTES",
    "KERNEL_OPS",
    "NVFP4_GROUP_SIZE",
    "PER_TOKEN_HEAD_SCALE_BYTES",
    "CacheKind",
    "KVCacheFormat",
    "KVQuantMode",
    "cache_dtype_names",
    "find_dtype_name",
    "find_format",
    "format_for_storage",
    "format_of_kind",
    "formats",
    "kernel_cache_kind",
    "lookup",
    "nvfp4_packed_dim",
    "quant_mode_formats",
    "register_format",
    "registered_format",
    "storage_dtypes",
    "torch_dtype_names",
    "unregister_format",
]


NVFP4_GROUP_SIZE = 16
"""Elements sharing one FP8-e4m3 block scale in an NVFP4 cache."""

FP8_DS_MLA_RECORD_BYTES = 584
"""Bytes per stored slot of the ``fp8_ds_mla`` layout (head size 512: 448 fp8 latent bytes,
64 bf16 RoPE elements, 8 scale bytes)."""

FP8_DS_MLA_HEAD_SIZE = 512
"""The latent head size of DeepSeek-V4's 584-byte ``fp8_ds_mla`` record."""

FP8_DS_MLA_V32_RECORD_BYTES = 656
"""Bytes per token of DeepSeek-V3.2's ``fp8_ds_mla`` layout (head size 576: 512 fp8 latent
bytes, 4 fp32 scales of 128 values each, 64 bf16 RoPE elements)."""

FP8_DS_MLA_V32_HEAD_SIZE = 576
"""The latent head size of DeepSeek-V3.2's 656-byte ``fp8_ds_mla`` layout."""

FP8_DS_MLA_RECORDS: dict[int, int] = {
    FP8_DS_MLA_V32_HEAD_SIZE: FP8_DS_MLA_V32_RECORD_BYTES,
    FP8_DS_MLA_HEAD_SIZE: FP8_DS_MLA_RECORD_BYTES,
}
"""``fp8_ds_mla`` record bytes by latent head size (the two layouts upstream writes)."""

PER_TOKEN_HEAD_SCALE_BYTES = 4
"""Bytes of the fp32 scale that ends each row of a per-token-head cache (docs/design.md §5.4)."""

KERNEL_OPS = "CPU/CUDA reshape_and_cache_flash"
"""The compiled kernels that write a cache format (named in the no-kernel-support error)."""


def _element_dim(head_size: int) -> int:
    """One storage element per value: the row is ``head_size`` elements."""
    return head_size


def nvfp4_packed_dim(head_size: int) -> int:
    """Packed NVFP4 bytes per head per side: ``D/2`` data bytes plus ``D/16`` scale bytes."""
    if head_size <= 0 or head_size % NVFP4_GROUP_SIZE != 0:
        raise ValueError(
            f"head_size: NVFP4 KV cache needs a positive multiple of {NVFP4_GROUP_SIZE}, "
            f"got {head_size}"
        )
    return head_size // 2 + head_size // NVFP4_GROUP_SIZE


def _per_token_head_row_dim(head_size: int) -> int:
    """``head_size`` one-byte values, then the row's fp32 scale. A multiple of 4 keeps that scale
    4-byte aligned in every row, which kernels and fp32 views of the page need."""
    if head_size <= 0 or head_size % PER_TOKEN_HEAD_SCALE_BYTES != 0:
        raise ValueError(
            f"head_size: a per-token-head KV cache needs a positive multiple of "
            f"{PER_TOKEN_HEAD_SCALE_BYTES}, got {head_size}"
        )
    return head_size + PER_TOKEN_HEAD_SCALE_BYTES


def _ds_mla_record_dim(head_size: int) -> int:
    """Bytes of one ``fp8_ds_mla`` record, by the latent head size it stores: 656 for
    DeepSeek-V3.2's 576 (512 + 64 RoPE), 584 for DeepSeek-V4's 512 (448 + 64 RoPE)."""
    record = FP8_DS_MLA_RECORDS.get(head_size)
    if record is None:
        raise ValueError(
            f"head_size: the fp8_ds_mla record is defined for head sizes "
            f"{FP8_DS_MLA_V32_HEAD_SIZE} (DeepSeek-V3.2) and {FP8_DS_MLA_HEAD_SIZE} "
            f"(DeepSeek-V4), got {head_size}"
        )
    return record


@dataclass(frozen=True)
class KVCacheFormat:
    """One KV-cache format and every fact the code needs about it.

    ``accepted_names`` are the ``kv_cache_dtype`` strings naming it, in the order error messages
    list them (``name`` is the canonical one among them). ``storage_dtype`` is the cache
    tensor's element dtype, ``None`` for ``auto`` (the model dtype). ``row_dim`` maps a head size
    ``D`` (elements) to the last dim of the cache (storage elements per head per side).
    ``cache_kind`` is the row encoding (:class:`CacheKind`) that the codecs and kernels share,
    ``None`` for a record layout no codec reads (``fp8_ds_mla``); ``has_kernel`` says whether the
    compiled writers take the format (a format added to the registry alone has codecs but no
    kernel yet).
    """

    name: str
    accepted_names: tuple[str, ...]
    storage_dtype: torch.dtype | None
    quant_mode: KVQuantMode
    label: str
    """Short display label: ``bf16``, ``fp16``, ``fp32``, ``fp8``, ``nvfp4``, ``int8_pth``, ...."""
    row_dim: Callable[[int], int] = _element_dim
    fp8_variant: str | None = None
    """``e4m3`` or ``e5m2`` for FP8 storage (the element encoding), else ``None``."""
    block_scale_group: int | None = None
    """Values per block scale (16 for NVFP4); head sizes must be multiples of it."""
    scale_layouts: tuple[str, ...] = ()
    """Where block scales may sit in a page (``ScaleLayout`` values); empty without them."""
    scale_search: bool | str = False
    """NVFP4 writer option (``nvfp4_mse``): each group's block scale is the best of its e4m3
    neighbours by squared group error (docs/design.md §5.3); ``"4over6"`` (``nvfp4_4over6``):
    ``amax / 6`` or ``amax / 4``, whichever gives the lower group error. Only the writer differs:
    pages, layouts and readers are those of the format's quant mode."""
    mla_only: bool = False
    """A record layout for MLA latents only (not a user-selectable ``kv_cache_dtype``)."""
    cache_kind: CacheKind | None = None
    has_kernel: bool = True
    torch_dtype_aliases: tuple[str, ...] = ()
    """Further names of ``storage_dtype`` as a torch dtype (``half``) that are not
    ``kv_cache_dtype`` strings."""

    def __post_init__(self) -> None:
        if self.name not in self.accepted_names:
            raise ValueError(
                f"accepted_names: must include the canonical name {self.name!r}, "
                f"got {self.accepted_names!r}"
            )
        kind = self.cache_kind
        variant = _FP8_VARIANTS.get(kind) if kind is not None else None
        if kind in _FP8_VARIANTS and self.fp8_variant != variant:
            raise ValueError(
                f"fp8_variant: expected {variant!r} for cache_kind {kind.name}, "
                f"got {self.fp8_variant!r}"
            )

    @property
    def is_auto(self) -> bool:
        """Stored in the model dtype, whatever it is."""
        return self.storage_dtype is None

    @property
    def is_quantized(self) -> bool:
        return self.quant_mode.is_quantized

    @property
    def is_fp8(self) -> bool:
        """FP8 elements with one per-tensor (or per-head) scale, including ``fp8_ds_mla``."""
        return self.quant_mode.is_fp8

    @property
    def is_nvfp4(self) -> bool:
        return self.quant_mode.is_nvfp4

    @property
    def is_per_token_head(self) -> bool:
        """Rows of one-byte values ending in their own fp32 scale (``k_scale`` unused)."""
        return self.quant_mode.is_per_token_head

    def last_dim(self, head_size: int) -> int:
        """Last dim of the cache for head size ``head_size`` (storage elements)."""
        return self.row_dim(head_size)

    def resolve_storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The element dtype of the cache tensor for a model in ``model_dtype``."""
        return model_dtype if self.storage_dtype is None else self.storage_dtype


_FP8_VARIANTS = {CacheKind.FP8_E4M3: "e4m3", CacheKind.FP8_E5M2: "e5m2"}
"""The FP8 element encoding of each FP8 row kind."""

_FORMATS: dict[str, KVCacheFormat] = {}
"""Canonical name → format, in registration order (the order names are listed in)."""

_BY_NAME: dict[str, KVCacheFormat] = {}
"""Every accepted name → its format: the one alias table."""


def register_format(fmt: KVCacheFormat) -> KVCacheFormat:
    """Add ``fmt``; ``ValueError`` when one of its names is taken."""
    taken = [n for n in fmt.accepted_names if n in _BY_NAME]
    if taken:
        raise ValueError(
            f"format: {fmt.name!r} reuses the registered KV-cache dtype name(s) {', '.join(taken)}"
        )
    _FORMATS[fmt.name] = fmt
    for accepted in fmt.accepted_names:
        _BY_NAME[accepted] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove the format whose canonical name is ``name`` (and its aliases)."""
    fmt = _FORMATS.pop(name)
    for accepted in fmt.accepted_names:
        del _BY_NAME[accepted]


@contextmanager
def registered_format(fmt: KVCacheFormat) -> Iterator[KVCacheFormat]:
    """``fmt`` registered for the duration of the ``with`` block (for tests and experiments)."""
    register_format(fmt)
    try:
        yield fmt
    finally:
        unregister_format(fmt.name)


def formats() -> tuple[KVCacheFormat, ...]:
    """Every registered format, in registration order."""
    return tuple(_FORMATS.values())


def quant_mode_formats() -> tuple[KVCacheFormat, ...]:
    """The first registered user-selectable format of each quantization mode (``fp8_e4m3``,
    ``nvfp4``, ``int8_per_token_head``, ``fp8_per_token_head``), in registration order: one
    format per distinct quantized page layout (FP8 e5m2 pages are e4m3's size), for tools that
    compare one of each (``vllm-kv plan`` columns, ``vllm-kv bench`` kinds); only formats the
    kernels write (``bench`` launches them)."""
    by_mode: dict[KVQuantMode, KVCacheFormat] = {}
    for fmt in _FORMATS.values():
        if fmt.is_quantized and not fmt.mla_only and fmt.cache_kind is not None and fmt.has_kernel:
            by_mode.setdefault(fmt.quant_mode, fmt)
    return tuple(by_mode.values())


def cache_dtype_names(*, include_mla_only: bool = False) -> tuple[str, ...]:
    """Every accepted ``kv_cache_dtype`` string, aliases included, in listing order; MLA-only
    record layouts (``fp8_ds_mla``) only with ``include_mla_only``."""
    return tuple(
        name
        for fmt in _FORMATS.values()
        if include_mla_only or not fmt.mla_only
        for name in fmt.accepted_names
    )


def torch_dtype_names() -> dict[str, torch.dtype]:
    """Every name of a storage dtype (cache dtype strings and torch aliases such as ``half``)
    → the dtype; ``auto`` and MLA-only layouts excluded. Upstream's ``STR_DTYPE_TO_TORCH_DTYPE``."""
    table: dict[str, torch.dtype] = {}
    for fmt in _FORMATS.values():
        if fmt.storage_dtype is None or fmt.mla_only:
            continue
        for name in (*fmt.accepted_names, *fmt.torch_dtype_aliases):
            table[name] = fmt.storage_dtype
    return table


def storage_dtypes() -> tuple[torch.dtype, ...]:
    """Every element dtype a KV-cache tensor may have: the storage dtypes of the registered
    formats (``auto`` stores the model dtype, one of the unquantized ones), in registration
    order, without repeats."""
    return tuple(
        dict.fromkeys(f.storage_dtype for f in _FORMATS.values() if f.storage_dtype is not None)
    )


def find_format(kv_cache_dtype: str) -> KVCacheFormat | None:
    """The format named by ``kv_cache_dtype``, or ``None`` when no format has that name."""
    return _BY_NAME.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None


def find_dtype_name(name: str) -> KVCacheFormat | None:
    """The format a ``kv_cache_dtype`` string or a torch dtype alias (``half``) names, else
    ``None`` (for display: a dtype name that is not a cache dtype still has a label)."""
    fmt = find_format(name)
    if fmt is None:
        fmt = next((f for f in _FORMATS.values() if name in f.torch_dtype_aliases), None)
    return fmt


def accepted_names_of(*fmts: KVCacheFormat) -> list[str]:
    """Every accepted name (aliases included) of ``fmts``, in order: what a backend that
    supports these formats lists as its ``supported_kv_cache_dtypes``."""
    return [name for fmt in fmts for name in fmt.accepted_names]


def lookup(
    kv_cache_dtype: str, arg_name: str = "kv_cache_dtype", *, include_mla_only: bool = True
) -> KVCacheFormat:
    """The format named by ``kv_cache_dtype`` (any accepted name or alias).

    Raises the one ``ValueError`` for a name that is not a KV-cache dtype, listing the accepted
    ones. ``include_mla_only=False`` rejects MLA-only record layouts the same way (where a user
    or a non-MLA layer names the dtype).
    """
    fmt = find_format(kv_cache_dtype)
    if fmt is None or (fmt.mla_only and not include_mla_only):
        accepted = cache_dtype_names(include_mla_only=include_mla_only)
        raise ValueError(
            f"{arg_name}: unknown KV-cache dtype {kv_cache_dtype!r}; "
            f"expected one of {', '.join(accepted)}"
        )
    return fmt


def format_for_storage(quant_mode: KVQuantMode, storage_dtype: torch.dtype) -> KVCacheFormat:
    """The format a spec describes with ``(kv_quant_mode, dtype)``: the first registered
    non-MLA-only format with that mode and storage dtype (FP8 → ``fp8_e4m3``: a spec does not
    record the FP8 variant, which has the same bytes). An unquantized dtype that no unquantized
    format names but some format stores (:func:`storage_dtypes`) is ``auto``; quantized bytes may
    be viewed as another dtype of the same element size; anything else raises (``int32``)."""
    candidates = [f for f in _FORMATS.values() if f.quant_mode == quant_mode and not f.mla_only]
    for fmt in candidates:
        if fmt.storage_dtype == storage_dtype:
            return fmt
    if not quant_mode.is_quantized:
        stored = storage_dtypes()
        if storage_dtype not in stored:
            raise ValueError(
                f"dtype: expected a KV-cache storage dtype ({', '.join(map(str, stored))}), "
                f"got {storage_dtype}"
            )
        return _FORMATS["auto"]
    for fmt in candidates:  # quantized bytes viewed as another 1-byte dtype (float8_e4m3fn)
        if fmt.storage_dtype is not None and fmt.storage_dtype.itemsize == storage_dtype.itemsize:
            return fmt
    raise ValueError(
        f"dtype: no KV-cache format stores {quant_mode.name} caches as {storage_dtype}"
    )


def format_of_kind(kind: CacheKind) -> KVCacheFormat:
    """The first registered format with row encoding ``kind`` (``fp8_e5m2`` for
    ``CacheKind.FP8_E5M2``): the name under which kernels of that kind are launched."""
    for fmt in _FORMATS.values():
        if fmt.cache_kind is kind and fmt.has_kernel:
            return fmt
    raise ValueError(f"kind: no registered format writes {kind.name}")


def kernel_cache_kind(kv_cache_dtype: str, arg_name: str = "kv_cache_dtype") -> CacheKind:
    """The compiled kernels' ``CacheKind`` for ``kv_cache_dtype``: the one check that rejects a
    registered format the kernels do not write (``ValueError`` naming the format and the missing
    kernels, e.g. ``fp8_ds_mla``), after :func:`lookup`'s unknown-dtype check."""
    fmt = lookup(kv_cache_dtype, arg_name)
    if fmt.cache_kind is None or not fmt.has_kernel:
        raise ValueError(f"{arg_name}: format {fmt.name!r} has no kernel support ({KERNEL_OPS})")
    return fmt.cache_kind


_UNQUANTIZED = dict(quant_mode=KVQuantMode.NONE, cache_kind=CacheKind.UNQUANTIZED)
_FP8 = dict(storage_dtype=torch.uint8, quant_mode=KVQuantMode.FP8_PER_TENSOR, label="fp8")

AUTO = register_format(
    KVCacheFormat(
        name="auto", accepted_names=("auto",), storage_dtype=None, label="auto", **_UNQUANTIZED
    )
)
FLOAT16 = register_format(
    KVCacheFormat(
        name="float16",
        accepted_names=("float16",),
        storage_dtype=torch.float16,
        label="fp16",
        torch_dtype_aliases=("half",),
        **_UNQUANTIZED,
    )
)
BFLOAT16 = register_format(
    KVCacheFormat(
        name="bfloat16",
        accepted_names=("bfloat16",),
        storage_dtype=torch.bfloat16,
        label="bf16",
        **_UNQUANTIZED,
    )
)
FLOAT32 = register_format(
    KVCacheFormat(
        name="float32",
        accepted_names=("float32", "float"),
        storage_dtype=torch.float32,
        label="fp32",
        **_UNQUANTIZED,
    )
)
FP8_E4M3 = register_format(
    KVCacheFormat(
        name="fp8_e4m3",
        accepted_names=("fp8", "fp8_e4m3"),
        fp8_variant="e4m3",
        cache_kind=CacheKind.FP8_E4M3,
        **_FP8,
    )
)
FP8_E5M2 = register_format(
    KVCacheFormat(
        name="fp8_e5m2",
        accepted_names=("fp8_e5m2",),
        fp8_variant="e5m2",
        cache_kind=CacheKind.FP8_E5M2,
        **_FP8,
    )
)
NVFP4 = register_format(
    KVCacheFormat(
        name="nvfp4",
        accepted_names=("nvfp4",),
        storage_dtype=torch.uint8,
        quant_mode=KVQuantMode.NVFP4,
        label="nvfp4",
        row_dim=nvfp4_packed_dim,
        block_scale_group=NVFP4_GROUP_SIZE,
        scale_layouts=("linear", "interleave4"),
        cache_kind=CacheKind.NVFP4,
    )
)
NVFP4_MSE = register_format(
    KVCacheFormat(
        name="nvfp4_mse",
        accepted_names=("nvfp4_mse",),
        storage_dtype=torch.uint8,
        quant_mode=KVQuantMode.NVFP4,
        label="nvfp4_mse",
        row_dim=nvfp4_packed_dim,
        block_scale_group=NVFP4_GROUP_SIZE,
        scale_layouts=("linear", "interleave4"),
        scale_search=True,
        cache_kind=CacheKind.NVFP4,
    )
)
NVFP4_4OVER6 = register_format(
    KVCacheFormat(
        name="nvfp4_4over6",
        accepted_names=("nvfp4_4over6",),
        storage_dtype=torch.uint8,
        quant_mode=KVQuantMode.NVFP4,
        label="nvfp4_4over6",
        row_dim=nvfp4_packed_dim,
        block_scale_group=NVFP4_GROUP_SIZE,
        scale_layouts=("linear", "interleave4"),
        scale_search="4over6",
        cache_kind=CacheKind.NVFP4,
    )
)
INT8_PER_TOKEN_HEAD = register_format(
    KVCacheFormat(
        name="int8_per_token_head",
        accepted_names=("int8_per_token_head",),
        storage_dtype=torch.int8,
        quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
        label="int8_pth",
        row_dim=_per_token_head_row_dim,
        cache_kind=CacheKind.INT8_PER_TOKEN_HEAD,
    )
)
FP8_PER_TOKEN_HEAD = register_format(
    KVCacheFormat(
        name="fp8_per_token_head",
        accepted_names=("fp8_per_token_head",),
        storage_dtype=torch.uint8,
        quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD,
        label="fp8_pth",
        row_dim=_per_token_head_row_dim,
        cache_kind=CacheKind.FP8_PER_TOKEN_HEAD,
    )
)
FP8_DS_MLA = register_format(
    KVCacheFormat(
        name="fp8_ds_mla",
        accepted_names=("fp8_ds_mla",),
        storage_dtype=torch.uint8,
        quant_mode=KVQuantMode.FP8_PER_TENSOR,
        label="fp8_ds_mla",
        row_dim=_ds_mla_record_dim,
        fp8_variant="e4m3",
        mla_only=True,
    )
)
