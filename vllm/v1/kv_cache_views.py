"""Byte geometry of a KV-cache tensor (:mod:`vllm.v1.kv_cache_interface` re-exports every
name): a layer's logical ``[B, H, N, C]`` shape in bytes, the strides of the ``[L, B, H, N, C]``
axes under a :class:`~vllm.v1.kv_cache_layout.KVCacheLayout`, and per-layer views of a raw
buffer. ``B`` is blocks (kernel blocks when a manager block is split), ``H`` heads, ``N``
states per block, ``C`` bytes per (head, state).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import fields
from typing import Any, TypeVar

import torch

from vllm.v1.kv_cache_config_types import KVCacheGroupSpec, KVCacheTensor, group_layer_specs
from vllm.v1.kv_cache_hisparse_spec import HiSparseHotSpec, HiSparseResidentSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_cache_spec_base import KVCacheSpec

__all__ = [
    "build_kv_cache_tensors",
    "check_layout_expresses_groups",
    "compute_layer_kv_cache_shape_bytes",
    "compute_layout_strides",
    "create_kv_cache_views",
    "group_kernel_blocks",
    "kv_cache_bytes_per_block",
    "replace_as",
    "strided_kv_cache_tensors",
]

_SpecT = TypeVar("_SpecT", bound=KVCacheSpec)
_L, _B = 0, 1


def replace_as(
    spec: KVCacheSpec, target_cls: type[_SpecT], *, drop: Collection[str] = (), **changes: Any
) -> _SpecT:
    """``dataclasses.replace`` into another spec class (a sliding-window spec cached as full
    attention, say): every init field of ``spec`` but those in ``drop`` is passed on, then
    ``changes``; fields only ``target_cls`` has keep their defaults."""
    kwargs = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init and f.name not in drop}
    kwargs.update(changes)
    return target_cls(**kwargs)


def group_kernel_blocks(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A kernel-block cache (dim 0: ``num_blocks x ratio`` kernel blocks) viewed with the
    manager blocks as dim 0; the cache itself when it is not split."""
    if cache.shape[0] == num_blocks:
        return cache
    if num_blocks <= 0 or cache.shape[0] % num_blocks:
        raise ValueError(
            f"num_blocks: expected a divisor of the cache's {cache.shape[0]} kernel blocks, "
            f"got {num_blocks}"
        )
    return cache.unflatten(0, (num_blocks, -1))


