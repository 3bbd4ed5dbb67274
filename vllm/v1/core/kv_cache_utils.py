"""Upstream's KV-cache utilities under their import path (v0.33's block-table, DCP, event and
capacity helpers; v0.22's planning names, whose v0.33 home is
:mod:`vllm.v1.core.kv_cache_planning`, kept as re-exports), and the planner: per-layer specs →
groups → ``KVCacheConfig`` for a memory budget.

Units: ``block_size`` is in tokens per page; memory, page sizes and every ``*_bytes`` quantity
are in bytes; ``available_memory`` is the KV-cache budget of **one** tensor-parallel rank.

The planning names live in :mod:`vllm.v1.core.kv_cache_planning` (the cross-worker flow,
HiSparse, the builder), :mod:`vllm.v1.core.kv_cache_grouping` (layers → groups, page-size
unification through :mod:`vllm.v1.core.page_size_unification`),
:mod:`vllm.v1.core.kv_cache_deepseek_v4` (DeepSeek-V4's layer-tuple groups) and
:mod:`vllm.v1.core.kv_cache_sizing` (memory, blocks, per-worker configs) and are re-exported
here. The planner below is a user of them: it groups with :data:`PLANNER_LAYOUT` (fewest groups
with ≤ 5 % empty group slots, pages that need not divide each other; upstream's rules are
:data:`UPSTREAM_LAYOUT`, the default of the upstream functions) and sizes with the same
functions the engine path uses, from a :class:`~vllm.config.VllmConfig` it builds from its
arguments.

``num_blocks`` = ``available_memory // (bytes one block id takes over all tensors)``; each
tensor's size is ``num_blocks × its page size``. A request of ``max_model_len`` needs, per group,
``cdiv(spec.max_memory_usage_bytes(vllm_config), page)`` blocks.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from vllm.config.cache import CacheConfig
from vllm.config.model import ModelConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.config.vllm import VllmConfig
from vllm.kv_quant.formats import AUTO
from vllm.utils import check_positive_int
from vllm.v1.core import block_hashing
from vllm.v1.core.block_hashing import (
    DEFAULT_NONE_HASH_SEED,
    BlockHash,
    BlockHashList,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    ExternalBlockHash,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_none_hash_seed,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
    need_extra_keys,
    resolve_block_hashes,
    resolve_none_hash_seed,
    to_event_extra_keys,
)
from vllm.v1.core.kv_bytes import kv_bytes_for_tokens, spec_bytes_per_token, total_state_bytes
from vllm.v1.core.kv_cache_block import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    KVCacheBlockCopy,
    null_head_len,
    trim_null_head,
)
from vllm.v1.core.kv_cache_deepseek_v4 import (
    _annotate_eagle_groups_deepseek_v4,
    _approximate_gcd,
    _get_kv_cache_groups_uniform_groups,
    group_and_unify_kv_cache_specs,
)
from vllm.v1.core.kv_cache_grouping import (
    PLANNER_LAYOUT,
    UPSTREAM_LAYOUT,
    KVCacheLayoutPolicy,
    _project_kv_cache_groups_to_worker,
    create_kv_cache_group_specs,
    generate_scheduler_kv_cache_config,
    get_uniform_page_size,
    is_kv_cache_page_size_uniform,
    is_kv_cache_spec_uniform,
    is_kv_cache_type_attention_free,
    unify_hybrid_kv_cache_specs,
)
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_capacity,
    get_kv_cache_configs,
    get_kv_cache_groups,
)

# get_kv_cache_config_from_groups here is v0.22's planner (v0.22 exported it from this module);
# v0.33's, in kv_cache_planning, refuses the unresolved layout v0.22 callers and `vllm-kv plan`
# still hand it.
from vllm.v1.core.kv_cache_sizing import (
    InsufficientKVCacheMemoryError,
    _auto_fit_max_model_len,
    _check_enough_kv_cache_memory,
    _estimate_max_model_len_from_groups,
    _get_kv_cache_config_deepseek_v4,
    _max_memory_usage_bytes_from_groups,
    _pool_bytes_per_block,
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    get_kv_cache_config_from_groups,
    get_max_concurrency_for_kv_cache_config,
    get_num_blocks,
    kv_cache_memory_for_blocks,
    max_memory_usage_bytes,
    may_override_num_blocks,
    partial_hash_hits_enabled,
    resolve_dcp_kv_block_size,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.model_config import load_model_config
from vllm.v1.core.model_families import parse_model_layout
from vllm.v1.core.model_specs import ModelKVSpecs, build_kv_cache_specs
from vllm.v1.core.page_size_unification import (
    MAX_EXACT_PAGE_GROWTH,
    MAX_PAGE_GROWTH,
    PageSizeUnificationError,
    unify_kv_cache_spec_page_size,
)
from vllm.v1.core.single_type_kv_cache_manager import manager_class_of
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
    iter_layer_specs,
)

__all__ = [
    "KVCacheBlockCopy",
    "resolve_cache_hit_alignment_tokens",
    "DEFAULT_NONE_HASH_SEED",
    "get_none_hash_seed",
    "resolve_none_hash_seed",
    "resolve_block_hashes",
    "trim_null_head",
    "to_event_extra_keys",
    "resolve_dcp_kv_cache_spec",
    "partial_hash_hits_enabled",
    "resolve_dcp_kv_block_size",
    "null_head_len",
    "BlockHash",
    "BlockHashList",
    "BlockHashListWithBlockSize",
    "BlockHashWithGroupId",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "ExternalBlockHash",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "generate_block_hash_extra_keys",
    "get_block_hash",
    "get_group_id",
    "get_request_block_hasher",
    "hash_block_tokens",
    "init_none_hash",
    "make_block_hash_with_group_id",
    "maybe_convert_block_hash",
    "need_extra_keys",
    "InsufficientKVCacheMemoryError",
    "KVCacheLayoutPolicy",
    "KVCachePlan",
    "MAX_EXACT_PAGE_GROWTH",
    "MAX_GROUP_PADDING",
    "MAX_PAGE_GROWTH",
    "PLANNER_LAYOUT",
    "PageSizeUnificationError",
    "UPSTREAM_LAYOUT",
    "_annotate_eagle_groups_deepseek_v4",
    "_approximate_gcd",
    "_auto_fit_max_model_len",
    "_check_enough_kv_cache_memory",
    "_estimate_max_model_len_from_groups",
    "_get_kv_cache_config_deepseek_v4",
    "_get_kv_cache_groups_uniform_groups",
    "_max_memory_usage_bytes_from_groups",
    "_pool_bytes_per_block",
    "_project_kv_cache_groups_to_worker",
    "blocks_per_request",
    "bytes_per_block",
    "check_enough_kv_cache_memory",
    "create_kv_cache_group_specs",
    "estimate_max_model_len",
    "generate_scheduler_kv_cache_config",
    "get_global_kv_cache_groups",
    "get_kv_cache_capacity",
    "get_kv_cache_config",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_configs",
    "get_kv_cache_groups",
    "get_max_concurrency_for_kv_cache_config",
    "get_num_blocks",
    "get_uniform_page_size",
    "group_and_unify_kv_cache_specs",
    "is_kv_cache_page_size_uniform",
    "is_kv_cache_spec_uniform",
    "is_kv_cache_type_attention_free",
    "iter_layer_specs",
    "kv_cache_memory_for_blocks",
    "max_memory_usage_bytes",
    "may_override_num_blocks",
    "plan_kv_cache",
    "plan_kv_cache_for_specs",
    "planner_vllm_config",
    "resolve_kv_cache_block_sizes",
    "unify_hybrid_kv_cache_specs",
    "unify_kv_cache_spec_page_size",
]

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""Tokens scheduled per step (chunked-prefill chunk); bounds a sliding window's pages."""

