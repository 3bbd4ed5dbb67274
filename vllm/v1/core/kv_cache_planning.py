"""KV-cache planning at upstream v0.33's path: per-layer specs of every worker → groups for the
whole model → one ``KVCacheConfig`` per worker, consistent across workers.

The steps live in their own modules and are re-exported here under upstream's names:
grouping in :mod:`vllm.v1.core.kv_cache_grouping` (page sizes through
:mod:`vllm.v1.core.page_size_unification`, DeepSeek-V4 in
:mod:`vllm.v1.core.kv_cache_deepseek_v4`), memory and blocks in
:mod:`vllm.v1.core.kv_cache_sizing`, HiSparse's groups and pools in
:mod:`vllm.v1.hisparse.layout`. This module holds the flow that ties them together: HiSparse
first when it is on, the pluggable builder (:mod:`vllm.v1.core.kv_cache_config_builder`), the
global grouping, the per-worker configs and the capacity report.

Units: memory and page sizes in bytes, lengths in tokens, ``num_blocks`` in pages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import replace
from functools import partial, reduce
from typing import TYPE_CHECKING, cast

from vllm.v1.core import kv_cache_grouping, kv_cache_sizing
from vllm.v1.core.kv_cache_config_builder import KVCacheConfigBuilder, get_kv_cache_config_builder
from vllm.v1.core.kv_cache_deepseek_v4 import _approximate_gcd
from vllm.v1.core.kv_cache_grouping import (
    UPSTREAM_LAYOUT,
    KVCacheLayoutPolicy,
    _project_kv_cache_groups_to_worker,
    create_kv_cache_group_specs,
    generate_scheduler_kv_cache_config,
    get_packed_kv_cache_groups,
    get_uniform_page_size,
    is_kv_cache_spec_uniform,
    is_kv_cache_type_attention_free,
    unify_hybrid_kv_cache_specs,
)
from vllm.v1.core.kv_cache_sizing import (
    _auto_fit_max_model_len,
    _check_enough_kv_cache_memory,
    _estimate_max_model_len_from_groups,
    _get_kv_cache_bytes_per_block,
    _max_memory_usage_bytes_from_groups,
    _pool_bytes_per_block,
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    get_max_concurrency_for_kv_cache_config,
    max_memory_usage_bytes,
    may_override_num_blocks,
)
from vllm.v1.core.page_size_unification import unify_kv_cache_spec_page_size
from vllm.v1.hisparse.layout import (
    get_hisparse_host_pool_bytes,
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    iter_layer_specs,
)
from vllm.v1.kv_cache_spec_base import KVCacheSpecMergeError

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig

logger = logging.getLogger(__name__)

__all__ = [
    "DefaultKVCacheConfigBuilder",
    "KVCacheGroupingError",
    "KVCacheConfigBuilder",
    "_approximate_gcd",
    "_auto_fit_max_model_len",
    "_check_enough_kv_cache_memory",
    "_estimate_max_model_len_from_groups",
    "_get_kv_cache_bytes_per_block",
    "_get_packed_kv_cache_groups",
    "_max_memory_usage_bytes_from_groups",
    "_pool_bytes_per_block",
    "_pool_bytes_per_block_from_builder",
    "_project_kv_cache_groups_to_worker",
    "check_enough_kv_cache_memory",
    "create_kv_cache_group_specs",
    "estimate_max_model_len",
    "generate_scheduler_kv_cache_config",
    "get_global_kv_cache_groups",
    "get_kv_cache_capacity",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_configs",
    "get_kv_cache_groups",
    "get_kv_cache_groups_from_builder",
    "get_max_concurrency_for_kv_cache_config",
    "get_uniform_page_size",
    "is_kv_cache_spec_uniform",
    "is_kv_cache_type_attention_free",
    "kv_cache_groups_tp_replicas",
    "max_memory_usage_bytes",
    "may_override_num_blocks",
    "unify_hybrid_kv_cache_specs",
    "unify_kv_cache_spec_page_size",
]


_get_packed_kv_cache_groups = get_packed_kv_cache_groups
"""Upstream v0.33's name of :func:`~vllm.v1.core.kv_cache_grouping.get_packed_kv_cache_groups`."""


