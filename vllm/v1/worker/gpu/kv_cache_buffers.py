"""The raw KV-cache buffers: which layers share which ``KVCacheTensor``, the checks of a
config's tensors (coverage, sizes in whole pages), and their allocation as int8 buffers.

Units: ``size`` and ``*_bytes`` are bytes; ``num_blocks`` counts pages.
"""

from __future__ import annotations

import torch

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec, iter_layer_specs


def group_layers(kv_cache_config: KVCacheConfig) -> dict[str, int]:
    """Layer name → group index; a layer in two groups is an error."""
    owner: dict[str, int] = {}
    for group_idx, group in enumerate(kv_cache_config.kv_cache_groups):
        for layer_name in group.layer_names:
            if layer_name in owner:
                raise ValueError(
                    f"kv_cache_config: layer {layer_name!r} is in KV-cache groups "
                    f"{owner[layer_name]} and {group_idx}; a layer belongs to one group"
                )
            owner[layer_name] = group_idx
    return owner


def check_buffer_pages(
    what: str, nbytes: int, layer_name: str, spec: KVCacheSpec, num_blocks: int
) -> None:
    """A layer's buffer of ``nbytes`` holds whole pages of its spec, at least ``num_blocks``
    (the block pool hands out ids up to ``num_blocks - 1``); more whole pages are allowed, as
    upstream. ``ValueError`` naming both numbers otherwise (never a silently smaller cache)."""
    page = spec.page_size_bytes
    if nbytes < num_blocks * page:
        raise ValueError(
            f"{what}: expected {num_blocks} pages x {page} bytes = {num_blocks * page} bytes for "
            f"layer {layer_name!r}, got {nbytes}"
        )
    if nbytes % page:
        raise ValueError(
            f"{what}: expected a whole number of {page}-byte pages (at least {num_blocks}) for "
            f"layer {layer_name!r}, got {nbytes} bytes = {nbytes // page} pages + "
            f"{nbytes % page} bytes"
        )


def check_kv_cache_tensors(kv_cache_config: KVCacheConfig) -> None:
    """Every layer of every group is named by exactly one ``KVCacheTensor``, and every named
    layer belongs to a group; sizes are non-negative ints that hold ``num_blocks`` whole pages
    of every layer sharing the tensor."""
    owner = group_layers(kv_cache_config)
    named_by: dict[str, int] = {}
    for idx, tensor in enumerate(kv_cache_config.kv_cache_tensors):
        if isinstance(tensor.size, bool) or not isinstance(tensor.size, int) or tensor.size < 0:
            raise ValueError(
                f"kv_cache_tensors[{idx}].size: expected a non-negative int (bytes), "
                f"got {tensor.size!r}"
            )
        for layer_name in tensor.shared_by:
            if layer_name in named_by:
                raise ValueError(
                    f"kv_cache_config: layer {layer_name!r} is named by kv_cache_tensors"
                    f"[{named_by[layer_name]}] and kv_cache_tensors[{idx}]; each layer gets "
                    "exactly one buffer"
                )
            named_by[layer_name] = idx
    missing = [name for name in owner if name not in named_by]
    if missing:
        raise ValueError(
            f"kv_cache_config: no KVCacheTensor covers layer(s) {', '.join(missing)} "
            "(every layer of every group needs a buffer)"
        )
    unknown = [name for name in named_by if name not in owner]
    if unknown:
        raise ValueError(
            f"kv_cache_config: KVCacheTensor(s) name layer(s) {', '.join(unknown)} that are "
            "in no KV-cache group"
        )
    for layer_name, spec in iter_layer_specs(kv_cache_config):
        idx = named_by[layer_name]
        size = kv_cache_config.kv_cache_tensors[idx].size
        what = f"kv_cache_tensors[{idx}].size"
        check_buffer_pages(what, size, layer_name, spec, kv_cache_config.num_blocks)


def buffer_layers(kv_cache_config: KVCacheConfig) -> set[str]:
    """The layers that own a buffer (those some ``KVCacheTensor`` names)."""
    return {name for tensor in kv_cache_config.kv_cache_tensors for name in tensor.shared_by}


def _allocate_kv_cache(
    kv_cache_config: KVCacheConfig, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """One zeroed int8 buffer of ``size`` bytes per ``KVCacheTensor``, shared by the layers
    it names. Coverage is checked before anything is allocated. Returns layer → buffer."""
    check_kv_cache_tensors(kv_cache_config)
    raw_tensors: dict[str, torch.Tensor] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        buffer = torch.zeros(tensor.size, dtype=torch.int8, device=device)
        for layer_name in tensor.shared_by:
            raw_tensors[layer_name] = buffer
    return raw_tensors
