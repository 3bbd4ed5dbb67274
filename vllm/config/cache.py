"""Cache configuration: the accepted KV-cache dtype strings, the registration of a platform's
own dtypes (upstream v0.33's ``register_kv_cache_dtype``), and the user-facing settings."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, get_args, overload, runtime_checkable

import torch

from vllm.config.kv_cache_layout import KVCacheLayout, layout_from_name
from vllm.kv_quant.encoding import ENCODING_GRAMMAR, ENCODING_OPTION, KVCacheEncoding
from vllm.kv_quant.formats import (
    KVCacheFormat,
    KVQuantMode,
    cache_dtype_names,
    find_format,
    format_for_storage,
    register_format,
    unregister_format,
)

logger = logging.getLogger(__name__)

CacheDType = Literal[
    "auto",
    "float16",
    "bfloat16",
    "float32",
    "float",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "nvfp4",
    "nvfp4_mse",
    "nvfp4_4over6",
    "int8_per_token_head",
    "fp8_per_token_head",
    "int4_per_token_head",
    "nvfp4_ds_mla",
    "octave_k3v4",
    "octave_k3v3",
    "octave_k3v3_compact",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "ultraquant_4bit",
]
"""Accepted ``kv_cache_dtype`` strings (upstream's typing name). ``auto`` means the model dtype.
The registry (:mod:`vllm.kv_quant.formats`) is the source of truth; a test pins this
``Literal`` equal to its user-selectable names."""

CACHE_DTYPES: tuple[str, ...] = get_args(CacheDType)


class _KnownDtypes(Sequence[str]):
    """Every user-selectable ``kv_cache_dtype`` string, read live from the format registry
    (upstream's mutable ``KV_CACHE_DTYPES`` list, which its registration appends to)."""

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...

    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return cache_dtype_names()[index]

    def __len__(self) -> int:
        return len(cache_dtype_names())

    def __iter__(self) -> Iterator[str]:
        return iter(cache_dtype_names())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in cache_dtype_names()

    def __repr__(self) -> str:
        return repr(list(cache_dtype_names()))


KV_CACHE_DTYPES: Sequence[str] = _KnownDtypes()
"""The accepted ``--kv-cache-dtype`` values, those registered by handlers included (live)."""


@runtime_checkable
class KVCacheDTypeHandler(Protocol):
    """What a platform backend supplies for its own ``--kv-cache-dtype`` value (upstream's
    protocol): the storage dtype of the cache tensors and the :class:`KVQuantMode` its kernels
    follow (an existing mode to reuse that mode's page layout and codecs, or
    ``KVQuantMode.CUSTOM`` when the backend owns every kernel)."""

    name: str

    def torch_dtype(self) -> torch.dtype: ...

    def quant_mode(self) -> KVQuantMode: ...


_HANDLERS: dict[str, KVCacheDTypeHandler] = {}
"""Registered handlers by dtype name."""

_HandlerT = TypeVar("_HandlerT")


def _handler_format(name: str, handler: KVCacheDTypeHandler) -> KVCacheFormat:
    """The registry entry of a handler's dtype: ``name``, the handler's storage dtype and mode.
    A generic mode keeps the row layout and codec of the registry's format with that mode and
    storage dtype (so pages, planner and reference readers treat it as that format); the
    compiled op, which parses its own names, does not take it."""
    dtype, mode = handler.torch_dtype(), handler.quant_mode()
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name}: torch_dtype() must return a torch.dtype, got {dtype!r}")
    if not isinstance(mode, KVQuantMode):
        raise ValueError(f"{name}: quant_mode() must return a KVQuantMode, got {mode!r}")
    template = None
    if not mode.is_custom_mode:
        try:
            template = format_for_storage(mode, dtype)
        except ValueError:
            template = None
    # A handler of a built-in mode and dtype stores that format's rows (no scale search).
    layout: dict[str, Any] = {}
    if template is not None:
        layout = dict(
            row_dim=template.row_dim,
            fp8_variant=template.fp8_variant,
            block_scale_group=template.block_scale_group,
            scale_layouts=template.scale_layouts,
            cache_kind=template.cache_kind,
        )
    return KVCacheFormat(
        name=name,
        accepted_names=(name,),
        storage_dtype=dtype,
        quant_mode=mode,
        label=name,
        **layout,
        has_kernel=False,
    )


def register_kv_cache_dtype(name: str) -> Callable[[type[_HandlerT]], type[_HandlerT]]:
    """Class decorator registering a platform's own ``--kv-cache-dtype`` value (upstream's
    API): the class is instantiated once, and ``name`` becomes a format of the registry with the
    handler's storage dtype and quant mode, so that ``CacheConfig``, ``KV_CACHE_DTYPES``,
    ``STR_DTYPE_TO_TORCH_DTYPE``, ``get_kv_quant_mode``, the specs and the planner take it.
    Registering a handler's name again warns and replaces it; a built-in dtype cannot be
    replaced (``ValueError``)."""

    def decorate(cls: type[_HandlerT]) -> type[_HandlerT]:
        handler = cls()
        if not isinstance(handler, KVCacheDTypeHandler):
            raise ValueError(
                f"{name}: expected a handler with name, torch_dtype() and quant_mode(), "
                f"got {cls.__name__}"
            )
        fmt = _handler_format(name, handler)
        if name in _HANDLERS:
            logger.warning(
                "The kv-cache-dtype '%s' already exists and will be overwritten by handler %s.",
                name,
                cls,
            )
            unregister_format(find_format(name).name)  # type: ignore[union-attr]
        elif find_format(name) is not None:
            raise ValueError(
                f"{name}: expected a new kv_cache_dtype name, got a built-in one (its bytes are "
                "fixed by the format registry)"
            )
        register_format(fmt)
        _HANDLERS[name] = handler
        return cls

    return decorate


def unregister_kv_cache_dtype(name: str) -> None:
    """Remove a handler's dtype registered with :func:`register_kv_cache_dtype` (beyond
    upstream: for tests and plugins that unload); ``ValueError`` for any other name."""
    if name not in _HANDLERS:
        raise ValueError(f"name: expected a dtype registered by a handler, got {name!r}")
    del _HANDLERS[name]
    unregister_format(name)


def get_kv_cache_dtype_handler(name: str) -> KVCacheDTypeHandler | None:
    """The handler registered for ``name``; None for the built-in dtypes (the registry's)."""
    return _HANDLERS.get(name)


def is_known_kv_cache_dtype(name: str) -> bool:
    """Whether ``name`` is an accepted ``--kv-cache-dtype`` value (registered ones included)."""
    return name in KV_CACHE_DTYPES


MambaCacheMode = Literal["all", "align", "none"]
"""How many Mamba states a request keeps (upstream's typing name)."""

MAMBA_CACHE_MODES: tuple[str, ...] = get_args(MambaCacheMode)


def validate_cache_dtype(cache_dtype: str, arg_name: str = "cache_dtype") -> str:
    """Return ``cache_dtype`` (a dtype string or, beyond upstream, an encoding id such as
    ``nvfp4_mse+offset+prerope+sink``) unchanged, or raise the ``ValueError`` of the registry
    (an unknown dtype, listing the accepted strings; MLA-only record layouts are not
    user-selectable) or of the encoding grammar."""
    KVCacheEncoding.parse(cache_dtype, arg_name, include_mla_only=False)
    return cache_dtype


@dataclass
class CacheConfig:
    """User-facing KV-cache settings.

    ``block_size`` is in tokens per page. ``cache_dtype`` is an accepted ``kv_cache_dtype``
    string or, beyond upstream, an encoding id (:mod:`vllm.kv_quant.encoding`), which the
    planner gives every quantized layer. ``kv_cache_dtype_skip_layers`` names layer kinds
    (``"sliding_window"``, ``"full_attention"``, ``"mla"``, ...) or layer names that stay
    unquantized when ``cache_dtype`` is a quantized dtype.
    """

    block_size: int = 16
    cache_dtype: CacheDType = "auto"
    kv_cache_dtype_skip_layers: list[str] = field(default_factory=list)
    num_gpu_blocks_override: int | None = None
    """Pages per tensor to allocate instead of what the memory budget gives (None: the budget)."""
    mamba_cache_mode: MambaCacheMode = "none"
    """Mamba states kept per request: ``none`` one (plus speculative), ``align`` two, ``all`` one
    per ``block_size`` tokens (prefix caching of states)."""
    enable_prefix_caching: bool = True
    hash_block_size: int | None = None
    """Tokens per block hash when groups have different block sizes (None: their gcd)."""
    kv_cache_layout: str | None = field(default=None, init=False)
    """The resolved physical layout (a ``KVCacheLayout`` name; ``NHD`` / ``HND`` accepted), set
    once by :func:`~vllm.v1.attention.backends.utils.resolve_kv_cache_layout` or by the user;
    ``None`` until then."""

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise ValueError(
                f"block_size: expected a positive int (tokens per page), "
                f"got {self.block_size!r} of type {type(self.block_size).__name__}"
            )
        if self.block_size <= 0:
            raise ValueError(
                f"block_size: expected a positive int (tokens per page), got {self.block_size}"
            )
        if is_known_kv_cache_dtype(self.cache_dtype):
            pass
        elif isinstance(self.cache_dtype, str) and ENCODING_OPTION.search(self.cache_dtype):
            validate_cache_dtype(self.cache_dtype)  # an encoding id: the grammar's error
        else:
            raise ValueError(
                f"cache_dtype: Invalid kv_cache_dtype: {self.cache_dtype!r}; expected one of "
                f"{', '.join(KV_CACHE_DTYPES)} (or an encoding id, {ENCODING_GRAMMAR})"
            )
        for name in ("num_gpu_blocks_override", "hash_block_size"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                raise ValueError(f"{name}: expected None or a positive int, got {value!r}")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode: expected one of {', '.join(MAMBA_CACHE_MODES)}, "
                f"got {self.mamba_cache_mode!r}"
            )
        if isinstance(self.kv_cache_dtype_skip_layers, str) or not all(
            isinstance(name, str) for name in self.kv_cache_dtype_skip_layers
        ):
            raise ValueError(
                "kv_cache_dtype_skip_layers: expected a list of layer kinds or names, "
                f"got {self.kv_cache_dtype_skip_layers!r}"
            )

    def get_resolved_kv_cache_layout(self) -> KVCacheLayout:
        """The layout :attr:`kv_cache_layout` names; ``ValueError`` while it is unresolved."""
        if self.kv_cache_layout is None:
            raise ValueError(
                "kv_cache_layout: expected a resolved layout (resolve_kv_cache_layout runs once "
                "before the cache is planned, or set it), got None"
            )
        return layout_from_name(self.kv_cache_layout, "kv_cache_layout")