MAX_GROUP_PADDING = PLANNER_LAYOUT.max_group_padding
"""Largest fraction of empty group slots the planner's group-size choice accepts."""


def resolve_dcp_kv_cache_spec(spec: KVCacheSpec, dcp_world_size: int) -> KVCacheSpec:
    """``spec`` with the block size :func:`resolve_dcp_kv_block_size` gives (its layers' too
    for a wrapping spec); ``spec`` itself when that does not change it."""
    block_size = resolve_dcp_kv_block_size(spec, dcp_world_size)
    if block_size == spec.block_size:
        return spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return replace(
            spec,
            block_size=block_size,
            kv_cache_specs={
                name: resolve_dcp_kv_cache_spec(layer, dcp_world_size)
                for name, layer in spec.kv_cache_specs.items()
            },
        )
    return replace(spec, block_size=block_size)


def resolve_cache_hit_alignment_tokens(
    kv_cache_config: KVCacheConfig,
    vllm_config: VllmConfig,
    scheduler_block_size: int,
    hash_block_size: int,
) -> int:
    """Where prefix-cache hits may end (tokens), as the hybrid coordinator tells its managers:
    every ``hash_block_size`` tokens when hits may end inside a page
    (:func:`~vllm.v1.core.kv_cache_sizing.partial_hash_hits_enabled`), else every
    ``scheduler_block_size``; always the latter without prefix caching or with one group."""
    groups = kv_cache_config.kv_cache_groups
    if not vllm_config.cache_config.enable_prefix_caching or len(groups) <= 1:
        return scheduler_block_size
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    classes = [manager_class_of(group.kv_cache_spec) for group in groups]
    if partial_hash_hits_enabled(groups, hash_block_size, dcp, classes):
        return hash_block_size
    return scheduler_block_size


