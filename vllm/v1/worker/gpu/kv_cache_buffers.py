"""The raw KV-cache buffers: which layers share which ``KVCacheTensor``, the checks of a
config's tensors (coverage, sizes in whole pages, strides that keep pages inside their
backing), and their allocation as int8 buffers.

Two tensor forms (:class:`~vllm.v1.kv_cache_interface.KVCacheTensor`):

- v0.22's aliasing form (``block_stride is None``): one buffer of ``size`` bytes per tensor,
  every layer it names using all of it (pages ``size // num_blocks`` apart in effect, pages
  of ``page_size_bytes`` back to back);
- upstream v0.33's strided form: layer ``layers[l]``'s page of block ``b`` starts at
  ``offset + l * layer_stride + b * block_stride`` in one backing allocation that every
  device tensor shares (groups overlay each other: a block id belongs to one group at a
  time), host-resident tensors in one host backing (HiSparse's pool, ``num_blocks`` from
  :meth:`~vllm.v1.kv_cache_interface.KVCacheConfig.num_blocks_of`).

Units: ``size``, strides, offsets and ``*_bytes`` are bytes; ``num_blocks`` counts pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec, KVCacheTensor, iter_layer_specs


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer's pages sit: its tensor, index in it, first page (bytes from the start
    of the tensor's backing), page spacing (bytes) and page count."""

    tensor_index: int
    tensor: KVCacheTensor
    start_bytes: int
    block_stride_bytes: int | None
    num_blocks: int


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


def layer_placements(kv_cache_config: KVCacheConfig) -> dict[str, LayerPlacement]:
    """Layer name → its placement (``block_stride_bytes`` None for the aliasing form, whose
    buffer is the layer's own: pages back to back from byte 0)."""
    placements: dict[str, LayerPlacement] = {}
    for idx, tensor in enumerate(kv_cache_config.kv_cache_tensors):
        for position, layer_name in enumerate(tensor.layers):
            strided = tensor.block_stride is not None
            placements[layer_name] = LayerPlacement(
                tensor_index=idx,
                tensor=tensor,
                start_bytes=tensor.offset + position * tensor.layer_stride if strided else 0,
                block_stride_bytes=tensor.block_stride,
                num_blocks=kv_cache_config.num_blocks_of(tensor),
            )
    return placements


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


def check_strided_pages(
    what: str, nbytes: int, layer_name: str, spec: KVCacheSpec, placement: LayerPlacement
) -> None:
    """A strided layer's ``num_blocks`` pages, ``block_stride_bytes`` apart from
    ``start_bytes``, lie inside a backing of ``nbytes`` and do not overlap each other;
    ``ValueError`` naming the numbers otherwise."""
    page = spec.page_size_bytes
    stride = placement.block_stride_bytes
    assert stride is not None  # only strided placements are checked here
    if stride < page:
        raise ValueError(
            f"{what}.block_stride: expected at least the {page}-byte page of layer "
            f"{layer_name!r}, got {stride}"
        )
    end = placement.start_bytes + (placement.num_blocks - 1) * stride + page
    if placement.start_bytes < 0 or end > nbytes:
        raise ValueError(
            f"{what}: expected layer {layer_name!r}'s {placement.num_blocks} pages (bytes "
            f"{placement.start_bytes} to {end}) inside the {nbytes}-byte backing, got them "
            "outside"
        )


def _check_strided_tensor(idx: int, tensor: KVCacheTensor, page: int) -> None:
    for name in ("layer_stride", "offset"):
        value = getattr(tensor, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"kv_cache_tensors[{idx}].{name}: expected a non-negative int (bytes), "
                f"got {value!r}"
            )
    stride = tensor.block_stride
    if isinstance(stride, bool) or not isinstance(stride, int) or stride <= 0:
        raise ValueError(
            f"kv_cache_tensors[{idx}].block_stride: expected a positive int (bytes), got {stride!r}"
        )
    if len(tensor.layers) > 1 and tensor.layer_stride < page:
        raise ValueError(
            f"kv_cache_tensors[{idx}].layer_stride: expected at least the {page}-byte page so "
            f"that its {len(tensor.layers)} layers' pages do not overlap, got {tensor.layer_stride}"
        )