def _hisparse_on(vllm_config: VllmConfig) -> bool:
    attention_config = getattr(vllm_config, "attention_config", None)
    return attention_config is not None and attention_config.hisparse_config is not None


def get_kv_cache_groups(
    vllm_config: VllmConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    *,
    policy: KVCacheLayoutPolicy = UPSTREAM_LAYOUT,
) -> list[KVCacheGroupSpec]:
    """Groups of layers sharing a block table: HiSparse's when it is on (the other layers
    grouped as usual), else :func:`vllm.v1.core.kv_cache_grouping.get_kv_cache_groups`."""
    scheduler = vllm_config.scheduler_config
    if scheduler is not None and scheduler.disable_hybrid_kv_cache_manager:
        unify_hybrid_kv_cache_specs(kv_cache_spec)
    if is_kv_cache_type_attention_free(kv_cache_spec):
        return []

    def group_others(config: VllmConfig, specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
        return kv_cache_grouping.get_kv_cache_groups(config, specs, policy=policy)

    hisparse = get_hisparse_kv_cache_groups(vllm_config, kv_cache_spec, group_others)
    if hisparse:
        return hisparse
    return group_others(vllm_config, kv_cache_spec)


def get_kv_cache_config_from_groups(
    vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec], available_memory: int
) -> KVCacheConfig:
    """The config with the most blocks that fit in ``available_memory`` bytes (or the
    override): HiSparse's device and host pools when it is on. As upstream v0.33, the cache
    layout must be resolved (``cache_config.kv_cache_layout``) unless there are no groups or
    HiSparse places them: ``ValueError`` otherwise."""
    layout_free = not kv_cache_groups or _hisparse_on(vllm_config)
    if not layout_free and vllm_config.cache_config.kv_cache_layout is None:
        raise ValueError(
            "cache_config.kv_cache_layout: the KV cache layout has not been resolved (None); "
            "resolve_kv_cache_layout sets it once from the backends, or set it explicitly"
        )
    return _config_from_groups(vllm_config, kv_cache_groups, available_memory)


def _config_from_groups(
    vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec], available_memory: int
) -> KVCacheConfig:
    """:func:`get_kv_cache_config_from_groups` that also plans an unresolved layout v0.22's
    way: the cross-worker flow, which v0.22's ``kv_cache_utils.get_kv_cache_configs`` callers
    reach without a layout."""
    if kv_cache_groups and _hisparse_on(vllm_config):
        return get_hisparse_kv_cache_config(
            vllm_config,
            kv_cache_groups,
            available_memory,
            get_hisparse_host_pool_bytes(vllm_config),
        )
    return kv_cache_sizing.get_kv_cache_config_from_groups(
        vllm_config, kv_cache_groups, available_memory
    )


