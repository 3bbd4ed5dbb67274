"""What an offloading backend is told about the engine (upstream v0.33's
``vllm.v1.kv_offload.config``): the cache groups, the bytes of a block, the model, the hashing
and chunking of the cache, and the parallel layout, normalized once so that a backend never
reads the engine's whole config.

Each record is a frozen dataclass that checks its fields when built (``ValueError`` naming
the field: ``<field>: expected X, got Y``), so a backend can trust them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _int_at_least(name: str, value: Any, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        expected = "a positive int" if lowest == 1 else f"an int >= {lowest}"
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class OffloadingGroupConfig:
    """One KV cache group as the offloaded cache sees it."""

    tokens_per_block: int
    """Tokens one block covers across all workers (context parallelism included)."""
    layer_names: tuple[str, ...]
    """The group's layers."""
    group_id: int
    """The group's index in the engine's ``KVCacheConfig``."""
    sliding_window_size_in_chunks: int | None = None
    """Chunks of this group a request keeps offloaded; None when attention reads back without a
    bound (full attention)."""

    def __post_init__(self) -> None:
        _int_at_least("tokens_per_block", self.tokens_per_block, 1)
        if not isinstance(self.layer_names, tuple) or not all(
            isinstance(name, str) for name in self.layer_names
        ):
            raise ValueError(f"layer_names: expected a tuple of str, got {self.layer_names!r}")
        _int_at_least("group_id", self.group_id, 0)
        if self.sliding_window_size_in_chunks is not None:
            _int_at_least("sliding_window_size_in_chunks", self.sliding_window_size_in_chunks, 1)


@dataclass(frozen=True)
class OffloadingModelConfig:
    """The model whose K/V are offloaded."""

    name: str
    """Model identifier (a Hugging Face path, say)."""
    dtype: str
    """KV cache dtype name (``"float16"``, ``"fp8"``, ...)."""
    max_model_len: int = 0
    """Longest request the engine accepts, in tokens; 0 when unknown."""

    def __post_init__(self) -> None:
        for name in ("name", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}: expected a non-empty str, got {value!r}")
        _int_at_least("max_model_len", self.max_model_len, 0)


@dataclass(frozen=True)
class OffloadingCacheConfig:
    """How the device cache is hashed and how offloaded blocks are grouped."""

    tokens_per_hash: int
    """Tokens per block hash."""
    blocks_per_chunk: int
    """Device blocks that make one offloaded chunk."""

    def __post_init__(self) -> None:
        _int_at_least("tokens_per_hash", self.tokens_per_hash, 1)
        _int_at_least("blocks_per_chunk", self.blocks_per_chunk, 1)


@dataclass(frozen=True)
class OffloadingParallelConfig:
    """Where this process sits in the engine's parallel layout."""

    rank: int
    """This worker's global index; 0 on the scheduler's side. Not bounded by ``world_size``:
    a worker of a larger deployment may be described with a partial layout (names stay
    rank-specific)."""
    world_size: int
    """Workers of the engine."""
    tp_size: int
    pp_size: int
    pcp_size: int
    """Prefill context parallel size."""
    dcp_size: int
    """Decode context parallel size."""
    data_parallel_index: int
    """This engine's data-parallel replica."""
    data_parallel_size: int
    data_parallel_rank_local: int | None
    """Local rank in the data-parallel group (SPMD mode only)."""
    is_parallelism_agnostic: bool
    """True when a block's offloaded bytes do not depend on the parallel layout (all workers'
    bytes concatenated in rank order, or a canonical page), so other layouts may read them."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "pcp_size", "dcp_size"):
            _int_at_least(name, getattr(self, name), 1)
        _int_at_least("data_parallel_size", self.data_parallel_size, 1)
        _int_at_least("rank", self.rank, 0)
        _int_at_least("data_parallel_index", self.data_parallel_index, 0)
        if self.data_parallel_index >= self.data_parallel_size:
            raise ValueError(
                "data_parallel_index: expected a replica index below "
                f"data_parallel_size={self.data_parallel_size}, got {self.data_parallel_index}"
            )
        if self.data_parallel_rank_local is not None:
            _int_at_least("data_parallel_rank_local", self.data_parallel_rank_local, 0)
        if not isinstance(self.is_parallelism_agnostic, bool):
            raise ValueError(
                f"is_parallelism_agnostic: expected a bool, got {self.is_parallelism_agnostic!r}"
            )


@dataclass(frozen=True)
class OffloadingConfig:
    """Everything an offloading backend reads about the engine."""

    groups: tuple[OffloadingGroupConfig, ...]
    worker_kv_bytes_per_block: int
    """Bytes of one block that one worker stores; 0 for a worker with no KV cache."""
    enable_kv_cache_events: bool
    """The scheduler emits KV events, so the backend should emit its own too."""
    extra_config: Mapping[str, Any]
    """The offloading options of ``kv_connector_extra_config``."""
    engine_id: str
    """This engine's identity, distinct per data-parallel replica."""
    model: OffloadingModelConfig
    cache: OffloadingCacheConfig
    parallel: OffloadingParallelConfig
    replicated_layout: bool = False
    """Every worker offloads the same bytes per block (a pure-MLA model, tensor parallelism on
    one node): backends may keep one copy."""
    canonical_layout: bool = False
    """The canonical per-layer host layout was asked for (``kv_connector_extra_config``)."""
    kv_cache_layout: str | None = None
    """The workers' resolved cache layout name (``"NHD"`` / ``"HND"``), when known."""

    def __post_init__(self) -> None:
        if not isinstance(self.groups, tuple) or not all(
            isinstance(group, OffloadingGroupConfig) for group in self.groups
        ):
            raise ValueError(
                f"groups: expected a tuple of OffloadingGroupConfig, got {self.groups!r}"
            )
        _int_at_least("worker_kv_bytes_per_block", self.worker_kv_bytes_per_block, 0)
        if not isinstance(self.extra_config, Mapping):
            raise ValueError(f"extra_config: expected a mapping, got {self.extra_config!r}")
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(f"engine_id: expected a non-empty str, got {self.engine_id!r}")
        for name, cls in (
            ("model", OffloadingModelConfig),
            ("cache", OffloadingCacheConfig),
            ("parallel", OffloadingParallelConfig),
        ):
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise ValueError(f"{name}: expected an {cls.__name__}, got {value!r}")
        if self.kv_cache_layout is not None and not isinstance(self.kv_cache_layout, str):
            raise ValueError(
                f"kv_cache_layout: expected None or a layout name, got {self.kv_cache_layout!r}"
            )