def check_kv_cache_tensors(kv_cache_config: KVCacheConfig) -> None:
    """Every layer of every group is named by exactly one ``KVCacheTensor``, and every named
    layer belongs to a group; sizes are non-negative ints; an aliasing tensor holds
    ``num_blocks`` whole pages of every layer sharing it; a strided tensor's layers' pages lie
    inside its backing without overlapping, and strided tensors of one pool (device, host)
    name one backing size."""
    owner = group_layers(kv_cache_config)
    named_by: dict[str, int] = {}
    for idx, tensor in enumerate(kv_cache_config.kv_cache_tensors):
        if isinstance(tensor.size, bool) or not isinstance(tensor.size, int) or tensor.size < 0:
            raise ValueError(
                f"kv_cache_tensors[{idx}].size: expected a non-negative int (bytes), "
                f"got {tensor.size!r}"
            )
        for layer_name in tensor.layers:
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
    _backing_sizes(kv_cache_config)
    placements = layer_placements(kv_cache_config)
    for layer_name, spec in iter_layer_specs(kv_cache_config):
        placement = placements[layer_name]
        idx, tensor = placement.tensor_index, placement.tensor
        what = f"kv_cache_tensors[{idx}]"
        if tensor.block_stride is None:
            check_buffer_pages(f"{what}.size", tensor.size, layer_name, spec, placement.num_blocks)
        else:
            _check_strided_tensor(idx, tensor, spec.page_size_bytes)
            check_strided_pages(what, tensor.size, layer_name, spec, placement)


def _backing_sizes(kv_cache_config: KVCacheConfig) -> dict[bool, int]:
    """Backing bytes of the strided tensors by ``host_resident``; ``ValueError`` when the
    tensors of one pool name different sizes (they overlay one allocation)."""
    sizes: dict[bool, set[int]] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        if tensor.block_stride is not None:
            sizes.setdefault(tensor.host_resident, set()).add(tensor.size)
    for host, found in sizes.items():
        if len(found) > 1:
            pool = "host" if host else "device"
            raise ValueError(
                f"kv_cache_tensors: expected the strided {pool} tensors to share one backing "
                f"size (bytes), got {sorted(found)}"
            )
    return {host: found.pop() for host, found in sizes.items()}


def buffer_layers(kv_cache_config: KVCacheConfig) -> set[str]:
    """The layers that own a buffer (those some ``KVCacheTensor`` names)."""
    return {name for tensor in kv_cache_config.kv_cache_tensors for name in tensor.layers}


def _zeros(num_bytes: int, device: torch.device | str, host: bool) -> torch.Tensor:
    """A zeroed int8 buffer: on ``device``, or in host memory (pinned when a CUDA device
    reads it) for a host-resident pool."""
    if not host:
        return torch.zeros(num_bytes, dtype=torch.int8, device=device)
    if torch.device(device).type == "meta":
        return torch.zeros(num_bytes, dtype=torch.int8, device="meta")
    pin = torch.device(device).type == "cuda" and torch.cuda.is_available()
    return torch.zeros(num_bytes, dtype=torch.int8, device="cpu", pin_memory=pin)


def allocate_tensor_backings(
    kv_cache_config: KVCacheConfig, device: torch.device | str
) -> list[torch.Tensor]:
    """The backing buffer of each ``KVCacheTensor`` (by index), checked first: aliasing tensors
    get one buffer each, strided tensors the one backing of their pool (the same tensor)."""
    check_kv_cache_tensors(kv_cache_config)
    shared = {
        host: _zeros(size, device, host) for host, size in _backing_sizes(kv_cache_config).items()
    }
    return [
        shared[tensor.host_resident]
        if tensor.block_stride is not None
        else _zeros(tensor.size, device, tensor.host_resident)
        for tensor in kv_cache_config.kv_cache_tensors
    ]


def _allocate_kv_cache(
    kv_cache_config: KVCacheConfig, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """Each layer's raw int8 buffer, checked before anything is allocated: the aliasing
    form's tensor buffer, shared by the layers it names; in the strided form, the backing
    from the layer's first page on (a 1-D view; :func:`layer_placements` gives its page
    spacing)."""
    backings = allocate_tensor_backings(kv_cache_config, device)
    raw_tensors: dict[str, torch.Tensor] = {}
    for layer_name, placement in layer_placements(kv_cache_config).items():
        backing = backings[placement.tensor_index]
        strided = placement.block_stride_bytes is not None
        raw_tensors[layer_name] = backing[placement.start_bytes :] if strided else backing
    return raw_tensors