def compute_layer_kv_cache_shape_bytes(
    spec: KVCacheSpec, num_blocks: int, kernel_block_size: int | None = None
) -> tuple[int, int, int, int]:
    """``(B, H, N, C)`` of one layer, ``C`` in bytes: ``num_blocks`` manager blocks, each split
    into ``block_size // kernel_block_size`` kernel blocks (``ValueError`` unless it divides)."""
    kernel = spec.block_size if kernel_block_size is None else kernel_block_size
    if kernel <= 0 or spec.block_size % kernel:
        raise ValueError(
            f"kernel_block_size: expected a divisor of the block size {spec.block_size}, "
            f"got {kernel}"
        )
    return (
        num_blocks * (spec.block_size // kernel),
        spec.num_heads,
        spec.get_num_kernel_states(kernel),
        spec.state_content_size_bytes,
    )


def compute_layout_strides(
    spec: KVCacheSpec,
    num_blocks: int,
    num_layers: int,
    layout: KVCacheLayout,
    kernel_block_size: int | None = None,
    fixed_strides: tuple[int | None, ...] = (None,) * 5,
) -> tuple[int, ...]:
    """Byte strides of the logical ``[L, B, H, N, C]`` axes, packed in ``layout``'s physical
    order (innermost first), an axis given in ``fixed_strides`` taking that stride. A padded
    page (``page_size_bytes`` above the unpadded page) spaces the page grid (the L and B axes)
    by whole padded pages; that needs unsplit blocks and L, B outside the page."""
    if len(fixed_strides) != 5 or any(s is not None and s <= 0 for s in fixed_strides):
        raise ValueError(f"fixed_strides: expected 5 positive strides or None, got {fixed_strides}")
    shape = (num_layers, *compute_layer_kv_cache_shape_bytes(spec, num_blocks, kernel_block_size))
    order = layout.stride_order
    padded = spec.page_size_bytes if spec.page_size_bytes != spec.real_page_size_bytes else None
    grid_end = max(order.index(_L), order.index(_B)) + 1
    if padded is not None:
        if kernel_block_size not in (None, spec.block_size):
            raise ValueError("kernel_block_size: padded pages cannot be split into kernel blocks")
        if math.prod(shape[axis] for axis in order[:grid_end]) != num_layers * num_blocks:
            raise ValueError(
                f"layout: a padded page needs only L, B (or size-1 axes) outside it, got "
                f"{layout.name} with shape {shape}"
            )
    strides = [0] * 5
    stride = 1
    for position in reversed(range(5)):
        axis = order[position]
        if padded is not None and position == grid_end - 1:
            stride = max(stride, padded)
        strides[axis] = fixed_strides[axis] or stride
        stride = strides[axis] * shape[axis]
    return tuple(strides)


def create_kv_cache_views(
    raw: torch.Tensor,
    spec: KVCacheSpec,
    num_blocks: int,
    layout: KVCacheLayout,
    kv_cache_tensor: KVCacheTensor,
    kernel_block_size: int | None = None,
) -> list[torch.Tensor]:
    """One ``[B, H, N, C]`` view per layer of ``kv_cache_tensor`` over the flat int8 buffer
    ``raw`` (in the spec's ``dtype`` when it has one): layer l's block b starts at
    ``offset + l * layer_stride + b * block_stride``. Splitting blocks into kernel blocks needs
    dense, unpadded blocks (``ValueError`` naming the layout otherwise)."""
    shape = compute_layer_kv_cache_shape_bytes(spec, num_blocks, kernel_block_size)
    block_stride = kv_cache_tensor.block_stride
    if block_stride is None:
        raise ValueError("kv_cache_tensor.block_stride: expected bytes per block, got None")
    # Kernel blocks per block (from one block: num_blocks may be 0).
    ratio = compute_layer_kv_cache_shape_bytes(spec, 1, kernel_block_size)[0]
    if ratio > 1:
        dense = math.prod(compute_layer_kv_cache_shape_bytes(spec, 1)[1:])
        if block_stride != dense or block_stride % ratio:
            raise ValueError(
                f"layout: {layout.name} does not store blocks as dense pages (block stride "
                f"{block_stride}, page {dense}), so a block cannot be split into {ratio} "
                f"kernel blocks of {kernel_block_size} tokens; use a layer-compact layout"
            )
        block_stride //= ratio
    strides = compute_layout_strides(
        spec,
        num_blocks,
        len(kv_cache_tensor.layers),
        layout,
        kernel_block_size,
        fixed_strides=(kv_cache_tensor.layer_stride or None, block_stride, None, None, None),
    )
    view = torch.as_strided(
        raw,
        size=(len(kv_cache_tensor.layers), *shape),
        stride=strides,
        storage_offset=raw.storage_offset() + kv_cache_tensor.offset,
    )
    dtype = getattr(spec, "dtype", None)
    return [view[i] if dtype is None else view[i].view(dtype) for i in range(view.shape[0])]


def _layer_block_stride(spec: KVCacheSpec) -> int:
    """A layer-outermost layer's block spacing: its page rounded up to its alignment."""
    alignment = spec.get_block_stride_alignment()
    return -(-spec.page_size_bytes // alignment) * alignment


def kv_cache_bytes_per_block(
    kv_cache_groups: list[KVCacheGroupSpec], layout: KVCacheLayout | None = None
) -> int:
    """Bytes one block id takes when groups overlay one backing. Layer-outermost ``layout``:
    the widest group's block spacings (each page rounded to its alignment); otherwise (and
    for None): the widest group's pages side by side, rounded up to the least common multiple
    of every layer's alignment and of HiSparse's hot pages (so each stays whole)."""
    layer_specs = [group_layer_specs(group, i) for i, group in enumerate(kv_cache_groups)]
    if layout is not None and not layout.is_block_outermost:
        return max(
            (sum(_layer_block_stride(s) for _, s in specs) for specs in layer_specs), default=0
        )
    width = max((sum(s.page_size_bytes for _, s in specs) for specs in layer_specs), default=0)
    alignments = [s.get_block_stride_alignment() for specs in layer_specs for _, s in specs]
    alignments += [
        g.kv_cache_spec.page_size_bytes
        for g in kv_cache_groups
        if isinstance(g.kv_cache_spec, HiSparseHotSpec)
    ]
    alignment = math.lcm(*alignments) if alignments else 1
    return -(-width // alignment) * alignment


def check_layout_expresses_groups(
    layout: KVCacheLayout, kv_cache_groups: list[KVCacheGroupSpec]
) -> None:
    """``ValueError`` unless ``layout`` can hold the groups' pages: pages of several sizes sit
    side by side, which needs each page one run of bytes (a block-compact layout) and, with
    several groups overlaying each block, the layer axis inside the block axis."""
    pages = {
        spec.page_size_bytes
        for i, group in enumerate(kv_cache_groups)
        for _, spec in group_layer_specs(group, i)
    }
    if len(pages) <= 1:
        return
    if not layout.is_block_compact or (len(kv_cache_groups) > 1 and layout.is_layer_compact):
        raise ValueError(
            f"kv_cache_layout: {layout.name} cannot express this model's mixed page sizes "
            f"{sorted(pages)} bytes; expected a block-outermost layout (BLHNC, BLNHC), got "
            f"{layout.name}"
        )


def strided_kv_cache_tensors(
    kv_cache_groups: list[KVCacheGroupSpec], layout: KVCacheLayout, num_blocks: int
) -> list[KVCacheTensor]:
    """Upstream v0.33's tensors for groups overlaying one backing of ``num_blocks`` blocks of
    :func:`kv_cache_bytes_per_block` bytes: :func:`build_kv_cache_tensors` after
    :func:`check_layout_expresses_groups` (``ValueError`` for a layout that cannot hold the
    pages)."""
    check_layout_expresses_groups(layout, kv_cache_groups)
    block_bytes = kv_cache_bytes_per_block(kv_cache_groups, layout)
    return build_kv_cache_tensors(
        kv_cache_groups, num_blocks, block_bytes * num_blocks, layout, block_bytes
    )


def build_kv_cache_tensors(
    kv_cache_groups: list[KVCacheGroupSpec],
    num_blocks: int,
    size: int,
    layout: KVCacheLayout,
    bytes_per_block: int,
    *,
    host_resident: bool = False,
) -> list[KVCacheTensor]:
    """Tensors of groups overlaying one backing of ``size`` bytes from byte 0 (a block id
    belongs to one group at a time). Within a group, one tensor per spec (its layers in
    order), placed after the previous spec's layers. Block-outermost ``layout``: block b
    holds the group's pages side by side at ``b x bytes_per_block``; layer-outermost: each
    layer owns a region of ``num_blocks`` pages (a page padded to its alignment needs a
    block-compact layout). HiSparse hot/resident pages have no head grid, so they need a
    block-outermost layout (``ValueError`` otherwise)."""
    block_outer = layout.is_block_outermost
    tensors = []
    for i, group in enumerate(kv_cache_groups):
        runs: dict[KVCacheSpec, list[str]] = {}
        for name, spec in group_layer_specs(group, i):
            runs.setdefault(spec, []).append(name)
        offset = 0
        for spec, names in runs.items():
            if isinstance(spec, (HiSparseHotSpec, HiSparseResidentSpec)):
                if not block_outer:
                    raise ValueError(
                        f"layout: HiSparse pages need a block-outermost layout, got {layout.name}"
                    )
                layer_stride, block_stride = spec.page_size_bytes, bytes_per_block
            else:
                layer_stride, block_stride = _spec_strides(
                    spec, names, num_blocks, layout, bytes_per_block
                )
            tensors.append(
                KVCacheTensor(
                    size=size,
                    layers=names,
                    layer_stride=layer_stride,
                    block_stride=block_stride,
                    offset=offset,
                    host_resident=host_resident,
                )
            )
            # Block-outermost layers share each block; layer-outermost ones own regions.
            offset += len(names) * (spec.page_size_bytes if block_outer else layer_stride)
    return tensors


def _spec_strides(
    spec: KVCacheSpec,
    names: list[str],
    num_blocks: int,
    layout: KVCacheLayout,
    bytes_per_block: int,
) -> tuple[int, int]:
    """``(layer_stride, block_stride)`` in bytes of ``names`` (all of ``spec``) under
    ``layout``."""
    block_stride = bytes_per_block if layout.is_block_outermost else None
    if not layout.is_block_outermost and _layer_block_stride(spec) != spec.page_size_bytes:
        if not layout.is_block_compact:
            raise ValueError(
                f"kv_cache_layout: {layout.name} cannot pad the pages of {names[0]!r} to "
                f"their {spec.get_block_stride_alignment()}-byte alignment; expected a "
                "block-compact layout"
            )
        block_stride = _layer_block_stride(spec)
    fixed = (None, block_stride, None, None, None)
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, num_blocks, len(names), layout, fixed_strides=fixed
    )
    return layer_stride, block_stride