def planner_vllm_config(
    max_model_len: int, max_num_batched_tokens: int | None = None
) -> VllmConfig:
    """The ``VllmConfig`` the planner sizes with: ``max_model_len`` tokens per request and
    ``max_num_batched_tokens`` per step (None: a whole request per step)."""
    batched = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
    return VllmConfig(
        model_config=ModelConfig(max_model_len=max_model_len),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=batched, max_model_len=max_model_len
        ),
    )


def bytes_per_block(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Bytes one block id takes across all tensors (the sum of the tensors' page sizes)."""
    return _pool_bytes_per_block(list(groups))


def blocks_per_request(
    groups: Sequence[KVCacheGroupSpec],
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> int:
    """Block ids one request of ``max_model_len`` tokens needs, summed over groups (each group
    from its spec's ``max_memory_usage_bytes``; a Mamba group needs its state pages)."""
    config = planner_vllm_config(max_model_len, max_num_batched_tokens)
    needed = _max_memory_usage_bytes_from_groups(config, list(groups))
    return cdiv(needed, bytes_per_block(groups))


def get_kv_cache_config(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    max_model_len: int,
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> KVCacheConfig:
    """Groups (the planner's layout) + tensors for ``kv_cache_specs`` in ``available_memory``
    bytes; :class:`InsufficientKVCacheMemoryError` when not even one request of
    ``max_model_len`` tokens fits."""
    check_positive_int("max_model_len", max_model_len)
    config = planner_vllm_config(max_model_len, max_num_batched_tokens)
    groups = get_kv_cache_groups(config, dict(kv_cache_specs), policy=PLANNER_LAYOUT)
    if not groups:
        raise ValueError("kv_cache_specs: the model has no layer that needs a KV cache")
    _check_enough_kv_cache_memory(
        available_memory,
        lambda: _max_memory_usage_bytes_from_groups(config, groups),
        max_model_len,
        lambda memory: _estimate_max_model_len_from_groups(config, groups, memory),
    )
    return get_kv_cache_config_from_groups(config, groups, available_memory)


# --------------------------------------------------------------------------------------------
# A whole plan for a model


@dataclass(frozen=True, kw_only=True)
class KVCachePlan:
    """A KV-cache plan for one tensor-parallel rank.

    ``base`` holds the per-layer specs as mapped from the config; ``specs`` the specs as
    allocated (block sizes raised, pages padded). ``max_concurrency`` is the number of
    ``max_model_len`` requests the cache holds at once; ``token_capacity`` the context tokens
    they add up to (``floor(max_concurrency × max_model_len)``). ``page_padding_fraction`` is the
    share of page bytes that is padding; ``group_padding_fraction`` the share of empty group
    slots (a bound on memory lost to unequal group sizes).
    """

    model: str
    base: ModelKVSpecs
    specs: dict[str, KVCacheSpec]
    kv_cache_config: KVCacheConfig
    available_memory: int
    max_model_len: int
    max_num_batched_tokens: int | None
    tensor_parallel_size: int
    bytes_per_block: int
    blocks_per_request: int
    max_concurrency: float
    token_capacity: int
    memory_used: int
    page_padding_fraction: float
    group_padding_fraction: float

    @property
    def cache_dtype(self) -> str:
        return self.base.cache_dtype

    @property
    def fits(self) -> bool:
        """True when at least one request of ``max_model_len`` tokens fits."""
        return self.kv_cache_config.num_blocks >= self.blocks_per_request

    @property
    def bytes_per_request(self) -> int:
        """Bytes one request of ``max_model_len`` tokens occupies (whole blocks)."""
        return self.blocks_per_request * self.bytes_per_block

    def max_model_len_that_fits(self) -> int:
        """The longest request (tokens, ≤ ``max_model_len``) that fits; 0 when none does."""
        config = planner_vllm_config(self.max_model_len, self.max_num_batched_tokens)
        memory = self.kv_cache_config.num_blocks * self.bytes_per_block
        return _estimate_max_model_len_from_groups(
            config, self.kv_cache_config.kv_cache_groups, memory
        )

    @property
    def notes(self) -> tuple[str, ...]:
        return self.base.notes

    @property
    def kv_bytes_per_token(self) -> Fraction:
        """Allocated bytes per token over every attention-like layer (padding included)."""
        return sum((spec_bytes_per_token(s) for s in self.specs.values()), Fraction(0))

    def kv_bytes_for_tokens(self, num_tokens: int) -> int:
        """Logical bytes one sequence of ``num_tokens`` holds (no page rounding or padding)."""
        return kv_bytes_for_tokens(self.specs, num_tokens)

    @property
    def state_bytes_per_sequence(self) -> int:
        """Unpadded Mamba / linear-attention state bytes of one sequence."""
        return total_state_bytes(self.specs)

    @property
    def block_sizes(self) -> list[int]:
        """Distinct block sizes (tokens) of the groups, ascending."""
        groups = self.kv_cache_config.kv_cache_groups
        return sorted({g.kv_cache_spec.block_size for g in groups})

    @property
    def page_sizes(self) -> list[int]:
        """Distinct allocated page sizes (bytes) of the layers, ascending."""
        return sorted({s.page_size_bytes for s in self.specs.values()})

    def group_blocks_per_request(self, group: KVCacheGroupSpec) -> int:
        """Blocks one request of ``max_model_len`` tokens needs in ``group``."""
        return blocks_per_request([group], self.max_model_len, self.max_num_batched_tokens)


def plan_kv_cache(
    model: str | os.PathLike[str] | Mapping[str, Any],
    cache_config: CacheConfig | None,
    available_memory: int,
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    *,
    block_size: int | None = None,
) -> KVCachePlan:
    """Plan the KV cache of ``model`` (a preset name, a config.json path or a config dict).

    ``cache_config`` gives the cache dtype, the block size and the skip layers; when it is
    None the model defaults apply (``auto`` dtype, the model's default block size).
    ``block_size`` (tokens) overrides ``cache_config.block_size``. ``available_memory`` is the
    KV budget of one rank in bytes; ``max_model_len`` defaults to the config's
    ``max_position_embeddings``. Raises :class:`InsufficientKVCacheMemoryError` when not even
    one request fits, ``ValueError`` for configs or settings that cannot be mapped.
    """
    name, config = load_model_config(model)
    layout = parse_model_layout(config, tensor_parallel_size=tensor_parallel_size)
    if cache_config is None:
        cache_dtype, skip = AUTO.name, []
        block = block_size
    else:
        cache_dtype, skip = cache_config.cache_dtype, cache_config.kv_cache_dtype_skip_layers
        block = block_size if block_size is not None else cache_config.block_size
    base = build_kv_cache_specs(layout, cache_dtype, block, skip)
    return plan_kv_cache_for_specs(
        name, base, available_memory, max_model_len, max_num_batched_tokens
    )


def plan_kv_cache_for_specs(
    model: str,
    base: ModelKVSpecs,
    available_memory: int,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    *,
    require_fit: bool = True,
) -> KVCachePlan:
    """:func:`plan_kv_cache` for specs already built by ``build_kv_cache_specs``.

    With ``require_fit=False`` a budget too small for one request gives a plan whose
    ``fits`` is False instead of an error (for reports that compare several dtypes).
    """
    layout = base.layout
    if max_model_len is None:
        if layout.max_position_embeddings is None:
            raise ValueError("max_model_len: the config has no max_position_embeddings; pass one")
        max_model_len = layout.max_position_embeddings
    check_positive_int("max_model_len", max_model_len)
    if max_num_batched_tokens is not None:
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
    if isinstance(available_memory, bool) or not isinstance(available_memory, int):
        raise ValueError(f"available_memory: expected an int (bytes), got {available_memory!r}")
    if require_fit:
        config_out = get_kv_cache_config(
            base.specs, available_memory, max_model_len, max_num_batched_tokens
        )
    else:
        if available_memory < 0:
            raise ValueError(f"available_memory: expected ≥ 0 bytes, got {available_memory}")
        config = planner_vllm_config(max_model_len, max_num_batched_tokens)
        groups = get_kv_cache_groups(config, dict(base.specs), policy=PLANNER_LAYOUT)
        config_out = get_kv_cache_config_from_groups(config, groups, available_memory)
    groups = config_out.kv_cache_groups
    allocated = dict(iter_layer_specs(config_out))
    specs = {layer: allocated[layer] for layer in base.specs}
    per_block = bytes_per_block(groups)
    needed = blocks_per_request(groups, max_model_len, max_num_batched_tokens)
    page_bytes = sum(s.page_size_bytes for s in specs.values())
    real_bytes = sum(_real_page(s) for s in specs.values())
    slots = len(groups) * max(len(g.layer_names) for g in groups) if len(groups) > 1 else 0
    return KVCachePlan(
        model=model,
        base=base,
        specs=specs,
        kv_cache_config=config_out,
        available_memory=available_memory,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        tensor_parallel_size=layout.tensor_parallel_size,
        bytes_per_block=per_block,
        blocks_per_request=needed,
        max_concurrency=config_out.num_blocks / needed,
        token_capacity=config_out.num_blocks * max_model_len // needed,
        memory_used=sum(t.size for t in config_out.kv_cache_tensors),
        page_padding_fraction=(page_bytes - real_bytes) / page_bytes,
        group_padding_fraction=(slots - len(specs)) / slots if slots else 0.0,
    )


def _real_page(spec: KVCacheSpec) -> int:
    return getattr(spec, "real_page_size_bytes", spec.page_size_bytes)


class _HashingNames(types.ModuleType):
    """This module, with ``NONE_HASH`` and ``tensor_data`` read from and written to
    :mod:`vllm.v1.core.block_hashing`.

    Why: upstream callers read ``kv_cache_utils.NONE_HASH`` after ``init_none_hash`` (a global
    the hashing module rebinds) and tests patch ``kv_cache_utils.tensor_data`` to count the
    prompt-embeds hashing; both must reach the module whose functions use them.
    """

    def __getattr__(self, name: str) -> Any:
        if name in _FORWARDED:
            return getattr(block_hashing, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FORWARDED:
            setattr(block_hashing, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in _FORWARDED:
            delattr(block_hashing, name)
        else:
            super().__delattr__(name)


_FORWARDED = frozenset({"NONE_HASH", "tensor_data"})
sys.modules[__name__].__class__ = _HashingNames
