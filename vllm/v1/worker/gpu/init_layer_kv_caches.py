"""The library's KV-cache views: raw int8 buffers → each layer's cache in its backend's shape,
checked before anything real is allocated (:func:`init_layer_kv_caches`).

Units: sizes and offsets named ``*_bytes`` are bytes; ``*_elems`` are elements of the view's
dtype; block sizes are tokens (``block_size``) or stored slots (``storage_block_size``) per
page; ``num_blocks`` counts pages.

A layer's cache is returned as:

- attention layers: the backend's logical ``(B, 2, N, H, D')`` view (``kv_cache[:, 0]`` /
  ``kv_cache[:, 1]`` are what ``reshape_and_cache_flash`` takes); with ``head_size_v !=
  head_size`` the pair ``(key_cache, value_cache)`` of ``(B, N, H, D')`` views over the K and
  V regions of each page; packed-slot formats (TurboQuant, UltraQuant, Octave) the
  ``(B, H, N, slot)`` uint8 view stored block, token, head, slot, whichever backend reads it;
- MLA layers: ``(B, storage_block_size, head_size)`` in the storage dtype, or
  ``(B, storage_block_size, 584)`` uint8 for ``fp8_ds_mla`` records;
- Mamba layers: a list with one ``(B, *shape_i)`` view per state tensor, at its byte offset in
  the page, in ``dtypes[i]``.

Upstream v0.33's runner entry point with the same job,
:func:`vllm.v1.worker.gpu.attn_utils.init_kv_cache`, allocates with
:func:`vllm.v1.worker.utils.allocate_kv_cache` and binds the caches to the model's layers; this
module is the library's own: backends validated, views dry-run on the meta device, quantized
formats laid out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence

import torch

from vllm.config.cache import validate_cache_dtype
from vllm.kv_quant.slot_codecs import is_packed
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    KVCacheScaleLayouts,
    get_device_capability,
)
from vllm.v1.attention.backends.reference_packed import PACKED_STRIDE_ORDER
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    iter_layer_specs,
)
from vllm.v1.worker.gpu.attn_groups import _supports_kernel_block_size, select_kernel_block_size
from vllm.v1.worker.gpu.kv_cache_buffers import (
    LayerPlacement,
    _allocate_kv_cache,
    buffer_layers,
    check_buffer_pages,
    check_strided_pages,
    group_layers,
    layer_placements,
)
from vllm.v1.worker.gpu.paged_views import _is_mla_spec, _paged_view, spec_cache_dtype_str
from vllm.v1.worker.utils import check_kv_sharing

LayerKVCache = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | list[torch.Tensor]
"""One layer's cache view(s); see the module docstring."""

_Pages = tuple[int, int]
"""A layer's ``(num_blocks, block stride in bytes)``."""

AttnBackends = Mapping[str, type[AttentionBackend]] | Sequence[type[AttentionBackend]]
"""Backend class per layer name, or one per KV-cache group."""


# ------------------------------------------------------------------------------ reshape


def _normalize_backends(
    kv_cache_config: KVCacheConfig, attn_backends: AttnBackends
) -> dict[str, type[AttentionBackend]]:
    if isinstance(attn_backends, Mapping):
        return dict(attn_backends)
    groups = kv_cache_config.kv_cache_groups
    if len(attn_backends) != len(groups):
        raise ValueError(
            f"attn_backends: expected a dict layer → backend or one backend per KV-cache "
            f"group ({len(groups)}), got {len(attn_backends)}"
        )
    return {
        layer: backend
        for group, backend in zip(groups, attn_backends, strict=True)
        for layer in group.layer_names
    }


def _check_backends_cover(
    layer_specs: Mapping[str, KVCacheSpec], backends: Mapping[str, type[AttentionBackend]]
) -> None:
    missing = [
        name
        for name, spec in layer_specs.items()
        if isinstance(spec, AttentionSpec) and name not in backends
    ]
    if missing:
        raise ValueError(f"attn_backends: no backend for attention layer(s) {', '.join(missing)}")


