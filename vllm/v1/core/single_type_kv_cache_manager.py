"""Upstream's ``vllm.v1.core.single_type_kv_cache_manager``: the per-group managers and which
one serves each KV cache spec.

The managers live in :mod:`~vllm.v1.core.single_type_manager_base` (the shared bookkeeping),
:mod:`~vllm.v1.core.attention_managers` (full, sink, cross, sliding window, chunked local),
:mod:`~vllm.v1.core.window_managers` (R-SWA, circular buffer) and
:mod:`~vllm.v1.core.mamba_manager`; this module keeps upstream's import path for all of them.
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
from vllm.v1.core.mamba_manager import MambaManager
from vllm.v1.core.single_type_manager_base import SingleTypeKVCacheManager
from vllm.v1.core.window_managers import CircularBufferManager, RSWAManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MLAAttentionSpec: FullAttentionManager,
    HiddenStateCacheSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    SlidingWindowMLASpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
    SinkFullAttentionSpec: SinkFullAttentionManager,
    RSWASpec: RSWAManager,
    CircularBufferSpec: CircularBufferManager,
}


def manager_class_of(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    # The nearest mapped class in the spec's MRO, so a subclass of a mapped spec is served by
    # its parent's manager.
    for cls in type(kv_cache_spec).__mro__:
        if cls in spec_manager_map:
            return spec_manager_map[cls]
    hint = ""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        hint = " (pass the scheduler's config: generate_scheduler_kv_cache_config)"
    names = ", ".join(sorted(t.__name__ for t in spec_manager_map))
    raise ValueError(
        f"kv_cache_spec: expected one of {names}, got {type(kv_cache_spec).__name__}{hint}"
    )


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec,
    max_in_flight_tokens: int,
    max_model_len: int,
    **kwargs: Any,
) -> SingleTypeKVCacheManager:
    """The manager of one KV cache group. Sliding-window and chunked-local groups get the
    per-request admission cap (pages) that the pool sizing assumed, from their spec and the
    tokens in flight ``max_in_flight_tokens`` / ``max_model_len`` (tokens); ``kwargs`` go to the
    manager (block_pool, enable_caching, kv_cache_group_id, ...)."""
    manager_class = manager_class_of(kv_cache_spec)
    if isinstance(kv_cache_spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
        kwargs["max_admission_blocks_per_request"] = kv_cache_spec.max_admission_blocks_per_request(
            max_num_batched_tokens=max_in_flight_tokens, max_model_len=max_model_len
        )
    return manager_class(kv_cache_spec, **kwargs)


__all__ = [
    "ChunkedLocalAttentionManager",
    "CircularBufferManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "RSWAManager",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SlidingWindowManager",
    "get_manager_for_kv_cache_spec",
    "manager_class_of",
    "spec_manager_map",
]
