"""Upstream v0.33's per-layer wiring of the runner's KV caches: each cache bound to its model
layer (:func:`bind_kv_cache_to_layers`) and each layer's slot mapping picked from its
KV-cache group's row (:func:`build_slot_mappings_by_layer`).

Slot mappings hold one slot id (``block_id * block_size + offset``, in tokens) per scheduled
token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm.utils import check_positive_int
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

__all__ = ["bind_kv_cache_to_layers", "build_slot_mappings_by_layer"]


def bind_kv_cache_to_layers(
    kv_caches: Mapping[str, Any],
    forward_context: Mapping[str, Any],
    num_attn_module: int = 1,
    kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
) -> None:
    """Give each layer of ``forward_context`` named in ``kv_caches`` its cache: through the
    layer's ``bind_kv_cache(cache)`` when it has one (a layer that unpacks its buffer into
    per-state views), else as its ``kv_cache`` attribute (what upstream's default method does).

    ``num_attn_module`` (attention modules per decoder layer) and ``kv_cache_groups`` are
    upstream's inputs for sharing ReplaySSM ring trackers among Mamba mixers of one group; the
    library ships no such mixer, so they are only checked. Every cache's layer is looked up
    before any is bound: ``ValueError`` naming the caches without a layer."""
    check_positive_int("num_attn_module", num_attn_module)
    if kv_cache_groups is not None and not all(
        hasattr(group, "layer_names") for group in kv_cache_groups
    ):
        raise TypeError(
            "kv_cache_groups: expected KV-cache groups with layer_names, got "
            f"{[type(group).__name__ for group in kv_cache_groups]}"
        )
    missing = [name for name in kv_caches if name not in forward_context]
    if missing:
        raise ValueError(
            f"kv_caches: expected a forward_context layer for every cache, got none for {missing}"
        )
    for name, cache in kv_caches.items():
        layer = forward_context[name]
        bind = getattr(layer, "bind_kv_cache", None)
        if callable(bind):
            bind(cache)
        else:
            layer.kv_cache = cache


def build_slot_mappings_by_layer(
    slot_mappings: torch.Tensor | Sequence[torch.Tensor], kv_cache_config: KVCacheConfig
) -> dict[str, torch.Tensor]:
    """Each layer's slot mapping: row ``g`` of ``slot_mappings`` (one row per KV-cache group,
    slot ids in tokens) for every layer of group ``g``. The rows are the caller's tensors, not
    copies. Rows past the last group are ignored; ``ValueError`` when a group has no row."""
    groups = kv_cache_config.kv_cache_groups
    if len(slot_mappings) < len(groups):
        raise ValueError(
            f"slot_mappings: expected a row for each of the {len(groups)} KV-cache groups, got "
            f"{len(slot_mappings)}"
        )
    return {name: slot_mappings[g] for g, group in enumerate(groups) for name in group.layer_names}