def _kernel_block_sizes(
    kv_cache_config: KVCacheConfig,
    backends: dict[str, type[AttentionBackend]],
    kernel_block_sizes: Sequence[int] | None,
) -> list[int]:
    """Kernel block size per group (Mamba-only groups: their storage block size)."""
    layer_specs = dict(iter_layer_specs(kv_cache_config))
    _check_backends_cover(layer_specs, backends)
    groups = kv_cache_config.kv_cache_groups
    if kernel_block_sizes is not None and len(kernel_block_sizes) != len(groups):
        raise ValueError(
            f"kernel_block_sizes: expected one per KV-cache group ({len(groups)}), "
            f"got {len(kernel_block_sizes)}"
        )
    sizes: list[int] = []
    for group_idx, group in enumerate(groups):
        specs = [(n, layer_specs[n]) for n in group.layer_names]
        attn = [(n, s) for n, s in specs if isinstance(s, AttentionSpec)]
        storage_sizes = {s.storage_block_size for _, s in specs}
        if len(storage_sizes) > 1:
            raise ValueError(
                f"kv_cache_config: group {group_idx} mixes storage block sizes "
                f"{sorted(storage_sizes)}; a group shares one block table"
            )
        storage = storage_sizes.pop() if storage_sizes else 1
        group_backends = [backends[n] for n, _ in attn]
        if kernel_block_sizes is None:
            sizes.append(select_kernel_block_size(group_backends, storage) if attn else storage)
            continue
        size = kernel_block_sizes[group_idx]
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or storage % size:
            raise ValueError(
                f"kernel_block_sizes[{group_idx}]: expected a positive divisor of the group's "
                f"storage block size {storage}, got {size!r}"
            )
        unsupported = sorted(
            {b.get_name() for b in group_backends if not _supports_kernel_block_size(b, size)}
        )
        if unsupported:
            raise ValueError(
                f"kernel_block_sizes[{group_idx}]: {size} is not a kernel block size of "
                f"{', '.join(unsupported)}"
            )
        sizes.append(size)
    return sizes


