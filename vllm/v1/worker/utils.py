"""Upstream's ``vllm.v1.worker.utils`` names: the KV cache's allocation as ``[B, H, N, C]``
views (:func:`allocate_kv_cache`), the block manager's page copies
(:func:`copy_kv_cache_blocks_inplace`) and cross-layer KV sharing: layers that attend with
another layer's keys and values (a model's ``kv_sharing_target_layer_name``) own no cache.

``shared_kv_cache_layers`` maps each such layer to its target. The planner gives sharing layers
no spec and no buffer; :func:`add_kv_sharing_layers_to_kv_cache_groups` then lists each in its
target's group (so that it gets the group's block table and metadata), and
:func:`vllm.v1.worker.gpu.attn_utils.init_kv_cache` hands it the target's cache, the same
tensor: the pages are counted and allocated once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from vllm.utils import check_positive_int
from vllm.v1.core.kv_cache_block import KVCacheBlockCopy
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    create_kv_cache_views,
    iter_layer_specs,
)
from vllm.v1.worker.gpu.attn_groups import (
    AttentionGroup,
    customize_attention_spec,
    map_kv_caches_to_kernel_blocks,
    prepare_kernel_block_sizes,
    select_common_block_size,
)
from vllm.v1.worker.gpu.kv_binding import bind_kv_cache_to_layers
from vllm.v1.worker.gpu.kv_cache_buffers import allocate_tensor_backings, group_layers

__all__ = [
    "AttentionGroup",
    "add_kv_sharing_layers_to_kv_cache_groups",
    "allocate_kv_cache",
    "bind_kv_cache_to_layers",
    "check_kv_sharing",
    "copy_kv_cache_blocks_inplace",
    "customize_attention_spec",
    "map_kv_caches_to_kernel_blocks",
    "prepare_kernel_block_sizes",
    "select_common_block_size",
]


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


def allocate_kv_cache(
    kv_cache_config: KVCacheConfig,
    device: torch.device | str,
    layout: KVCacheLayout,
    kernel_block_sizes: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Allocate the cache and view each layer's pages as ``[B, H, N, C]`` under ``layout``
    (``C`` in the spec's dtype; B in kernel blocks of ``kernel_block_sizes[group]`` tokens
    when given). Strided tensors overlay one zeroed backing per pool (layer ``l``'s block
    ``b`` at ``offset + l * layer_stride + b * block_stride`` bytes), so groups may address
    the same bytes; a v0.22 aliasing tensor (``block_stride`` None) is a buffer of its own,
    its layers' pages back to back from byte 0. A layer whose spec has no layer views gets
    its tensor's whole backing. Everything is checked before allocating."""
    backings = allocate_tensor_backings(kv_cache_config, device)
    group_of = group_layers(kv_cache_config)
    specs = dict(iter_layer_specs(kv_cache_config))
    kv_caches: dict[str, torch.Tensor] = {}
    for tensor, backing in zip(kv_cache_config.kv_cache_tensors, backings, strict=True):
        if not tensor.layers:
            continue
        spec = specs[tensor.layers[0]]
        if not spec.has_layer_views:
            kv_caches.update((name, backing) for name in tensor.layers)
            continue
        group = group_of[tensor.layers[0]]
        kernel = None
        if kernel_block_sizes is not None and group < len(kernel_block_sizes):
            kernel = kernel_block_sizes[group]
        num_blocks = kv_cache_config.num_blocks_of(tensor)
        placed = (
            [tensor]
            if tensor.block_stride is not None
            else [
                KVCacheTensor(
                    size=tensor.size,
                    layers=[name],
                    block_stride=specs[name].page_size_bytes,
                    host_resident=tensor.host_resident,
                )
                for name in tensor.layers
            ]
        )
        for part in placed:
            views = create_kv_cache_views(
                backing, specs[part.layers[0]], num_blocks, layout, part, kernel
            )
            kv_caches.update(zip(part.layers, views, strict=True))
    return kv_caches


def copy_kv_cache_blocks_inplace(
    kv_caches: Iterable[torch.Tensor],
    num_blocks: int,
    kv_cache_block_copies: Sequence[KVCacheBlockCopy],
) -> None:
    """Run the block manager's page copies (``KVCacheManager.take_kv_cache_block_copies``:
    copy-on-write of a partly hit page) before the step's forward pass: page ``dst_block_id``
    of every cache gets page ``src_block_id``'s bytes (scales and sink rows included: a page
    holds all of them). ``num_blocks``: the scheduler's blocks; a cache's first dimension may
    count kernel blocks, a whole multiple of them. Layers sharing one view (KV sharing) are
    copied once. Every id is checked before anything is written."""
    if not kv_cache_block_copies:
        return
    num_blocks = check_positive_int("num_blocks", num_blocks)
    caches = list(kv_caches)
    for i, (src, dst) in enumerate(kv_cache_block_copies):
        if not (0 <= src < num_blocks and 0 <= dst < num_blocks) or src == dst:
            raise ValueError(
                f"kv_cache_block_copies[{i}]: expected two different block ids in "
                f"[0, {num_blocks}), got {src} -> {dst}"
            )
    for name, cache in enumerate(caches):
        if cache.dim() == 0 or cache.shape[0] % num_blocks:
            raise ValueError(
                f"kv_caches[{name}]: expected a first dimension that is a multiple of "
                f"num_blocks={num_blocks}, got shape {list(cache.shape)}"
            )
    pairs = torch.tensor(kv_cache_block_copies, dtype=torch.int64)
    seen: set[tuple[torch.device, int, tuple[int, ...]]] = set()
    for cache in caches:
        key = (cache.device, cache.data_ptr(), tuple(cache.shape))
        if key in seen:
            continue
        seen.add(key)
        src, dst = pairs.to(cache.device).unbind(dim=1)
        blocks = cache.unflatten(0, (num_blocks, cache.shape[0] // num_blocks))
        blocks[dst] = blocks[src]