class DefaultKVCacheConfigBuilder(KVCacheConfigBuilder):
    """The default placement: this module's grouping and sizing. ``policy`` picks the grouping
    rules (upstream's by default; the ``vllm-kv plan`` planner passes its own)."""

    def __init__(self, policy: KVCacheLayoutPolicy = UPSTREAM_LAYOUT) -> None:
        self.policy = policy

    def get_kv_cache_groups(
        self, vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
    ) -> list[KVCacheGroupSpec]:
        """The model's own grouping when its class groups its layers (upstream v0.33's
        ``SupportsKVCacheGrouping``: ``model_config.supports_kv_cache_grouping``), else this
        module's. ``ValueError`` for a model grouping with HiSparse (which groups itself)."""
        model_config = vllm_config.model_config
        if getattr(model_config, "supports_kv_cache_grouping", False) is not True:
            return get_kv_cache_groups(vllm_config, kv_cache_spec, policy=self.policy)
        if _hisparse_on(vllm_config):
            raise ValueError(
                "attention_config.hisparse_config: expected no HiSparse with a model that groups "
                "its own KV cache layers (HiSparse groups them itself), got HiSparse on"
            )
        assert model_config is not None
        model_cls, _ = model_config.registry.resolve_model_cls(
            model_config.architectures, model_config
        )
        return model_cls.get_kv_cache_groups(vllm_config, kv_cache_spec)

    def get_kv_cache_config_from_groups(
        self, vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec], num_blocks: int
    ) -> KVCacheConfig:
        if not kv_cache_groups:
            return _config_from_groups(vllm_config, kv_cache_groups, 0)
        memory = num_blocks * self.pool_bytes_per_block(vllm_config, kv_cache_groups)
        return _config_from_groups(vllm_config, kv_cache_groups, memory)

    def pool_bytes_per_block(
        self, vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec]
    ) -> int:
        """Device bytes one block id costs: the hook's answer, else this library's measure."""
        hooked = self._get_pool_bytes_per_block(vllm_config, kv_cache_groups)
        if hooked is not None:
            return hooked
        device = [g for g in kv_cache_groups if not g.host_resident]
        if _hisparse_on(vllm_config):
            return max(g.kv_cache_spec.page_size_bytes * _pack(g) for g in device)
        return _pool_bytes_per_block(vllm_config, device)


def _pack(group: KVCacheGroupSpec) -> int:
    """Layers of a group whose pages share one block (1 for a wrapping group spec, whose page
    already counts every layer)."""
    return 1 if len(group.kv_cache_spec.layer_specs()) > 1 else len(group.layer_names)


def _pool_bytes_per_block_from_builder(
    builder: KVCacheConfigBuilder, vllm_config: VllmConfig, groups: list[KVCacheGroupSpec]
) -> int:
    """Device bytes per block id under ``builder`` (0 without groups): the builder's declared
    ``_get_pool_bytes_per_block``, else the default placement's measure, else the one backing
    of a one-block probe placed with ``num_gpu_blocks_override`` suppressed (v0.22's aliasing
    tensors: their sizes summed). ``ValueError`` for a probe with several device backings."""
    if not groups:
        return 0
    hooked = builder._get_pool_bytes_per_block(vllm_config, groups)
    if hooked is not None:
        return hooked
    default_placement = DefaultKVCacheConfigBuilder.get_kv_cache_config_from_groups
    if type(builder).get_kv_cache_config_from_groups is default_placement:
        # The default placement's own measure (what its probe would give, HiSparse's too).
        return cast(DefaultKVCacheConfigBuilder, builder).pool_bytes_per_block(vllm_config, groups)
    cache_config = vllm_config.cache_config
    saved, cache_config.num_gpu_blocks_override = cache_config.num_gpu_blocks_override, None
    try:
        probe = builder.get_kv_cache_config_from_groups(vllm_config, groups, 1)
    finally:
        cache_config.num_gpu_blocks_override = saved
    device = [t for t in probe.kv_cache_tensors if not t.host_resident]
    if all(t.block_stride is None for t in device):
        return sum(t.size for t in device)
    sizes = {t.size for t in device}
    if len(sizes) != 1:
        raise ValueError(
            f"kv_cache_tensors: expected one device backing for a block, got sizes "
            f"{sorted(sizes)}; a placement with several device allocations declares its bytes "
            "per block in KVCacheConfigBuilder._get_pool_bytes_per_block()"
        )
    return sizes.pop()


class KVCacheGroupingError(ValueError, AssertionError):
    """Groups that do not partition the layers: a ``ValueError`` like every planning error
    here, and an ``AssertionError`` as upstream raises."""


def _check_exact_partition(
    groups: list[KVCacheGroupSpec], kv_cache_spec: dict[str, KVCacheSpec]
) -> None:
    """:class:`KVCacheGroupingError` unless every layer of ``kv_cache_spec`` is in exactly one
    group (HiSparse's derived resident and hot layers aside)."""
    names = [n for g in groups for n in g.layer_names if n in kv_cache_spec]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    missing = sorted(set(kv_cache_spec) - set(names))
    if duplicated or missing:
        raise KVCacheGroupingError(
            f"kv_cache_groups: expected every layer in exactly one group, got group overlaps "
            f"{duplicated} and groups that miss layers {missing}"
        )


