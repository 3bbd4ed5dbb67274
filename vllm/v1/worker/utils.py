"""Cross-layer KV sharing (upstream's ``vllm.v1.worker.utils`` names): layers that attend with
another layer's keys and values (a model's ``kv_sharing_target_layer_name``) own no cache.

``shared_kv_cache_layers`` maps each such layer to its target. The planner gives sharing layers
no spec and no buffer; :func:`add_kv_sharing_layers_to_kv_cache_groups` then lists each in its
target's group (so that it gets the group's block table and metadata), and
:func:`vllm.v1.worker.gpu.attn_utils.init_kv_cache` hands it the target's cache, the same
tensor: the pages are counted and allocated once.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm.v1.kv_cache_interface import KVCacheGroupSpec


def check_kv_sharing(shared_kv_cache_layers: Mapping[str, str], owners: set[str]) -> None:
    """``ValueError`` unless every target is one of ``owners`` (the layers that own a cache)
    and no sharing layer owns one itself (its pages would be counted twice)."""
    for layer, target in shared_kv_cache_layers.items():
        if layer in owners:
            raise ValueError(
                f"shared_kv_cache_layers[{layer!r}]: expected a layer without a cache of its own "
                f"(it reads {target!r}'s), got a layer that has one"
            )
        if target not in owners:
            raise ValueError(
                f"shared_kv_cache_layers[{layer!r}]: expected a target layer that owns a cache, "
                f"got {target!r}"
            )


def add_kv_sharing_layers_to_kv_cache_groups(
    shared_kv_cache_layers: dict[str, str],
    kv_cache_groups: list[KVCacheGroupSpec],
    runner_only_attn_layers: set[str] | None = None,
) -> None:
    """Append each sharing layer to its target's group's ``layer_names`` (in place), and to
    ``runner_only_attn_layers`` when given. Targets must be in a group and sharing layers in
    none; both are checked before any group changes."""
    if not shared_kv_cache_layers:
        return
    group_of = {name: group for group in kv_cache_groups for name in group.layer_names}
    check_kv_sharing(shared_kv_cache_layers, set(group_of))
    for layer, target in shared_kv_cache_layers.items():
        group_of[target].layer_names.append(layer)
        if runner_only_attn_layers is not None:
            runner_only_attn_layers.add(layer)
