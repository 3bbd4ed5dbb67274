"""The built-in KV cache specs: which single-type manager serves each, and which specs may
share a group (their uniform-type base). :mod:`vllm.v1.kv_cache_spec_registry` registers this
table on first use; out-of-tree specs register beside it."""

from __future__ import annotations

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
from vllm.v1.core.mamba_manager import MambaManager
from vllm.v1.core.single_type_manager_base import SingleTypeKVCacheManager
from vllm.v1.core.window_managers import CircularBufferManager, RSWAManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheGroupRole,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

__all__ = ["BUILTIN_ROLE_MANAGERS", "BUILTIN_SPECS", "HISPARSE_SPECS", "spec_manager_map"]

SpecEntry = tuple[type[SingleTypeKVCacheManager], type[KVCacheSpec]]
"""(manager, uniform-type base) of one spec class."""

BUILTIN_SPECS: dict[type[KVCacheSpec], SpecEntry] = {
    FullAttentionSpec: (FullAttentionManager, FullAttentionSpec),
    MLAAttentionSpec: (FullAttentionManager, FullAttentionSpec),
    HiddenStateCacheSpec: (FullAttentionManager, FullAttentionSpec),
    SinkFullAttentionSpec: (SinkFullAttentionManager, FullAttentionSpec),
    RSWASpec: (RSWAManager, FullAttentionSpec),
    SlidingWindowSpec: (SlidingWindowManager, SlidingWindowSpec),
    SlidingWindowMLASpec: (SlidingWindowManager, SlidingWindowMLASpec),
    ChunkedLocalAttentionSpec: (ChunkedLocalAttentionManager, ChunkedLocalAttentionSpec),
    MambaSpec: (MambaManager, MambaSpec),
    CrossAttentionSpec: (CrossAttentionManager, CrossAttentionSpec),
    CircularBufferSpec: (CircularBufferManager, CircularBufferSpec),
}

HISPARSE_SPECS: dict[type[KVCacheSpec], SpecEntry] = {
    HiSparseHotSpec: (HiSparseHotManager, HiSparseHotSpec),
    HiSparseResidentSpec: (HiSparseResidentManager, HiSparseResidentSpec),
}

BUILTIN_ROLE_MANAGERS: dict[str, type[SingleTypeKVCacheManager]] = {
    KVCacheGroupRole.HISPARSE_SOURCE: HiSparseSourceManager,
}
"""Group roles whose groups get a manager of their own, whatever their spec."""

spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    spec: manager for spec, (manager, _) in BUILTIN_SPECS.items()
}
"""v0.22's table of the built-in specs' managers (the HiSparse specs came later: registry only)."""
