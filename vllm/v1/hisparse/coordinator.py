"""HiSparse's scheduler-side coordinator lookup (upstream's
``vllm.v1.hisparse.coordinator``)."""

from __future__ import annotations

from typing import Any


def get_hisparse_coordinator(kv_cache_manager: Any) -> Any:
    """The coordinator that the HiSparse groups of ``kv_cache_manager`` (a ``KVCacheManager``)
    share: the one bound to the first of its per-group managers that has one. ``ValueError``
    when none has: the library's block manager does not bind HiSparse's host tier yet, so only
    a manager whose groups were given a coordinator answers."""
    for manager in kv_cache_manager.coordinator.single_type_managers:
        coordinator = getattr(manager, "coordinator", None)
        if coordinator is not None:
            return coordinator
    raise ValueError(
        "kv_cache_manager: expected a KV cache manager with a HiSparse cache group, got one without"
    )
