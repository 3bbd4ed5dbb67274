"""HiSparse's cache groups and pools (planning only).

HiSparse splits a sparse-MLA model's cache into: the *source* group (every sparse layer's
full history, in the host pool), the *indexer* group (the indexer keys, on the device, the
only part the indexer reads in full), and per set of sparse layers one *resident* group (a
request's newest pages on the device) and one *hot* group (the pages the indexer picked,
``blocks_per_request`` per request). Resident and hot layers are named after their sparse
layer with :data:`HISPARSE_RESIDENT_SUFFIX` / :data:`HISPARSE_HOT_SUFFIX`. The device groups
share one pool of ``num_blocks`` pages; the host pool has ``host_num_blocks``.

Units: pages and blocks are counts, strides and budgets bytes, lengths tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.hisparse.runtime import (
    ResolvedHiSparseConfig,
    get_hisparse_host_block_stride,
    hisparse_host_pool_gib,
    use_shared_hisparse_host_pool,
)
from vllm.v1.hisparse.types import ACTIVE_TAIL_PAGES
from vllm.v1.kv_cache_interface import (
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_cache_views import build_kv_cache_tensors, kv_cache_bytes_per_block

__all__ = [
    "HISPARSE_HOT_SUFFIX",
    "HISPARSE_RESIDENT_SUFFIX",
    "HiSparseLayout",
    "create_hisparse_layout",
    "get_hisparse_host_pool_bytes",
    "get_hisparse_kv_cache_config",
    "get_hisparse_kv_cache_groups",
    "get_hisparse_steady_state_concurrency",
]

HISPARSE_HOT_SUFFIX = ".hisparse_hot"
HISPARSE_RESIDENT_SUFFIX = ".hisparse_resident"

_build_hisparse_kv_cache_tensors = build_kv_cache_tensors
"""Upstream's name (``(groups, num_blocks, size, layout, bytes_per_block, *,
host_resident=False)``) for the library's one tensor builder."""

GroupFn = Callable[[Any, dict[str, KVCacheSpec]], list[KVCacheGroupSpec]]
"""Groups the layers HiSparse does not handle: ``(vllm_config, specs) -> groups``."""


@dataclass(frozen=True)
class HiSparseLayout:
    """The host source group, the device groups, and the host pool's pages and stride."""

    source_group: KVCacheGroupSpec
    device_groups: list[KVCacheGroupSpec]
    host_num_blocks: int
    host_block_stride: int
    shared_host_pool: bool


def get_hisparse_kv_cache_groups(
    vllm_config: Any,
    kv_cache_spec: dict[str, KVCacheSpec],
    group_others: GroupFn | None = None,
) -> list[KVCacheGroupSpec] | None:
    """HiSparse's groups (source, indexer, resident..., hot..., then the other layers' groups
    from ``group_others``), or None when HiSparse is off or there is no MLA layer. Resident
    and hot specs already among ``kv_cache_spec`` (a worker reports them) are derived again
    from their MLA layers. ``ValueError`` for DeepSeek-V4, for MLA layers without both sparse
    and indexer caches, or for other layers without ``group_others``."""
    attention_config = getattr(vllm_config, "attention_config", None)
    if attention_config is None or attention_config.hisparse_config is None:
        return None
    mla = {n: s for n, s in kv_cache_spec.items() if isinstance(s, MLAAttentionSpec)}
    if not mla:
        return None
    others = {
        n: s
        for n, s in kv_cache_spec.items()
        if not isinstance(s, (MLAAttentionSpec, HiSparseResidentSpec, HiSparseHotSpec))
    }
    if others and group_others is None:
        raise ValueError(
            f"group_others: expected a grouping function for the non-MLA layers "
            f"{sorted(others)}, got None"
        )
    source, indexer = _split_sparse_layers(mla)
    rest = group_others(vllm_config, others) if others and group_others is not None else []
    return [*_lay_out(vllm_config, source, indexer), *rest]