def get_kv_cache_groups_from_builder(
    builder: KVCacheConfigBuilder, vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """``builder``'s groups, checked to partition the layers."""
    groups = builder.get_kv_cache_groups(vllm_config, kv_cache_spec)
    _check_exact_partition(groups, kv_cache_spec)
    return groups


def _merge_worker_specs(kv_cache_specs: Sequence[dict[str, KVCacheSpec]]) -> dict[str, KVCacheSpec]:
    merged: dict[str, KVCacheSpec] = {}
    for worker_spec in kv_cache_specs:
        for name, spec in worker_spec.items():
            if merged.setdefault(name, spec) != spec:
                raise KVCacheSpecMergeError(
                    f"kv_cache_specs: layer {name!r} has different specs on different workers: "
                    f"{merged[name]!r} vs {spec!r}"
                )
    return merged


def get_global_kv_cache_groups(
    vllm_config: VllmConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    *,
    policy: KVCacheLayoutPolicy = UPSTREAM_LAYOUT,
) -> list[KVCacheGroupSpec]:
    """Groups for the whole model: every worker's specs merged (a layer must have one spec
    everywhere), sliding windows told how many extra tokens a drafter reading past the
    computed range keeps (``num_prefill_lookahead_tokens - 1``, upstream's
    ``extra_retained_tokens`` where the spec has it), then grouped by the builder."""
    builder = get_kv_cache_config_builder(vllm_config)
    if isinstance(builder, DefaultKVCacheConfigBuilder):
        builder.policy = policy
    merged = _merge_worker_specs(kv_cache_specs)
    extra = max(0, vllm_config.num_prefill_lookahead_tokens - 1)
    for name, spec in merged.items():
        if extra and isinstance(spec, SlidingWindowSpec) and hasattr(spec, "extra_retained_tokens"):
            merged[name] = replace(spec, extra_retained_tokens=extra)
    groups = get_kv_cache_groups_from_builder(builder, vllm_config, merged)
    _mark_eagle_groups(vllm_config, merged, groups)
    return groups


def _mark_eagle_groups(
    vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], groups: list[KVCacheGroupSpec]
) -> None:
    """With EAGLE block drop, flag (in place) the groups holding a layer tagged ``is_draft``
    (``is_eagle_group``); warn when none is flagged but Mamba groups exist, since the drafter's
    states then cannot be told apart from the target's."""
    spec_config = vllm_config.speculative_config
    if spec_config is None or not spec_config.use_eagle_block_drop():
        return
    drafts = {name for name, spec in specs.items() if spec.is_draft}
    for group in groups:
        group.is_eagle_group = group.is_eagle_group or not drafts.isdisjoint(group.layer_names)
    if any(g.is_eagle_group for g in groups):
        return
    if any(isinstance(s, MambaSpec) for g in groups for s in iter_layer_specs(g.kv_cache_spec)):
        logger.warning(
            "Speculative decoding (method=%s) is on but no KV cache group could be identified "
            "as the draft model's: tag the draft layers' specs is_draft=True",
            spec_config.method,
        )