def _attention_view(
    layer_name: str,
    spec: AttentionSpec,
    raw: torch.Tensor,
    backend: type[AttentionBackend],
    kernel_block_size: int,
    cache_dtype: str | None,
    pages: _Pages,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    page_bytes = spec.page_size_bytes
    sink_bytes = spec.sink_bytes_per_page
    real_bytes = spec.real_page_size_bytes - sink_bytes  # the K and V rows
    storage = spec.storage_block_size
    num_blocks, block_stride_bytes = pages
    blocks_per_kv_block = storage // kernel_block_size
    kernel_num_blocks = num_blocks * blocks_per_kv_block
    cache_dtype_str = spec_cache_dtype_str(spec, cache_dtype)
    is_mla = _is_mla_spec(spec)
    dtype = spec.kv_cache_format.resolve_storage_dtype(spec.dtype)
    itemsize = get_dtype_size(dtype)
    what = f"layer {layer_name!r}"

    if sink_bytes and blocks_per_kv_block > 1:
        raise ValueError(
            f"{what}: a page with {sink_bytes} bytes of key sink rows cannot be split into "
            f"{blocks_per_kv_block} kernel blocks of {kernel_block_size} slots (the rows belong "
            "to the whole page). Use a kernel block size equal to the block size"
        )
    if page_bytes != real_bytes + sink_bytes and blocks_per_kv_block > 1:
        raise ValueError(
            f"{what}: a padded page ({page_bytes} bytes for {real_bytes} bytes of data) cannot "
            f"be split into {blocks_per_kv_block} kernel blocks of {kernel_block_size} slots "
            f"(block of {storage} slots): the kernel pages would straddle the padding. Use a "
            "kernel block size equal to the block size, or drop the padding"
        )
    if block_stride_bytes != page_bytes and blocks_per_kv_block > 1:
        raise ValueError(
            f"{what}: pages {block_stride_bytes} bytes apart (other layers' pages between them) "
            f"cannot be split into {blocks_per_kv_block} kernel blocks of {kernel_block_size} "
            "slots: kernel blocks need dense pages. Use a kernel block size equal to the block "
            "size, or a layer-outermost layout"
        )
    if page_bytes % itemsize or block_stride_bytes % itemsize:
        raise ValueError(
            f"{what}: page of {page_bytes} bytes ({block_stride_bytes} bytes apart) is not a "
            f"whole number of {dtype} elements ({itemsize} bytes)"
        )
    kernel_page_elems = block_stride_bytes // itemsize // blocks_per_kv_block
    kernel_real_bytes = real_bytes // blocks_per_kv_block
    order = tuple(backend.get_kv_cache_stride_order())

    shape = tuple(
        backend.get_kv_cache_shape(
            kernel_num_blocks,
            kernel_block_size,
            spec.num_kv_heads,
            spec.head_size,
            cache_dtype_str,
        )
    )
    if is_mla:
        if math.prod(shape[1:]) * itemsize != kernel_real_bytes:
            raise ValueError(
                f"{what}: backend {backend.get_name()} shape {shape} ({dtype}) does not match "
                f"the spec's {kernel_real_bytes} bytes per kernel page"
            )
        return _paged_view(raw, dtype, shape, order, kernel_page_elems, 0, what)

    if is_packed(spec.kv_cache_format):
        return _packed_view(
            what, backend, raw, dtype, shape, order, kernel_page_elems, kernel_real_bytes
        )

    head_size_v = spec.head_size_v if spec.head_size_v is not None else spec.head_size
    k_shape = shape
    if len(k_shape) != 5 or k_shape[1] != 2 or len(order) != 5:
        raise ValueError(
            f"{what}: backend {backend.get_name()} gives shape {k_shape} / stride order {order}; "
            "an attention layer needs a (B, 2, N, H, D') cache"
        )
    if head_size_v == spec.head_size:
        if math.prod(k_shape[1:]) * itemsize != kernel_real_bytes:
            raise ValueError(
                f"{what}: backend {backend.get_name()} shape {k_shape} ({dtype}) does not match "
                f"the spec's {kernel_real_bytes} bytes per kernel page"
            )
        return _paged_view(raw, dtype, k_shape, order, kernel_page_elems, 0, what)

    if not backend.supports_head_size_v:
        raise ValueError(
            f"{what}: head_size_v={head_size_v} != head_size={spec.head_size} and backend "
            f"{backend.get_name()} shares one last dim between K and V; use a backend with "
            "separate K/V regions (e.g. REFERENCE)"
        )
    v_shape = tuple(
        backend.get_kv_cache_shape(
            kernel_num_blocks, kernel_block_size, spec.num_kv_heads, head_size_v, cache_dtype_str
        )
    )
    # Each (kernel) page is [K side | V side]; a side is dense in the layout's order.
    side_order = tuple(d if d < 1 else d - 1 for d in order if d != 1)
    k_side, v_side = (k_shape[0], *k_shape[2:]), (v_shape[0], *v_shape[2:])
    k_elems, v_elems = math.prod(k_side[1:]), math.prod(v_side[1:])
    if (k_elems + v_elems) * itemsize != kernel_real_bytes:
        raise ValueError(
            f"{what}: K side {k_side} + V side {v_side} ({dtype}) do not match the spec's "
            f"{kernel_real_bytes} bytes per kernel page"
        )
    key_cache = _paged_view(raw, dtype, k_side, side_order, kernel_page_elems, 0, what)
    value_cache = _paged_view(raw, dtype, v_side, side_order, kernel_page_elems, k_elems, what)
    return key_cache, value_cache


def _packed_view(
    what: str,
    backend: type[AttentionBackend],
    raw: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    order: tuple[int, ...],
    kernel_page_elems: int,
    kernel_real_bytes: int,
) -> torch.Tensor:
    """A packed-slot layer's ``(B, H, N, slot)`` view, stored block, token, head, slot: the
    formats' one page layout (:data:`PACKED_STRIDE_ORDER`), whatever backend reads it, so that
    pages move between backends byte for byte."""
    if len(shape) != 4:
        raise ValueError(
            f"{what}: backend {backend.get_name()} gives shape {shape}; a packed-slot layer "
            "needs a (B, H, N, slot) cache"
        )
    if len(order) == 4 and order != PACKED_STRIDE_ORDER:
        raise ValueError(
            f"{what}: backend {backend.get_name()} stores a packed-slot cache in order {order}; "
            f"expected {PACKED_STRIDE_ORDER} (block, token, head, slot)"
        )
    if math.prod(shape[1:]) * get_dtype_size(dtype) != kernel_real_bytes:
        raise ValueError(
            f"{what}: backend {backend.get_name()} shape {shape} ({dtype}) does not match "
            f"the spec's {kernel_real_bytes} bytes per kernel page"
        )
    return _paged_view(raw, dtype, shape, PACKED_STRIDE_ORDER, kernel_page_elems, 0, what)


def _mamba_views(
    layer_name: str, spec: MambaSpec, raw: torch.Tensor, pages: _Pages
) -> list[torch.Tensor]:
    num_blocks, page_bytes = pages
    views: list[torch.Tensor] = []
    offset_bytes = 0
    for i, (shape, dtype, size) in enumerate(
        zip(spec.shapes, spec.dtypes, spec.state_sizes_bytes, strict=True)
    ):
        itemsize = get_dtype_size(dtype)
        if page_bytes % itemsize or offset_bytes % itemsize:
            raise ValueError(
                f"layer {layer_name!r}: Mamba state {i} ({dtype}) at byte offset {offset_bytes} "
                f"in a {page_bytes}-byte page is not aligned to its {itemsize}-byte elements"
            )
        views.append(
            _paged_view(
                raw,
                dtype,
                (num_blocks, *shape),
                tuple(range(len(shape) + 1)),
                page_bytes // itemsize,
                offset_bytes // itemsize,
                f"layer {layer_name!r} state {i}",
            )
        )
        offset_bytes += size
    return views


def _layer_pages(
    layer_name: str,
    spec: KVCacheSpec,
    raw: torch.Tensor,
    placement: LayerPlacement | None,
    kv_cache_config: KVCacheConfig,
) -> _Pages:
    """``(num_blocks, block stride bytes)`` of a layer's raw buffer, checked: a strided
    tensor's layer (``raw`` starting at its first page) uses the tensor's block stride and its
    pool's pages; an aliasing one (or a caller's buffer for a layer no tensor names) whole
    pages back to back, as many as fit."""
    what = f"kv_cache_raw_tensors[{layer_name!r}]"
    if placement is None or placement.block_stride_bytes is None:
        num_blocks = kv_cache_config.num_blocks if placement is None else placement.num_blocks
        check_buffer_pages(what, raw.numel(), layer_name, spec, num_blocks)
        return raw.numel() // spec.page_size_bytes, spec.page_size_bytes
    relative = dataclasses.replace(placement, start_bytes=0)
    check_strided_pages(what, raw.numel(), layer_name, spec, relative)
    return placement.num_blocks, placement.block_stride_bytes


def _reshape_kv_cache(
    kv_cache_config: KVCacheConfig,
    kv_cache_raw_tensors: dict[str, torch.Tensor],
    attn_backends: AttnBackends,
    cache_dtype: str | None = None,
    kernel_block_sizes: Sequence[int] | None = None,
) -> dict[str, LayerKVCache]:
    """View each layer's raw buffer as its cache (see the module docstring for the forms).

    Per layer: ``num_blocks = raw.numel() // page_size_bytes`` with pages back to back (a
    strided ``KVCacheTensor``'s layer: its pool's pages, ``block_stride`` apart, ``raw``
    starting at its first page); the group's kernel block size
    (given, or the largest every backend of the group supports that divides the storage block
    size); ``num_blocks_per_kv_block = storage_block_size // kernel_block_size``;
    ``kernel_num_blocks = num_blocks * num_blocks_per_kv_block``; shape from the backend,
    physical order from its stride order, page stride ``page_size_bytes / sizeof(dtype)``
    (so padded pages are skipped over). ``cache_dtype`` (optional) only picks the FP8 variant
    passed to backends; each layer's spec decides whether it is quantized.
    """
    if cache_dtype is not None:
        validate_cache_dtype(cache_dtype)
    group_of = group_layers(kv_cache_config)
    backends = _normalize_backends(kv_cache_config, attn_backends)
    kernel_sizes = _kernel_block_sizes(kv_cache_config, backends, kernel_block_sizes)
    missing = [
        name for name, _ in iter_layer_specs(kv_cache_config) if name not in kv_cache_raw_tensors
    ]
    if missing:
        raise ValueError(f"kv_cache_raw_tensors: no buffer for layer(s) {', '.join(missing)}")

    placements = layer_placements(kv_cache_config)
    kv_caches: dict[str, LayerKVCache] = {}
    for layer_name, spec in iter_layer_specs(kv_cache_config):
        raw = kv_cache_raw_tensors[layer_name]
        if raw.dtype != torch.int8 or raw.dim() != 1:
            raise ValueError(
                f"kv_cache_raw_tensors[{layer_name!r}]: expected a 1-D torch.int8 buffer, got "
                f"{raw.dtype} of shape {list(raw.shape)}"
            )
        pages = _layer_pages(layer_name, spec, raw, placements.get(layer_name), kv_cache_config)
        if isinstance(spec, MambaSpec):
            kv_caches[layer_name] = _mamba_views(layer_name, spec, raw, pages)
        elif isinstance(spec, AttentionSpec):
            kv_caches[layer_name] = _attention_view(
                layer_name,
                spec,
                raw,
                backends[layer_name],
                kernel_sizes[group_of[layer_name]],
                cache_dtype,
                pages,
            )
        else:
            raise ValueError(
                f"layer {layer_name!r}: no cache view for spec type {type(spec).__name__}"
            )
    return kv_caches


# ------------------------------------------------------------------------ scale layouts


def get_kv_cache_scale_layouts(
    kv_cache_config: KVCacheConfig,
    attn_backends: AttnBackends,
    kernel_block_sizes: Sequence[int] | None = None,
) -> dict[str, KVCacheScaleLayouts]:
    """NVFP4 block-scale layouts ``(k_scale_layout, v_scale_layout)`` of each (non-MLA)
    attention layer's cache: its backend's
    (:meth:`~vllm.v1.attention.backends.abstract.AttentionBackend.get_kv_cache_scale_layouts`
    for the layer's kernel block size and head sizes; FlashInfer: interleave4, others: the op's
    default, upstream's interleave4 where the geometry allows it, else linear).

    The layout is a property of the cache selected with the backend: record it next to the
    views of :func:`init_layer_kv_caches` (same ``attn_backends`` and ``kernel_block_sizes``)
    and pass it to the writer (``reshape_and_cache_flash``'s ``k_scale_layout`` /
    ``v_scale_layout``, or ``ReferenceAttentionImpl``) and to the reader. MLA and Mamba layers
    have no K/V scale planes and are left out. ``ValueError`` when an attention layer has no
    backend.
    """
    backends = _normalize_backends(kv_cache_config, attn_backends)
    layer_specs = dict(iter_layer_specs(kv_cache_config))
    _check_backends_cover(layer_specs, backends)
    kernel_sizes = _kernel_block_sizes(kv_cache_config, backends, kernel_block_sizes)
    layouts: dict[str, KVCacheScaleLayouts] = {}
    for group, kernel_block_size in zip(kv_cache_config.kv_cache_groups, kernel_sizes, strict=True):
        for name in group.layer_names:
            spec = layer_specs[name]
            if isinstance(spec, AttentionSpec) and not _is_mla_spec(spec):
                layouts[name] = backends[name].get_kv_cache_scale_layouts(
                    kernel_block_size, spec.head_size, spec.head_size_v
                )
    return layouts


# --------------------------------------------------------------------------------- init


def validate_kv_cache_backends(
    kv_cache_config: KVCacheConfig,
    attn_backends: AttnBackends,
    device: torch.device | str,
    model_dtype: torch.dtype,
    cache_dtype: str | None = None,
) -> None:
    """Check, before anything is allocated, that each attention layer's backend serves its
    spec (head sizes, model dtype, cache dtype, block size) on ``device``; ``ValueError``
    naming every failing layer and reason."""
    backends = _normalize_backends(kv_cache_config, attn_backends)
    capability = get_device_capability(device)
    failures: list[str] = []
    for layer_name, spec in iter_layer_specs(kv_cache_config):
        if not isinstance(spec, AttentionSpec) or layer_name not in backends:
            continue
        reasons = backends[layer_name].validate_configuration(
            spec.head_size,
            model_dtype,
            spec_cache_dtype_str(spec, cache_dtype),
            spec.storage_block_size,
            capability,
            head_size_v=None if _is_mla_spec(spec) else spec.head_size_v,
            use_mla=_is_mla_spec(spec),
        )
        if reasons:
            failures.append(f"layer {layer_name!r}: " + "; ".join(reasons))
    if failures:
        raise ValueError("KV-cache backends cannot serve this model: " + " | ".join(failures))


def _without_layers(kv_cache_config: KVCacheConfig, names: Collection[str]) -> KVCacheConfig:
    """``kv_cache_config`` with ``names`` left out of its groups."""
    groups = [
        dataclasses.replace(g, layer_names=[n for n in g.layer_names if n not in names])
        for g in kv_cache_config.kv_cache_groups
    ]
    return dataclasses.replace(kv_cache_config, kv_cache_groups=groups)


def init_layer_kv_caches(
    kv_cache_config: KVCacheConfig,
    attn_backends: AttnBackends,
    device: torch.device | str,
    *,
    model_dtype: torch.dtype = torch.bfloat16,
    cache_dtype: str | None = None,
    kernel_block_sizes: Sequence[int] | None = None,
    shared_kv_cache_layers: Mapping[str, str] | None = None,
) -> dict[str, LayerKVCache]:
    """Validate backends, dry-run the views on the meta device, then allocate on ``device``
    and return each layer's cache view. Nothing real is allocated unless all checks pass.

    ``shared_kv_cache_layers`` (layer -> target, :mod:`vllm.v1.worker.utils`): each sharing
    layer gets its target's view, the same tensor; sharing layers own no buffer and may be
    listed in their target's group already.

    The NVFP4 scale layouts that go with these caches (to pass to writers and readers) are
    :func:`get_kv_cache_scale_layouts` of the same ``attn_backends``."""
    shared = dict(shared_kv_cache_layers or {})
    check_kv_sharing(shared, buffer_layers(kv_cache_config))
    config = _without_layers(kv_cache_config, shared) if shared else kv_cache_config
    validate_kv_cache_backends(config, attn_backends, device, model_dtype, cache_dtype)
    meta = _allocate_kv_cache(config, "meta")
    _reshape_kv_cache(config, meta, attn_backends, cache_dtype, kernel_block_sizes)
    raw = _allocate_kv_cache(config, device)
    kv_caches = _reshape_kv_cache(config, raw, attn_backends, cache_dtype, kernel_block_sizes)
    for layer, target in shared.items():
        kv_caches[layer] = kv_caches[target]
    return kv_caches