def _split_sparse_layers(
    mla: dict[str, MLAAttentionSpec],
) -> tuple[dict[str, MLAAttentionSpec], dict[str, MLAAttentionSpec]]:
    if any(spec.model_version == "deepseek_v4" for spec in mla.values()):
        raise ValueError("kv_cache_spec: HiSparse does not support DeepSeek V4 (its MLA layers)")
    if UniformTypeKVCacheSpecs.from_specs(dict(mla)) is None:
        raise ValueError(
            "kv_cache_spec: HiSparse needs MLA layers of one block size, got "
            f"{sorted({s.block_size for s in mla.values()})}"
        )
    source = {n: s for n, s in mla.items() if s.cache_role is SparseCacheRole.SPARSE}
    indexer = {n: s for n, s in mla.items() if s.cache_role is SparseCacheRole.INDEXER}
    if not source or not indexer:
        raise ValueError(
            "kv_cache_spec: HiSparse needs sparse-MLA and indexer caches, got "
            f"{len(source)} sparse and {len(indexer)} indexer layers"
        )
    return source, indexer


def _wrap(specs: dict[str, MLAAttentionSpec]) -> UniformTypeKVCacheSpecs:
    wrapped = UniformTypeKVCacheSpecs.from_specs(dict[str, KVCacheSpec](specs))
    assert wrapped is not None  # checked by _split_sparse_layers
    return wrapped


def _lay_out(
    vllm_config: Any,
    source: dict[str, MLAAttentionSpec],
    indexer: dict[str, MLAAttentionSpec],
) -> list[KVCacheGroupSpec]:
    block_size = next(iter(source.values())).block_size
    top_k = max(
        s.topk_buffer_width
        if s.topk_buffer_width is not None
        else vllm_config.model_config.hf_config.index_topk
        for s in source.values()
    )
    config = ResolvedHiSparseConfig.from_vllm_config(vllm_config, top_k)
    assert config is not None  # HiSparse is on
    hot_pages = cdiv(config.device_buffer_size, block_size)
    # A hot group holds the sparse layers of one or more index groups (a leader starts one),
    # packed while their pages fit in one indexer page: the pool's pages are that size.
    indexer_page = sum(s.page_size_bytes for s in indexer.values())
    units: list[list[tuple[str, MLAAttentionSpec]]] = []
    for name, spec in source.items():
        if spec.is_index_group_leader or not units:
            units.append([])
        units[-1].append((name, spec))
    packs: list[list[tuple[str, MLAAttentionSpec]]] = []
    packed_bytes = 0
    for unit in units:
        unit_bytes = sum(s.page_size_bytes for _, s in unit)
        if packs and packed_bytes + unit_bytes <= indexer_page:
            packs[-1].extend(unit)
            packed_bytes += unit_bytes
        else:
            packs.append(list(unit))
            packed_bytes = unit_bytes
    resident_groups, hot_groups = [], []
    for pack in packs:
        pages = {s.page_size_bytes for _, s in pack}
        if len(pages) != 1:
            raise ValueError(
                f"kv_cache_spec: a HiSparse hot group needs one page size, got {sorted(pages)}"
            )
        page = pages.pop()
        resident_groups.append(
            KVCacheGroupSpec(
                [n + HISPARSE_RESIDENT_SUFFIX for n, _ in pack],
                HiSparseResidentSpec(block_size=block_size, page_size=page),
                enable_kv_transfer=False,
            )
        )
        hot_groups.append(
            KVCacheGroupSpec(
                [n + HISPARSE_HOT_SUFFIX for n, _ in pack],
                HiSparseHotSpec(
                    block_size=block_size, page_size=page, blocks_per_request=hot_pages
                ),
                enable_kv_transfer=False,
            )
        )
    source_group = KVCacheGroupSpec(
        list(source),
        _wrap(source),
        host_resident=True,
        role=KVCacheGroupRole.HISPARSE_SOURCE,
    )
    indexer_group = KVCacheGroupSpec(
        list(indexer), _wrap(indexer), role=KVCacheGroupRole.HISPARSE_INDEXER
    )
    return [source_group, indexer_group, *resident_groups, *hot_groups]


def get_hisparse_host_pool_bytes(vllm_config: Any) -> int:
    """The host pool's budget: the HiSparseConnector's ``host_pool_gib``, in bytes."""
    gib = hisparse_host_pool_gib(vllm_config)
    if gib is None:
        raise ValueError(
            "kv_transfer_config: HiSparse needs a HiSparseConnector with host_pool_gib, got none"
        )
    return int(gib * 2**30)