def _layer_tp_replicas(spec: KVCacheSpec, tp_size: int, dcp_size: int) -> int:
    if not isinstance(spec, AttentionSpec) or spec.max_tp_shards is None:
        return 1
    if spec.dcp_sharded and dcp_size > 1:
        return 1
    return max(1, tp_size // spec.max_tp_shards)


def kv_cache_groups_tp_replicas(
    groups: list[KVCacheGroupSpec], tp_size: int, dcp_size: int = 1
) -> int:
    """Consecutive tensor-parallel ranks holding identical KV for every layer (1: none)."""
    specs = [spec for g in groups for spec in g.kv_cache_spec.layer_specs()]
    if not specs:
        return 1
    return reduce(math.gcd, (_layer_tp_replicas(s, tp_size, dcp_size) for s in specs), tp_size)


def get_kv_cache_configs(
    vllm_config: VllmConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
    global_kv_cache_groups: list[KVCacheGroupSpec] | None = None,
    *,
    policy: KVCacheLayoutPolicy = UPSTREAM_LAYOUT,
) -> list[KVCacheConfig]:
    """One config per worker, consistent across workers (one scheduler serves them all).

    ``global_kv_cache_groups`` come from :func:`get_global_kv_cache_groups` (computed here
    when omitted, v0.22's signature). Each worker gets the groups restricted to its layers
    (pipeline stages); ``num_gpu_blocks_override`` replaces the budget; the null block the
    pool holds back is left out of the checks (and of auto-fitting ``max_model_len`` when
    ``original_max_model_len`` is -1); every worker must hold one request of
    ``max_model_len``; all take the smallest ``num_blocks``.
    """
    if global_kv_cache_groups is None:
        global_kv_cache_groups = get_global_kv_cache_groups(
            vllm_config, kv_cache_specs, policy=policy
        )
    if len(available_memory) != len(kv_cache_specs):
        raise ValueError(
            f"available_memory: expected one budget per worker ({len(kv_cache_specs)}), got "
            f"{len(available_memory)}"
        )
    builder = get_kv_cache_config_builder(vllm_config)
    if isinstance(builder, DefaultKVCacheConfigBuilder):
        builder.policy = policy
    projected = [
        _project_kv_cache_groups_to_worker(global_kv_cache_groups, spec) for spec in kv_cache_specs
    ]
    per_block = [_pool_bytes_per_block_from_builder(builder, vllm_config, g) for g in projected]
    override = vllm_config.cache_config.num_gpu_blocks_override
    if override is not None:
        available_memory = [
            override * b if g else m
            for g, b, m in zip(projected, per_block, available_memory, strict=True)
        ]
    check_memory = [m - b for m, b in zip(available_memory, per_block, strict=True)]
    assert vllm_config.model_config is not None
    if vllm_config.model_config.original_max_model_len == -1:
        _auto_fit_max_model_len(vllm_config, projected, check_memory)
    for groups, memory in zip(projected, check_memory, strict=True):
        if groups:
            _check_enough_kv_cache_memory(
                memory,
                partial(_max_memory_usage_bytes_from_groups, vllm_config, groups),
                vllm_config.model_config.max_model_len or 0,
                partial(_estimate_max_model_len_from_groups, vllm_config, groups),
            )
    configs = []
    for groups, worker_spec, memory, block_bytes in zip(
        projected, kv_cache_specs, available_memory, per_block, strict=True
    ):
        _check_exact_partition(groups, worker_spec)
        num_blocks = memory // block_bytes if groups else 1
        configs.append(builder.get_kv_cache_config_from_groups(vllm_config, groups, num_blocks))
    min_blocks = min(cfg.num_blocks for cfg in configs)
    configs = [
        cfg
        if cfg.num_blocks == min_blocks
        else builder.get_kv_cache_config_from_groups(vllm_config, cfg.kv_cache_groups, min_blocks)
        for cfg in configs
    ]
    parallel = vllm_config.parallel_config
    for cfg in configs:
        cfg.kv_tp_replicas = kv_cache_groups_tp_replicas(
            cfg.kv_cache_groups,
            parallel.tensor_parallel_size,
            parallel.decode_context_parallel_size,
        )
    return configs


def get_kv_cache_capacity(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[int, float]:
    """``(tokens, requests)``: the cache's capacity in tokens (``max_model_len`` x the
    concurrency, truncated) and the concurrency of ``max_model_len`` requests."""
    assert vllm_config.model_config is not None
    max_model_len = vllm_config.model_config.max_model_len
    if max_model_len is None:
        raise ValueError("vllm_config.model_config.max_model_len: expected tokens, got None")
    concurrency = get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config)
    return int(concurrency * max_model_len), concurrency
