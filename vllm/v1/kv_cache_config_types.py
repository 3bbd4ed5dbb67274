"""How a KV cache is allocated (:mod:`vllm.v1.kv_cache_interface` re-exports every name):
the raw tensors and where each layer's pages sit in them, the groups sharing a block table,
and the config holding both.

Units: strides, offsets and sizes are in bytes; ``num_blocks`` in pages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import overload

import torch

from vllm.kv_quant.formats import KVQuantMode
from vllm.v1.kv_cache_attention_spec import AttentionSpec
from vllm.v1.kv_cache_spec_base import KVCacheSpec, MambaSpec

__all__ = [
    "KVCacheConfig",
    "KVCacheGroupRole",
    "KVCacheGroupSpec",
    "KVCacheTensor",
    "group_layer_specs",
    "iter_layer_specs",
]


@dataclass(init=False)
class KVCacheTensor:
    """Where a set of same-shaped layers' pages sit in one raw buffer of ``size`` bytes.

    Layer ``layers[l]``'s page of block ``b`` starts ``offset + l * layer_stride +
    b * block_stride`` bytes in. ``layer_stride=0`` makes the layers alias the same bytes
    (v0.22's ``shared_by``: every layer of the tensor uses all of it); ``block_stride=None``
    (only from that v0.22 form) means ``size // num_blocks``. ``host_resident`` tensors live in
    HiSparse's host pool. The numbers are not checked here: the worker checks a whole config
    before allocating (its errors name the config's field).
    """

    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int | None
    offset: int = 0
    host_resident: bool = False

    def __init__(
        self,
        size: int,
        layers: list[str] | None = None,
        layer_stride: int = 0,
        block_stride: int | None = None,
        offset: int = 0,
        host_resident: bool = False,
        *,
        shared_by: list[str] | None = None,
    ) -> None:
        if (layers is None) == (shared_by is None):
            raise TypeError(
                f"layers: expected the layer names as layers (or v0.22's shared_by), got "
                f"layers={layers!r}, shared_by={shared_by!r}"
            )
        self.size = size
        self.layers = list(layers if layers is not None else shared_by or [])
        self.layer_stride = layer_stride
        self.block_stride = block_stride
        self.offset = offset
        self.host_resident = host_resident

    @property
    def shared_by(self) -> list[str]:
        """v0.22's name of ``layers``."""
        return self.layers


class KVCacheGroupRole(str, Enum):
    """What a group is for beyond its spec (HiSparse splits one MLA layer into groups)."""

    DEFAULT = "default"
    HISPARSE_SOURCE = "hisparse_source"
    HISPARSE_INDEXER = "hisparse_indexer"


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table, and the spec of their pages."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False
    """True for the group holding EAGLE / MTP draft layers (drops its last page on a hit)."""
    host_resident: bool = False
    """True for a group in HiSparse's host pool rather than the device pool."""
    enable_kv_transfer: bool = True
    """False for device-only replicas a connector rebuilds from their source group."""
    role: KVCacheGroupRole = KVCacheGroupRole.DEFAULT


@overload
def iter_layer_specs(config: KVCacheSpec) -> tuple[KVCacheSpec, ...]: ...
@overload
def iter_layer_specs(config: KVCacheConfig) -> Iterator[tuple[str, KVCacheSpec]]: ...
def iter_layer_specs(
    config: KVCacheSpec | KVCacheConfig,
) -> tuple[KVCacheSpec, ...] | Iterator[tuple[str, KVCacheSpec]]:
    """For a (group) spec, as upstream v0.33: the per-layer specs it covers. For a
    :class:`KVCacheConfig` (this library's form, kept): ``(layer name, the layer's own spec)``
    for every layer, group by group (``ValueError`` when a wrapping group spec has no spec for
    one of its layers)."""
    if isinstance(config, KVCacheSpec):
        return config.layer_specs()
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"config: expected a KVCacheSpec or KVCacheConfig, got {config!r}")
    return _iter_config_layers(config)


def group_layer_specs(group: KVCacheGroupSpec, group_idx: int = 0) -> list[tuple[str, KVCacheSpec]]:
    """``(layer name, the layer's own spec)`` for each layer of ``group`` (a wrapping group
    spec's per-layer one); ``ValueError`` when a wrapping spec has none for a layer."""
    group_spec = group.kv_cache_spec
    per_layer: dict[str, KVCacheSpec] | None = getattr(group_spec, "kv_cache_specs", None)
    if per_layer is None:
        return [(name, group_spec) for name in group.layer_names]
    missing = [name for name in group.layer_names if name not in per_layer]
    if missing:
        raise ValueError(
            f"kv_cache_config: layer {missing[0]!r} of group {group_idx} has no "
            f"spec in its UniformTypeKVCacheSpecs (has: {', '.join(per_layer)})"
        )
    return [(name, per_layer[name]) for name in group.layer_names]


def _iter_config_layers(config: KVCacheConfig) -> Iterator[tuple[str, KVCacheSpec]]:
    for group_idx, group in enumerate(config.kv_cache_groups):
        yield from group_layer_specs(group, group_idx)


@dataclass
class KVCacheConfig:
    """How the KV cache is allocated: ``num_blocks`` device pages, the tensors and the groups.

    The engine core resolves the optional fields for every worker: the layout name, the tokens
    per prefix-cache hash (``hash_block_size``) and per hit (``cache_hit_alignment_tokens``),
    HiSparse's host pool (pages, bytes between pages, shared by local TP ranks) and the
    consecutive TP ranks holding identical KV (``kv_tp_replicas``).
    """

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
    prefix_cache_retention_interval: int | None = None
    kv_cache_layout: str | None = None
    hash_block_size: int | None = None
    cache_hit_alignment_tokens: int | None = None
    hisparse_host_num_blocks: int | None = None
    hisparse_host_block_stride: int | None = None
    hisparse_shared_host_pool: bool = False
    kv_tp_replicas: int = 1

    def __post_init__(self) -> None:
        n = self.num_blocks
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"num_blocks: expected an int >= 0 (pages per tensor), got {n!r}")

    @cached_property
    def transfer_group_ids(self) -> tuple[int, ...]:
        """Groups a KV connector moves (``enable_kv_transfer``)."""
        return tuple(i for i, g in enumerate(self.kv_cache_groups) if g.enable_kv_transfer)

    @cached_property
    def transfer_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return tuple(self.kv_cache_groups[i] for i in self.transfer_group_ids)

    @cached_property
    def transfer_group_index_by_layer(self) -> dict[str, int]:
        """Each transferred layer's index into :attr:`transfer_groups`."""
        return {
            name: index
            for index, group in enumerate(self.transfer_groups)
            for name in group.layer_names
        }

    @cached_property
    def prefix_cacheable_group_ids(self) -> tuple[int, ...]:
        """Transferred groups whose pages may be stored by hash (scratch state excluded)."""
        return tuple(
            i
            for i in self.transfer_group_ids
            if self.kv_cache_groups[i].kv_cache_spec.prefix_cacheable
        )

    @cached_property
    def prefix_cacheable_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return tuple(self.kv_cache_groups[i] for i in self.prefix_cacheable_group_ids)

    def select_transfer_block_ids(self, block_ids: Sequence[list[int]]) -> tuple[list[int], ...]:
        """The block ids of the transferred groups, from one list per group."""
        if len(block_ids) != len(self.kv_cache_groups):
            raise ValueError(
                f"block_ids: expected one list per KV cache group "
                f"({len(self.kv_cache_groups)}), got {len(block_ids)}"
            )
        return tuple(block_ids[i] for i in self.transfer_group_ids)

    @property
    def host_group_ids(self) -> tuple[int, ...]:
        """Groups in HiSparse's host pool."""
        return tuple(i for i, g in enumerate(self.kv_cache_groups) if g.host_resident)

    def num_blocks_of(self, tensor: KVCacheTensor) -> int:
        """Pages of the pool backing ``tensor`` (the host pool's for a host tensor)."""
        if not tensor.host_resident:
            return self.num_blocks
        if self.hisparse_host_num_blocks is None:
            raise ValueError(
                "hisparse_host_num_blocks: expected pages for a host-resident tensor, got None"
            )
        return self.hisparse_host_num_blocks

    def _layer_specs(self) -> Iterator[tuple[KVCacheGroupSpec, KVCacheSpec]]:
        for group in self.kv_cache_groups:
            for spec in group.kv_cache_spec.layer_specs():
                yield group, spec

    @property
    def has_mamba_layers(self) -> bool:
        """True when a layer holds Mamba states."""
        return any(isinstance(spec, MambaSpec) for _, spec in self._layer_specs())

    @property
    def has_mixed_precision_kv_cache(self) -> bool:
        """True when the device attention layers use more than one (dtype, quant mode)."""
        precisions: set[tuple[torch.dtype, KVQuantMode]] = {
            (spec.dtype, spec.kv_quant_mode)
            for group, spec in self._layer_specs()
            if not group.host_resident and isinstance(spec, AttentionSpec)
        }
        return len(precisions) > 1

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        """True when fresh pages must be zeroed: Mamba states are read before written, and a
        page reused under another precision would decode stale bytes as NaN/Inf."""
        return self.has_mamba_layers or self.has_mixed_precision_kv_cache