def create_hisparse_layout(
    vllm_config: Any, groups: list[KVCacheGroupSpec], host_budget: int
) -> HiSparseLayout:
    """Size the host pool (``host_budget`` bytes) for groups from
    :func:`get_hisparse_kv_cache_groups`. Every computed page needs a host block, so one
    ``max_model_len`` request plus the null block and a copy-on-write tail must fit
    (``ValueError`` otherwise)."""
    host = [g for g in groups if g.host_resident]
    if len(host) != 1:
        raise ValueError(f"groups: expected one host-resident source group, got {len(host)}")
    source = host[0]
    shared = use_shared_hisparse_host_pool(vllm_config)
    stride = get_hisparse_host_block_stride(
        source.kv_cache_spec.page_size_bytes, use_shared_host_pool=shared
    )
    host_num_blocks = host_budget // stride
    needed = cdiv(vllm_config.model_config.max_model_len, source.kv_cache_spec.block_size) + 2
    if host_num_blocks < needed:
        raise ValueError(
            f"host_budget: the HiSparse host pool has {host_num_blocks} blocks but "
            f"max_model_len needs {needed}; increase host_pool_gib"
        )
    return HiSparseLayout(
        source_group=source,
        device_groups=[g for g in groups if not g.host_resident],
        host_num_blocks=host_num_blocks,
        host_block_stride=stride,
        shared_host_pool=shared,
    )


def get_hisparse_steady_state_concurrency(
    vllm_config: Any, kv_cache_config: KVCacheConfig
) -> float:
    """Requests of ``max_model_len`` tokens that fit once running ones read from host.

    A running request pins only its last :data:`ACTIVE_TAIL_PAGES` resident pages, but the
    newest one still takes its whole admission (every device group's pages): all but one at
    steady state, plus one being admitted; at most the host pool's limit.
    """
    admission = steady = host = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        pages = cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)
        if group.host_resident:
            host += pages
            continue
        admission += pages
        steady += min(pages, ACTIVE_TAIL_PAGES) if isinstance(spec, HiSparseResidentSpec) else pages
    if kv_cache_config.hisparse_host_num_blocks is None:
        raise ValueError(
            "kv_cache_config.hisparse_host_num_blocks: expected the host pool's pages, got None"
        )
    num_blocks = kv_cache_config.num_blocks
    if num_blocks < admission:
        device = num_blocks / admission
    else:
        device = 1 + (num_blocks - admission) / steady
    return min(device, kv_cache_config.hisparse_host_num_blocks / host)


def get_hisparse_kv_cache_config(
    vllm_config: Any,
    kv_cache_groups: list[KVCacheGroupSpec],
    available_memory: int,
    host_budget: int,
) -> KVCacheConfig:
    """HiSparse's config: the device groups share one block-outermost pool (a block is as wide
    as the widest group's pages, rounded to every page's alignment and the hot pages) of the
    most blocks ``available_memory`` holds (or
    ``num_gpu_blocks_override``); the source group fills the host pool (``host_budget``)."""
    layout = create_hisparse_layout(vllm_config, kv_cache_groups, host_budget)
    cache_config = vllm_config.cache_config
    # An unresolved layout (v0.22 callers) gets the layout HiSparse's pool was built for.
    device_layout = (
        KVCacheLayout.BLHNC
        if getattr(cache_config, "kv_cache_layout", None) is None
        else cache_config.get_resolved_kv_cache_layout()
    )
    if not device_layout.is_block_outermost:
        raise ValueError(
            f"kv_cache_layout: HiSparse needs a block-outermost layout (BLHNC, BLNHC), got "
            f"{device_layout.name}"
        )
    block_bytes = kv_cache_bytes_per_block(layout.device_groups, device_layout)
    override = cache_config.num_gpu_blocks_override
    num_blocks = available_memory // block_bytes if override is None else override
    tensors = _build_hisparse_kv_cache_tensors(
        layout.device_groups, num_blocks, block_bytes * num_blocks, device_layout, block_bytes
    )
    source = layout.source_group
    tensors[:0] = _build_hisparse_kv_cache_tensors(
        [source],
        layout.host_num_blocks,
        layout.host_block_stride * layout.host_num_blocks,
        KVCacheLayout.LBNHC,
        layout.host_block_stride,
        host_resident=True,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[source, *layout.device_groups],
        hisparse_host_num_blocks=layout.host_num_blocks,
        hisparse_host_block_stride=layout.host_block_stride,
        hisparse_shared_host_pool=layout.shared_host_pool,
    )
