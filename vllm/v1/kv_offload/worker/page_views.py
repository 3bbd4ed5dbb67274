"""Byte-page views of a worker's KV cache, the unit that offloading copies.

The worker allocates one raw byte buffer per :class:`~vllm.v1.kv_cache_interface.KVCacheTensor`
and gives each layer that shares it a view (docs/design.md §7). Page ``p`` of a layer is bytes
``[p * page_size_bytes, (p + 1) * page_size_bytes)`` of the buffer, where ``page_size_bytes`` is
the layer spec's page size (padding included). All layers of one buffer have the same page size
(the planner pads pages for that), so one page of a buffer holds one block of exactly one layer,
whichever group owns that block id: offloading copies page ``p`` of every buffer, as raw bytes.

The number of pages is always ``kv_cache_config.num_blocks``, never a tensor's shape: the layers
of a :class:`~vllm.v1.kv_cache_interface.UniformTypeKVCacheSpecs` group differ in page size, a
layer view may be split into kernel blocks, and a raw buffer's shape counts bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm.utils import check_positive_int
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    iter_layer_specs,
)
from vllm.v1.kv_offload.canonical import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)

LayerKVCache = torch.Tensor | Sequence[torch.Tensor]
"""What the worker holds for one layer: an attention cache view, a raw byte buffer, or the
state views of a Mamba layer (all inside that layer's buffer)."""


@dataclass(frozen=True)
class KVCachePageView:
    """One registered KV-cache buffer seen as ``num_blocks`` byte pages.

    ``pages`` is a ``torch.uint8`` tensor of shape ``[num_blocks, page_size_bytes]`` sharing
    storage with the worker's buffer; ``layer_names`` are the layers that live in it.
    """

    tensor_index: int
    layer_names: tuple[str, ...]
    page_size_bytes: int
    pages: torch.Tensor

    @property
    def num_blocks(self) -> int:
        """Pages in the buffer (``kv_cache_config.num_blocks``)."""
        return self.pages.shape[0]


def get_layer_kv_cache_specs(kv_cache_config: KVCacheConfig) -> dict[str, KVCacheSpec]:
    """Each layer's own spec: a :class:`UniformTypeKVCacheSpecs` group is split per layer."""
    return dict(iter_layer_specs(kv_cache_config))


def kv_cache_tensor_page_sizes(kv_cache_config: KVCacheConfig) -> list[int]:
    """Page size in bytes of each :class:`KVCacheTensor`, in ``kv_cache_tensors`` order.

    Raises ``ValueError`` when a tensor names a layer without a spec, when layers sharing a
    tensor disagree on the page size, or when a tensor is smaller than ``num_blocks`` pages.
    """
    num_blocks = check_positive_int("kv_cache_config.num_blocks", kv_cache_config.num_blocks)
    layer_specs = get_layer_kv_cache_specs(kv_cache_config)
    page_sizes: list[int] = []
    for index, tensor in enumerate(kv_cache_config.kv_cache_tensors):
        if not tensor.shared_by:
            raise ValueError(f"kv_cache_config.kv_cache_tensors[{index}]: shared by no layer")
        sizes: dict[str, int] = {}
        for name in tensor.shared_by:
            if name not in layer_specs:
                raise ValueError(
                    f"kv_cache_config.kv_cache_tensors[{index}]: layer {name!r} is in no "
                    "KV-cache group"
                )
            sizes[name] = layer_specs[name].page_size_bytes
        if len(set(sizes.values())) != 1:
            raise ValueError(
                f"kv_cache_config.kv_cache_tensors[{index}]: layers sharing one buffer must have "
                f"the same page size (pad the pages), got page sizes in bytes {sizes}"
            )
        page_size = next(iter(sizes.values()))
        if tensor.size < num_blocks * page_size:
            raise ValueError(
                f"kv_cache_config.kv_cache_tensors[{index}]: size {tensor.size} bytes is smaller "
                f"than num_blocks={num_blocks} pages of {page_size} bytes "
                f"({num_blocks * page_size} bytes)"
            )
        page_sizes.append(page_size)
    return page_sizes


def _as_tensor_list(name: str, entry: LayerKVCache) -> list[torch.Tensor]:
    tensors = [entry] if isinstance(entry, torch.Tensor) else list(entry)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(
            f"kv_caches[{name!r}]: expected a tensor or a non-empty sequence of tensors, "
            f"got {type(entry).__name__}"
        )
    return tensors


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element (non-negative strides)."""
    if t.numel() == 0:
        return 0
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"negative strides are not supported, got {t.stride()}")
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _layer_base(name: str, entry: LayerKVCache) -> torch.Tensor:
    """The tensor of a layer's entry whose first byte is page 0 of the layer (lowest address)."""
    tensors = _as_tensor_list(name, entry)
    base = min(tensors, key=lambda t: t.data_ptr())
    storage_ptr = base.untyped_storage().data_ptr()
    for t in tensors:
        if t.device != base.device or t.untyped_storage().data_ptr() != storage_ptr:
            raise ValueError(
                f"kv_caches[{name!r}]: all views of one layer must share one buffer (same "
                "device and storage)"
            )
    return base


def build_kv_cache_page_views(
    kv_caches: Mapping[str, LayerKVCache], kv_cache_config: KVCacheConfig
) -> list[KVCachePageView]:
    """Byte-page views of every KV-cache buffer, one per :class:`KVCacheTensor`.

    ``kv_caches`` maps each layer name to what the worker holds for it (a cache view, the raw
    byte buffer, or a Mamba layer's state views); layers that share a ``KVCacheTensor`` are
    registered once. Each view has ``kv_cache_config.num_blocks`` pages of the tensor's page
    size. Raises ``ValueError`` for layers missing on either side, layers of one tensor that do
    not start at the same address, or views that reach outside their buffer.
    """
    page_sizes = kv_cache_tensor_page_sizes(kv_cache_config)
    num_blocks = kv_cache_config.num_blocks
    configured = {name for t in kv_cache_config.kv_cache_tensors for name in t.shared_by}
    unknown = sorted(set(kv_caches) - configured)
    if unknown:
        raise ValueError(f"kv_caches: layers {unknown} are in no KVCacheTensor of kv_cache_config")

    views: list[KVCachePageView] = []
    device: torch.device | None = None
    for index, (tensor, page_size) in enumerate(
        zip(kv_cache_config.kv_cache_tensors, page_sizes, strict=True)
    ):
        where = f"kv_cache_config.kv_cache_tensors[{index}]"
        names = [name for name in tensor.shared_by if name in kv_caches]
        if not names:
            raise ValueError(f"{where}: none of its layers {tensor.shared_by} is in kv_caches")
        bases = {name: _layer_base(name, kv_caches[name]) for name in names}
        base = bases[names[0]]
        base_ptr = base.data_ptr()
        for name in names:
            if bases[name].data_ptr() != base_ptr:
                raise ValueError(
                    f"{where}: layers {names} share one buffer but kv_caches[{name!r}] starts "
                    f"{bases[name].data_ptr() - base_ptr} bytes away from kv_caches[{names[0]!r}]"
                )
            for t in _as_tensor_list(name, kv_caches[name]):
                start = t.data_ptr() - base_ptr
                end = start + _extent_bytes(t)
                if end > tensor.size:
                    raise ValueError(
                        f"kv_caches[{name!r}]: a view of shape {tuple(t.shape)} and strides "
                        f"{t.stride()} reaches byte {end} of its buffer, which has "
                        f"{tensor.size} bytes ({where}.size)"
                    )
        if device is None:
            device = base.device
        elif base.device != device:
            raise ValueError(
                f"kv_caches: all KV-cache buffers must be on one device, got {device} and "
                f"{base.device} (layer {names[0]!r})"
            )
        storage = base.untyped_storage()
        offset = base_ptr - storage.data_ptr()
        needed = num_blocks * page_size
        if storage.nbytes() - offset < needed:
            raise ValueError(
                f"kv_caches[{names[0]!r}]: its buffer has {storage.nbytes() - offset} bytes "
                f"from the layer's start, fewer than num_blocks={num_blocks} pages of "
                f"{page_size} bytes ({needed} bytes)"
            )
        pages = torch.empty(0, dtype=torch.uint8, device=base.device)
        pages.set_(storage, offset, (num_blocks, page_size), (page_size, 1))
        views.append(
            KVCachePageView(
                tensor_index=index,
                layer_names=tuple(names),
                page_size_bytes=page_size,
                pages=pages,
            )
        )
    return views


def canonical_page_tensor(canonical: CanonicalKVCacheTensor, where: str = "tensor") -> torch.Tensor:
    """``canonical.tensor`` as ``torch.uint8`` ``[num_blocks, page_size_bytes]`` pages (a view)."""
    t, page = canonical.tensor, canonical.page_size_bytes
    if not t.is_contiguous() or page <= 0 or t.numel() * t.element_size() % page != 0:
        raise ValueError(
            f"{where}: expected a contiguous tensor of whole {page}-byte pages, got shape "
            f"{tuple(t.shape)}, dtype {t.dtype}"
        )
    return t.view(torch.uint8).view(-1, page)


def canonicalize_kv_caches(
    kv_caches: Mapping[str, LayerKVCache], kv_cache_config: KVCacheConfig
) -> CanonicalKVCaches:
    """The worker's KV cache as :class:`CanonicalKVCaches`: one page tensor per
    :class:`KVCacheTensor` (:func:`build_kv_cache_page_views`), and per KV-cache group a
    reference to each tensor one of its layers lives in (with that tensor's page size)."""
    views = build_kv_cache_page_views(kv_caches, kv_cache_config)
    refs = []
    for group in kv_cache_config.kv_cache_groups:
        names = set(group.layer_names)
        refs.append(
            [
                CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=view.page_size_bytes)
                for i, view in enumerate(views)
                if names.intersection(kv_cache_config.kv_cache_tensors[i].shared_by)
            ]
        )
    tensors = [CanonicalKVCacheTensor(view.pages, view.page_size_bytes) for view in views]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)
