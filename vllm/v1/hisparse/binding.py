"""Worker side of HiSparse: the specs a worker reports, the caches it allocates (the source
caches in the host pool, everything else in the shared device backing) and their binding to
the attention layers' HiSparse cache handles.

A handle (``layer.hisparse_cache`` of a sparse-MLA layer in the forward context) is what the
layer's runtime reads: ``bind_cache(...)`` binds its resident cache, ``runtime.bind_hot_cache``
/ ``runtime.bind_source_cache`` its hot and host caches. Units: sizes, offsets and strides in
bytes, block sizes in tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from vllm.v1.hisparse.layout import (
    HISPARSE_HOT_SUFFIX,
    HISPARSE_RESIDENT_SUFFIX,
    get_hisparse_kv_cache_groups,
)
from vllm.v1.hisparse.runtime import (
    HiSparseHostPool,
    drop_hisparse_host_pool,
    get_hisparse_host_pool,
    initialize_hisparse_runtime_buffers,
    release_pinned_state,
)
from vllm.v1.kv_cache_interface import (
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheLayout,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
    create_kv_cache_views,
)
from vllm.v1.worker.gpu.attn_groups import select_common_block_size
from vllm.v1.worker.utils import allocate_kv_cache

__all__ = [
    "allocate_hisparse_kv_caches",
    "bind_hisparse_kv_caches",
    "get_hisparse_host_pool",
    "init_hisparse_kv_cache",
    "release_hisparse_profiling_cache",
    "resolve_hisparse_specs",
]


def resolve_hisparse_specs(
    vllm_config: Any, kv_cache_spec: dict[str, KVCacheSpec], attn_layers: Mapping[str, Any]
) -> dict[str, KVCacheSpec]:
    """``kv_cache_spec`` with every MLA spec at the one block size all sparse-attention and
    indexer backends take (the scheduler's, or its largest divisor they share), plus the
    resident and hot specs HiSparse derives from them. Other specs are unchanged.
    ``ValueError`` when the MLA specs' block sizes differ or no common size exists."""
    mla = {n: s for n, s in kv_cache_spec.items() if isinstance(s, MLAAttentionSpec)}
    if not mla:
        return kv_cache_spec
    block_sizes = sorted({s.block_size for s in mla.values()})
    if len(block_sizes) != 1:
        raise ValueError(
            f"kv_cache_spec: HiSparse needs one scheduler block size for its MLA layers, got "
            f"{block_sizes}"
        )
    backends = [attn_layers[name].get_attn_backend() for name in mla]
    try:
        block_size = select_common_block_size(block_sizes[0], backends, list(mla.values()))
    except ValueError as error:
        raise ValueError(
            "kv_cache_spec: HiSparse needs a block size supported by every sparse attention "
            f"and indexer backend: {error}"
        ) from error
    resolved = {n: s.copy_with_new_block_size(block_size) for n, s in mla.items()}
    groups = get_hisparse_kv_cache_groups(vllm_config, dict[str, KVCacheSpec](resolved)) or []
    derived = {
        name: group.kv_cache_spec
        for group in groups
        if isinstance(group.kv_cache_spec, (HiSparseResidentSpec, HiSparseHotSpec))
        for name in group.layer_names
    }
    return {**kv_cache_spec, **resolved, **derived}


def allocate_hisparse_kv_caches(
    kv_cache_config: KVCacheConfig,
    device: torch.device | str,
    layout: KVCacheLayout,
    kernel_block_sizes: list[int],
    host_pool: HiSparseHostPool,
) -> dict[str, torch.Tensor]:
    """Every layer's cache: device tensors as :func:`allocate_kv_cache` lays them out (specs
    without views get the raw shared backing), host-resident tensors as views of
    ``host_pool``'s one backing (``ValueError`` unless they all have one size)."""
    host = [t for t in kv_cache_config.kv_cache_tensors if t.host_resident]
    sizes = sorted({t.size for t in host})
    if len(sizes) != 1:
        raise ValueError(
            f"kv_cache_config: expected host-resident tensors of one size, got sizes {sizes}"
        )
    (host_group,) = kv_cache_config.host_group_ids
    # The device allocation sees neither the host group nor its tensors; the per-group kernel
    # block sizes follow the groups it keeps.
    kept = [i for i in range(len(kv_cache_config.kv_cache_groups)) if i != host_group]
    device_config = dataclasses.replace(
        kv_cache_config,
        kv_cache_tensors=[t for t in kv_cache_config.kv_cache_tensors if not t.host_resident],
        kv_cache_groups=[kv_cache_config.kv_cache_groups[i] for i in kept],
    )
    device_kernels = [kernel_block_sizes[i] for i in kept if i < len(kernel_block_sizes)]
    kv_caches = allocate_kv_cache(device_config, device, layout, device_kernels)
    backing = host_pool.allocate(sizes[0])
    host_spec = kv_cache_config.kv_cache_groups[host_group].kv_cache_spec
    for tensor in host:
        spec = (
            host_spec.kv_cache_specs[tensor.layers[0]]
            if isinstance(host_spec, UniformTypeKVCacheSpecs)
            else host_spec
        )
        views = create_kv_cache_views(
            backing,
            spec,
            kv_cache_config.num_blocks_of(tensor),
            layout,
            tensor,
            kernel_block_sizes[host_group],
        )
        kv_caches.update(zip(tensor.layers, views, strict=True))
    return kv_caches


def init_hisparse_kv_cache(
    kv_cache_config: KVCacheConfig,
    device: torch.device | str,
    kernel_block_sizes: list[int],
    vllm_config: Any,
    forward_context: dict[str, Any],
    block_tables: Any,
) -> dict[str, torch.Tensor]:
    """Allocate the caches, bind them to the layers' handles and give the runtimes their
    shared buffers. On any failure the host pool's registration (or shared region) is
    released and the pool forgotten before the error propagates."""
    host_pool = get_hisparse_host_pool(vllm_config, kv_cache_config)
    try:
        kv_caches = allocate_hisparse_kv_caches(
            kv_cache_config,
            device,
            vllm_config.cache_config.get_resolved_kv_cache_layout(),
            kernel_block_sizes,
            host_pool,
        )
        handles = bind_hisparse_kv_caches(
            forward_context=forward_context,
            kv_cache_config=kv_cache_config,
            kv_caches=kv_caches,
            block_tables=block_tables,
            host_pool=host_pool,
        )
        initialize_hisparse_runtime_buffers(
            handles, max_num_reqs=vllm_config.scheduler_config.max_num_seqs
        )
    except Exception:
        if host_pool.shared_region is not None:
            host_pool.shared_region.cleanup()
        elif host_pool.registered is not None:
            release_pinned_state([], [host_pool.registered])
        drop_hisparse_host_pool(vllm_config)
        raise
    return kv_caches


def release_hisparse_profiling_cache(forward_context: dict[str, Any]) -> None:
    """Detach the profiling run's caches from the runtimes (each once), keeping the host pool
    registered for the real KV cache."""
    runtimes = {
        id(handle.runtime): handle.runtime
        for layer in forward_context.values()
        if (handle := getattr(layer, "hisparse_cache", None)) is not None
        and hasattr(handle.runtime, "_host_cache")
    }
    release_pinned_state(list(runtimes.values()), [])


def _handle(forward_context: dict[str, Any], layer_name: str) -> Any:
    handle = getattr(forward_context[layer_name], "hisparse_cache", None)
    if handle is None:
        raise ValueError(f"forward_context[{layer_name!r}]: expected a HiSparse layer, got none")
    return handle


def _base_layer(cache_name: str, suffix: str) -> str:
    if not cache_name.endswith(suffix):
        raise ValueError(
            f"kv_cache_config: expected a layer name ending {suffix}, got {cache_name!r}"
        )
    return cache_name[: -len(suffix)]


def _device_placement(
    placements: dict[str, tuple[KVCacheTensor, int]], name: str
) -> tuple[KVCacheTensor, int]:
    tensor, offset = placements[name]
    if tensor.host_resident or tensor.block_stride is None:
        raise ValueError(
            f"kv_cache_config: expected a strided device tensor for {name!r}, got "
            f"host_resident={tensor.host_resident}, block_stride={tensor.block_stride}"
        )
    return tensor, offset


def bind_hisparse_kv_caches(
    *,
    forward_context: dict[str, Any],
    kv_cache_config: KVCacheConfig,
    kv_caches: dict[str, torch.Tensor],
    block_tables: Any,
    host_pool: HiSparseHostPool,
) -> list[Any]:
    """Bind the allocated storage and the block tables (``block_tables.input_block_tables`` /
    ``slot_mappings``, one per group) to each sparse layer's handle; return the handles
    bound. Resident caches are replaced in ``kv_caches`` by their bound views; hot caches
    (the runtimes' raw slabs, which must share one device backing and match the resident
    layout) are removed. ``RuntimeError`` on a layout mismatch or when nothing is bound."""
    if host_pool.registered is None:
        raise ValueError("host_pool: expected an allocated host pool, got none")
    placements = {
        name: (tensor, tensor.offset + i * tensor.layer_stride)
        for tensor in kv_cache_config.kv_cache_tensors
        for i, name in enumerate(tensor.layers)
    }
    _bind_resident(forward_context, kv_cache_config, kv_caches, block_tables, placements)
    handles = _bind_hot_and_source(
        forward_context, kv_cache_config, kv_caches, block_tables, host_pool, placements
    )
    (source_gid,) = kv_cache_config.host_group_ids
    for handle in handles:
        handle.source_block_table = block_tables.input_block_tables[source_gid]
        handle.mirror_slot_mapping = block_tables.slot_mappings[source_gid]
    return handles


def _bind_resident(
    forward_context: dict[str, Any],
    kv_cache_config: KVCacheConfig,
    kv_caches: dict[str, torch.Tensor],
    block_tables: Any,
    placements: dict[str, tuple[KVCacheTensor, int]],
) -> None:
    resident = [
        (gid, g)
        for gid, g in enumerate(kv_cache_config.kv_cache_groups)
        if isinstance(g.kv_cache_spec, HiSparseResidentSpec)
    ]
    if not resident:
        return
    shapes = {tuple(block_tables.input_block_tables[gid].shape) for gid, _ in resident}
    if len(shapes) != 1:
        raise ValueError(f"block_tables: expected one shape for the resident groups, got {shapes}")
    # The runtimes track which pages are resident in their own tables, one per group.
    residency = torch.zeros(
        (len(resident), *shapes.pop()),
        dtype=torch.int32,
        device=block_tables.input_block_tables[resident[0][0]].device,
    )
    for index, (gid, group) in enumerate(resident):
        for cache_name in group.layer_names:
            handle = _handle(forward_context, _base_layer(cache_name, HISPARSE_RESIDENT_SUFFIX))
            tensor, offset = _device_placement(placements, cache_name)
            handle.bind_cache(
                kv_caches[cache_name],
                byte_offset=offset,
                block_stride=tensor.block_stride,
                num_blocks=kv_cache_config.num_blocks,
                block_size=group.kv_cache_spec.block_size,
                block_table=residency[index],
                slot_mapping=block_tables.slot_mappings[gid],
            )
            handle.residency = residency
            kv_caches[cache_name] = handle.view.cache
            handle.runtime.resident_source_index = index


def _bind_hot_and_source(
    forward_context: dict[str, Any],
    kv_cache_config: KVCacheConfig,
    kv_caches: dict[str, torch.Tensor],
    block_tables: Any,
    host_pool: HiSparseHostPool,
    placements: dict[str, tuple[KVCacheTensor, int]],
) -> list[Any]:
    assert host_pool.registered is not None  # checked by the caller
    host_storage = host_pool.registered.untyped_storage().data_ptr()
    hot_storage: int | None = None
    handles: list[Any] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, HiSparseHotSpec):
            continue
        for cache_name in group.layer_names:
            layer_name = _base_layer(cache_name, HISPARSE_HOT_SUFFIX)
            raw = kv_caches[cache_name]
            storage = raw.untyped_storage().data_ptr()
            if hot_storage is None:
                hot_storage = storage
            elif storage != hot_storage:
                raise RuntimeError("kv_caches: HiSparse hot caches must share one device backing")
            handle = _handle(forward_context, layer_name)
            tensor, offset = _device_placement(placements, cache_name)
            handle.runtime.bind_hot_cache(
                raw,
                byte_offset=offset,
                block_stride=tensor.block_stride,
                num_blocks=kv_cache_config.num_blocks,
                block_size=group.kv_cache_spec.block_size,
                block_table=block_tables.input_block_tables[gid],
            )
            resident, hot = handle.view, handle.runtime.hot
            if resident is None or (
                resident.cache.data_ptr() != hot.cache.data_ptr()
                or resident.cache.stride() != hot.cache.stride()
            ):
                raise RuntimeError(
                    f"kv_caches: {layer_name!r}'s HiSparse resident and hot caches must have "
                    "one layout"
                )
            source = kv_caches[layer_name]
            if source.untyped_storage().data_ptr() != host_storage:
                raise RuntimeError(
                    f"kv_caches: {layer_name!r}'s source cache is not in the host pool"
                )
            handle.draft_layer = forward_context[layer_name].is_draft_layer
            handle.runtime.shared_host_region = host_pool.shared_region
            handle.runtime.bind_source_cache(source, registered_host_pool=host_pool.registered)
            handles.append(handle)
            # The runtime owns the hot slab; no layer binds or registers it.
            del kv_caches[cache_name]
    if not handles:
        raise RuntimeError("kv_cache_config: HiSparse found no hot caches to bind")
    return handles
