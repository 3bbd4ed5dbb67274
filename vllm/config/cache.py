"""Cache configuration: the accepted KV-cache dtype strings and the user-facing settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from vllm.v1.kv_cache_format import lookup

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
    "int8_per_token_head",
    "fp8_per_token_head",
]
"""Accepted ``kv_cache_dtype`` strings (upstream's typing name). ``auto`` means the model dtype.
The registry (:mod:`vllm.v1.kv_cache_format`) is the source of truth; a test pins this
``Literal`` equal to its user-selectable names."""

CACHE_DTYPES: tuple[str, ...] = get_args(CacheDType)

MambaCacheMode = Literal["all", "align", "none"]
"""How many Mamba states a request keeps (upstream's typing name)."""

MAMBA_CACHE_MODES: tuple[str, ...] = get_args(MambaCacheMode)


def validate_cache_dtype(cache_dtype: str, arg_name: str = "cache_dtype") -> str:
    """Return ``cache_dtype`` unchanged, or raise the registry's ``ValueError`` listing the
    accepted strings (MLA-only record layouts are not user-selectable)."""
    lookup(cache_dtype, arg_name, include_mla_only=False)
    return cache_dtype


@dataclass
class CacheConfig:
    """User-facing KV-cache settings.

    ``block_size`` is in tokens per page. ``kv_cache_dtype_skip_layers`` names layer kinds
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
        validate_cache_dtype(self.cache_dtype)
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
