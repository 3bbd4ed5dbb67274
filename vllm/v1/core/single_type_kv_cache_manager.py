"""Upstream's ``vllm.v1.core.single_type_kv_cache_manager``: the per-group managers and which
one serves each KV cache spec.

The managers live in :mod:`~vllm.v1.core.single_type_manager_base` (the shared bookkeeping),
:mod:`~vllm.v1.core.attention_managers` (full, sink, cross, sliding window, chunked local),
:mod:`~vllm.v1.core.window_managers` (R-SWA, circular buffer),
:mod:`~vllm.v1.core.mamba_manager` and :mod:`~vllm.v1.core.hisparse_managers`; this module
keeps upstream's import path for all of them. Which manager serves a spec is looked up in
:class:`~vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry`, seeded with the built-in table
(:mod:`~vllm.v1.core.kv_cache_spec_table`) by :func:`register_all_kvcache_specs`.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.attention_managers import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
)
from vllm.v1.core.hisparse_managers import (
    HiSparseHotManager,
    HiSparseResidentManager,
    HiSparseSourceManager,
)
from vllm.v1.core.kv_cache_spec_table import spec_manager_map
from vllm.v1.core.mamba_manager import MambaManager
from vllm.v1.core.single_type_manager_base import SingleTypeKVCacheManager
from vllm.v1.core.window_managers import CircularBufferManager, RSWAManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    HiSparseResidentSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry, register_all_kvcache_specs


def manager_class_of(
    kv_cache_spec: KVCacheSpec, role: str | None = None
) -> type[SingleTypeKVCacheManager]:
    """The manager class of a group with ``kv_cache_spec`` and ``role`` (the registry's
    answer; a subclass of a registered spec gets its parent's manager)."""
    manager_class = KVCacheSpecRegistry.get_manager_class(kv_cache_spec, role)
    if manager_class is not None:
        return manager_class
    hint = ""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        hint = " (pass the scheduler's config: generate_scheduler_kv_cache_config)"
    names = ", ".join(sorted(t.__name__ for t in KVCacheSpecRegistry.registered_spec_classes()))
    raise ValueError(
        f"kv_cache_spec: expected one of {names} (or a subclass, or a spec registered with "
        f"@register_kv_cache_spec), got {type(kv_cache_spec).__name__}{hint}"
    )


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec,
    max_in_flight_tokens: int,
    max_model_len: int,
    role: str | None = None,
    **kwargs: Any,
) -> SingleTypeKVCacheManager:
    """The manager of one KV cache group (``role``: the group's ``KVCacheGroupRole``, which
    may pick a manager of its own). Sliding-window, chunked-local and HiSparse resident
    groups get the per-request admission cap (pages) that the pool sizing assumed, from their
    spec and the tokens in flight ``max_in_flight_tokens`` / ``max_model_len`` (tokens);
    ``kwargs`` go to the manager (block_pool, enable_caching, kv_cache_group_id, ...)."""
    manager_class = manager_class_of(kv_cache_spec, role)
    if isinstance(
        kv_cache_spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec, HiSparseResidentSpec)
    ):
        kwargs["max_admission_blocks_per_request"] = kv_cache_spec.max_admission_blocks_per_request(
            max_in_flight_tokens=max_in_flight_tokens, max_model_len=max_model_len
        )
    return manager_class(kv_cache_spec, **kwargs)


__all__ = [
    "ChunkedLocalAttentionManager",
    "CircularBufferManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "HiSparseHotManager",
    "HiSparseResidentManager",
    "HiSparseSourceManager",
    "MambaManager",
    "RSWAManager",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SlidingWindowManager",
    "get_manager_for_kv_cache_spec",
    "manager_class_of",
    "register_all_kvcache_specs",
    "spec_manager_map",
]
