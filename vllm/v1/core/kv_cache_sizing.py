"""Memory for KV-cache groups: upstream's sizing functions (pages for a budget, the memory one
request needs, the longest request that fits, per-worker configs), the one implementation the
planner (:mod:`vllm.v1.core.kv_cache_utils`) also uses.

Units: memory and page sizes in bytes, lengths in tokens, ``num_blocks`` in pages per tensor.
Once the cache layout is resolved (``cache_config.kv_cache_layout``), upstream v0.33's
tensors: every group overlays one backing of blocks as wide as the widest group's pages
(:func:`~vllm.v1.kv_cache_views.strided_kv_cache_tensors`). Before that, v0.22's tensors:
groups draw block ids from one pool; tensor i holds layer i of every group, so a block id costs
``group_size x page`` bytes (the largest group's size times the common page); a single
``UniformTypeKVCacheSpecs`` group has one tensor per layer of that layer's own page;
DeepSeek-V4's several ``UniformTypeKVCacheSpecs`` groups share layer-tuple tensors, a block id
costing :attr:`~vllm.v1.core.kv_cache_deepseek_v4.LayerTupleLayout.bytes_per_block`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, cast

from vllm.utils import check_positive_int
from vllm.v1.core.kv_cache_deepseek_v4 import layer_tuple_layout
from vllm.v1.core.kv_cache_grouping import (
    UPSTREAM_LAYOUT,
    KVCacheLayoutPolicy,
    get_kv_cache_groups,
    get_uniform_page_size,
    resolved_layout,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
    iter_layer_specs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_cache_views import (
    check_layout_expresses_groups,
    kv_cache_bytes_per_block,
    strided_kv_cache_tensors,
)

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig

__all__ = [
    "InsufficientKVCacheMemoryError",
    "check_enough_kv_cache_memory",
    "estimate_max_model_len",
    "get_kv_cache_config_from_groups",
    "get_max_concurrency_for_kv_cache_config",
    "get_num_blocks",
    "kv_cache_memory_for_blocks",
    "max_memory_usage_bytes",
    "may_override_num_blocks",
    "resolve_kv_cache_block_sizes",
]


class InsufficientKVCacheMemoryError(ValueError):
    """Not even one request of ``max_model_len`` tokens fits the KV-cache budget.

    ``needed_bytes`` is what one such request needs under the planned layout,
    ``available_bytes`` the budget, ``max_model_len_that_fits`` the longest request that fits
    (0 when none does).
    """

    def __init__(
        self,
        message: str,
        *,
        needed_bytes: int,
        available_bytes: int,
        max_model_len: int,
        max_model_len_that_fits: int,
    ) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.max_model_len = max_model_len
        self.max_model_len_that_fits = max_model_len_that_fits


def _gib(num_bytes: int | float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _check_enough_kv_cache_memory(
    available_memory: int,
    get_needed_memory: Callable[[], int],
    max_model_len: int,
    estimate_max_model_len: Callable[[int], int],
) -> None:
    """:class:`InsufficientKVCacheMemoryError` (a ``ValueError``) when
    ``get_needed_memory()`` bytes exceed ``available_memory`` (also when no memory is left)."""
    needed = get_needed_memory()
    if needed <= available_memory:
        return
    fits = estimate_max_model_len(available_memory)
    hint = (
        f"the largest max_model_len that fits is {fits}"
        if fits
        else "not even a 1-token request fits"
    )
    raise InsufficientKVCacheMemoryError(
        f"available_memory: one request of the model's max seq len (max_model_len="
        f"{max_model_len} tokens) needs {needed} bytes ({_gib(needed)}) of KV cache, more than "
        f"the {available_memory} bytes ({_gib(available_memory)}) available; {hint}. Raise the "
        "memory budget, lower max_model_len, pick a smaller kv_cache_dtype or use more tensor "
        "parallelism.",
        needed_bytes=needed,
        available_bytes=available_memory,
        max_model_len=max_model_len,
        max_model_len_that_fits=fits,
    )


def _largest_fitting_len(vllm_config: VllmConfig, fits: Callable[[int], bool]) -> int:
    """The largest length in [1, max_model_len] for which ``fits`` holds (0 when none does),
    by binary search; ``model_config.max_model_len`` is restored afterwards."""
    model_config = vllm_config.model_config
    assert model_config is not None and model_config.max_model_len is not None
    original = model_config.max_model_len

    def fits_at(length: int) -> bool:
        model_config.max_model_len = length
        return fits(length)

    try:
        lo, hi = 0, original
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits_at(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo
    finally:
        model_config.max_model_len = original


def max_memory_usage_bytes(vllm_config: VllmConfig, kv_cache_specs: Iterable[KVCacheSpec]) -> int:
    """Sum of the specs' ``max_memory_usage_bytes`` (one request of ``max_model_len``)."""
    return sum(spec.max_memory_usage_bytes(vllm_config) for spec in kv_cache_specs)


def estimate_max_model_len(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec], available_memory: int
) -> int:
    """The largest ``max_model_len`` (≤ the configured one) whose one request fits in
    ``available_memory`` bytes, counting each layer on its own (no group layout); 0 when not
    even 1 token fits. ``vllm_config`` is left unchanged."""
    specs = kv_cache_spec.values()
    return _largest_fitting_len(
        vllm_config, lambda _: max_memory_usage_bytes(vllm_config, specs) <= available_memory
    )


def check_enough_kv_cache_memory(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec], available_memory: int
) -> None:
    """``ValueError`` (an :class:`InsufficientKVCacheMemoryError` when the budget is positive)
    unless one request of ``max_model_len`` tokens fits in ``available_memory`` bytes less the
    block the pool keeps as its null block; nothing to check for a model without KV cache."""
    if not kv_cache_spec:
        return
    assert vllm_config.model_config is not None
    # Grouping may unify the specs in place: group a copy.
    groups = get_kv_cache_groups(vllm_config, dict(kv_cache_spec))
    if groups:
        available_memory -= _pool_bytes_per_block(vllm_config, groups)
    _check_enough_kv_cache_memory(
        available_memory,
        lambda: max_memory_usage_bytes(vllm_config, kv_cache_spec.values()),
        vllm_config.model_config.max_model_len or 0,
        lambda memory: estimate_max_model_len(vllm_config, kv_cache_spec, memory),
    )


def get_max_concurrency_for_kv_cache_config(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> float:
    """Requests of ``max_model_len`` tokens the config's pages hold at once.

    A request takes ``cdiv(spec.max_memory_usage_bytes, spec.page_size_bytes)`` block ids of
    each group, and the device groups draw them from one pool, so its cost is their sum (the
    same for a worker's wrapping group spec and the scheduler's per-layer one). HiSparse's
    host groups draw from the host pool; the smaller of the two limits applies.
    """
    device_blocks = host_blocks = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        required = cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)
        if group.host_resident:
            host_blocks += required
        else:
            device_blocks += required
    limits = [kv_cache_config.num_blocks / device_blocks]
    if host_blocks:
        if kv_cache_config.hisparse_host_num_blocks is None:
            raise ValueError(
                "kv_cache_config.hisparse_host_num_blocks: expected pages for its host "
                "groups, got None"
            )
        limits.append(kv_cache_config.hisparse_host_num_blocks / host_blocks)
    return min(limits)


def may_override_num_blocks(vllm_config: VllmConfig, num_blocks: int) -> int:
    """``cache_config.num_gpu_blocks_override`` when set, else ``num_blocks``."""
    override = vllm_config.cache_config.num_gpu_blocks_override
    return num_blocks if override is None else override


def get_num_blocks(
    vllm_config: VllmConfig, num_layers: int, available_memory: int, page_size: int
) -> int:
    """Pages per tensor: ``available_memory // page_size // num_layers`` (≥ 0), or the
    override."""
    num_blocks = max(int(available_memory // page_size // num_layers), 0)
    return may_override_num_blocks(vllm_config, num_blocks)


def _get_kv_cache_bytes_per_block(
    kv_cache_groups: list[KVCacheGroupSpec], layout: KVCacheLayout
) -> int:
    """Upstream v0.33's name of :func:`~vllm.v1.kv_cache_views.kv_cache_bytes_per_block`."""
    return kv_cache_bytes_per_block(kv_cache_groups, layout)


def _pool_bytes_per_block(
    vllm_config: VllmConfig | list[KVCacheGroupSpec],
    kv_cache_groups: list[KVCacheGroupSpec] | None = None,
) -> int:
    """Bytes one block id takes over all tensors (the divisor turning memory into blocks).
    Upstream v0.33's call is ``(vllm_config, kv_cache_groups)``; v0.22's ``(kv_cache_groups)``
    (no resolved layout: groups never packed) is kept."""
    config: VllmConfig | None
    if kv_cache_groups is None:
        config, kv_cache_groups = None, cast("list[KVCacheGroupSpec]", vllm_config)
    else:
        config = cast("VllmConfig", vllm_config)
    cache_layout = resolved_layout(config)
    if cache_layout is not None:
        return kv_cache_bytes_per_block(kv_cache_groups, cache_layout)
    if len(kv_cache_groups) == 1 and isinstance(
        kv_cache_groups[0].kv_cache_spec, UniformTypeKVCacheSpecs
    ):
        return kv_cache_groups[0].kv_cache_spec.page_size_bytes
    layout = layer_tuple_layout(kv_cache_groups)
    if layout is not None:
        return layout.bytes_per_block
    group_size = max(len(g.layer_names) for g in kv_cache_groups)
    return get_uniform_page_size(g.kv_cache_spec for g in kv_cache_groups) * group_size


def kv_cache_memory_for_blocks(
    vllm_config: VllmConfig,
    kv_cache_specs: dict[str, KVCacheSpec],
    num_blocks: int,
    *,
    policy: KVCacheLayoutPolicy = UPSTREAM_LAYOUT,
) -> int:
    """Bytes of KV-cache memory that hold exactly ``num_blocks`` blocks of ``kv_cache_specs``
    (not upstream's): ``num_blocks`` times what one block id takes over all tensors under the
    layout ``get_kv_cache_groups`` gives these specs, so that
    ``get_kv_cache_configs(vllm_config, [kv_cache_specs], [that], policy=policy)`` has
    ``num_blocks`` (upstream's other way: ``cache_config.num_gpu_blocks_override``). 0 for an
    attention-free model; the caller's dict is not modified. ``ValueError`` naming
    ``num_blocks`` (not a positive int) or ``kv_cache_specs`` (not a dict of layer names to
    specs)."""
    check_positive_int("num_blocks", num_blocks)
    if not isinstance(kv_cache_specs, dict):
        raise ValueError(
            "kv_cache_specs: expected a dict of layer name -> KVCacheSpec, got "
            f"{kv_cache_specs!r} ({type(kv_cache_specs).__name__})"
        )
    for name, spec in kv_cache_specs.items():
        if not isinstance(name, str):
            raise ValueError(
                f"kv_cache_specs: expected layer names (str) as keys, got {name!r} "
                f"({type(name).__name__})"
            )
        if not isinstance(spec, KVCacheSpec):
            raise ValueError(
                f"kv_cache_specs[{name!r}]: expected a KVCacheSpec, got {spec!r} "
                f"({type(spec).__name__})"
            )
    groups = get_kv_cache_groups(vllm_config, dict(kv_cache_specs), policy=policy)
    return num_blocks * _pool_bytes_per_block(vllm_config, groups) if groups else 0


def _get_kv_cache_config_deepseek_v4(
    vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec], available_memory: int
) -> tuple[int, list[KVCacheTensor]]:
    """``(num_blocks, tensors)`` of DeepSeek-V4's layer-tuple groups (full-MLA group first, the
    other groups' pages padded to full-MLA page sizes): ``available_memory`` bytes divided by
    the bytes a block id takes (≥ 0, or the override); one tensor per (tuple t, page size p),
    ascending p within t, of ``p x num_blocks`` bytes, shared by the t-th layer of size p of
    every group that has one. ``ValueError`` for other groups or a page of another size."""
    layout = layer_tuple_layout(kv_cache_groups)
    if layout is None:
        raise ValueError(
            "kv_cache_groups: expected several UniformTypeKVCacheSpecs groups, got "
            f"{[type(g.kv_cache_spec).__name__ for g in kv_cache_groups]}"
        )
    num_blocks = may_override_num_blocks(
        vllm_config, max(available_memory // layout.bytes_per_block, 0)
    )
    buckets: list[dict[int, list[str]]] = []
    for group in kv_cache_groups:
        spec = group.kv_cache_spec
        assert isinstance(spec, UniformTypeKVCacheSpecs)  # checked by layer_tuple_layout
        by_page: dict[int, list[str]] = defaultdict(list)
        for name in group.layer_names:
            page = spec.kv_cache_specs[name].page_size_bytes
            if page not in layout.page_sizes:
                raise ValueError(
                    f"kv_cache_groups: layer {name!r} expected a page of one of the full-MLA "
                    f"sizes {list(layout.page_sizes)} bytes, got {page}"
                )
            by_page[page].append(name)
        buckets.append(by_page)
    tensors = [
        KVCacheTensor(
            size=page * num_blocks,
            shared_by=[b[page][t] for b in buckets if t < len(b.get(page, ()))],
        )
        for t in range(layout.num_layer_tuples)
        for page in layout.page_sizes
    ]
    return num_blocks, tensors


def get_kv_cache_config_from_groups(
    vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec], available_memory: int
) -> KVCacheConfig:
    """The config with the most blocks that fit in ``available_memory`` bytes (or the
    override); without groups (no KV cache) ``num_blocks`` is 1, the block pool's null block."""
    if not kv_cache_groups:
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups)
    first = kv_cache_groups[0].kv_cache_spec
    layout = resolved_layout(vllm_config)
    if layout is not None:
        check_layout_expresses_groups(layout, kv_cache_groups)
        block_bytes = kv_cache_bytes_per_block(kv_cache_groups, layout)
        num_blocks = may_override_num_blocks(vllm_config, max(available_memory // block_bytes, 0))
        tensors = strided_kv_cache_tensors(kv_cache_groups, layout, num_blocks)
    elif len(kv_cache_groups) == 1 and isinstance(first, UniformTypeKVCacheSpecs):
        num_blocks = may_override_num_blocks(vllm_config, available_memory // first.page_size_bytes)
        tensors = [
            KVCacheTensor(
                size=first.kv_cache_specs[name].page_size_bytes * num_blocks, shared_by=[name]
            )
            for name in kv_cache_groups[0].layer_names
        ]
    elif layer_tuple_layout(kv_cache_groups) is not None:
        num_blocks, tensors = _get_kv_cache_config_deepseek_v4(
            vllm_config, kv_cache_groups, available_memory
        )
    else:
        group_size = max(len(group.layer_names) for group in kv_cache_groups)
        assert group_size > 0, "kv_cache_groups: every group is empty"
        page_size = get_uniform_page_size(group.kv_cache_spec for group in kv_cache_groups)
        num_blocks = get_num_blocks(vllm_config, group_size, available_memory, page_size)
        tensors = [
            KVCacheTensor(
                size=page_size * num_blocks,
                shared_by=[g.layer_names[i] for g in kv_cache_groups if i < len(g.layer_names)],
            )
            for i in range(group_size)
        ]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=kv_cache_groups
    )


def _max_memory_usage_bytes_from_groups(
    vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec]
) -> int:
    """Device bytes one request of ``max_model_len`` takes under the group layout (short
    groups are padded, as the tensors are; a layer-tuple group's block id costs the whole
    tuple block); host-resident groups do not count."""
    # Host-resident groups (HiSparse's source) draw from the host pool, not this budget.
    kv_cache_groups = [g for g in kv_cache_groups if not g.host_resident]
    if not kv_cache_groups:
        return 0
    first = kv_cache_groups[0].kv_cache_spec
    cache_layout = resolved_layout(vllm_config)
    if cache_layout is not None:
        # Every group's block ids come from the one pool: each costs a whole block.
        pages = sum(
            g.kv_cache_spec.max_memory_usage_pages(vllm_config)
            if isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
            else cdiv(
                g.kv_cache_spec.max_memory_usage_bytes(vllm_config), g.kv_cache_spec.page_size_bytes
            )
            for g in kv_cache_groups
        )
        return kv_cache_bytes_per_block(kv_cache_groups, cache_layout) * pages
    if len(kv_cache_groups) == 1 and isinstance(first, UniformTypeKVCacheSpecs):
        return max_memory_usage_bytes(vllm_config, first.kv_cache_specs.values())
    layout = layer_tuple_layout(kv_cache_groups)
    if layout is not None:
        # Every group's block ids come from the one pool: each costs a whole layer-tuple block.
        pages = sum(
            cast(UniformTypeKVCacheSpecs, group.kv_cache_spec).max_memory_usage_pages(vllm_config)
            for group in kv_cache_groups
        )
        return layout.bytes_per_block * pages
    group_size = max(len(group.layer_names) for group in kv_cache_groups)
    page_size = get_uniform_page_size(group.kv_cache_spec for group in kv_cache_groups)
    blocks = sum(
        cdiv(group.kv_cache_spec.max_memory_usage_bytes(vllm_config), page_size)
        for group in kv_cache_groups
    )
    return group_size * page_size * blocks


def _estimate_max_model_len_from_groups(
    vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec], available_memory: int
) -> int:
    """The largest length (≤ ``max_model_len``) whose one request fits under the group layout;
    0 when not even 1 token fits."""
    return _largest_fitting_len(
        vllm_config,
        lambda _: (
            _max_memory_usage_bytes_from_groups(vllm_config, kv_cache_groups) <= available_memory
        ),
    )


def _auto_fit_max_model_len(
    vllm_config: VllmConfig,
    projected_groups_per_worker: list[list[KVCacheGroupSpec]],
    available_memory: list[int],
) -> None:
    """Lower ``model_config.max_model_len`` in place to the longest request every worker fits
    (``original_max_model_len == -1``); ``ValueError`` when not even 1 token fits."""
    assert vllm_config.model_config is not None
    fitted = vllm_config.model_config.max_model_len or 0
    for groups, memory in zip(projected_groups_per_worker, available_memory, strict=True):
        if groups:
            fitted = min(fitted, _estimate_max_model_len_from_groups(vllm_config, groups, memory))
    if fitted <= 0:
        raise ValueError(
            "max_model_len: cannot fit it to the KV-cache memory, not even 1 token fits; raise "
            "the memory budget (gpu_memory_utilization)"
        )
    vllm_config.model_config.max_model_len = fitted


def resolve_dcp_kv_block_size(spec: KVCacheSpec, dcp_world_size: int) -> int:
    """Tokens one block of ``spec`` spans under decode context parallelism: a sharded
    cache's block holds ``block_size`` tokens on each of the ``dcp_world_size`` ranks."""
    return spec.block_size * (dcp_world_size if spec.dcp_sharded else 1)


def partial_hash_hits_enabled(
    kv_cache_groups: Sequence[KVCacheGroupSpec],
    hash_block_size: int,
    dcp_world_size: int = 1,
    manager_classes: Sequence[type] | None = None,
) -> bool:
    """Whether prefix hits may end inside a page (every ``hash_block_size`` tokens): some
    ``"align"`` Mamba layer (in any group, a packed one included) pages more tokens than a
    hash block -- with decode context parallelism at least as many (DCP widens the sharded
    attention pages instead) -- and, when ``manager_classes`` (one per group) is given, every
    other prefix-cacheable group either pages one hash block (DCP included) or has a manager
    with ``supports_fine_grained_hash_lookup``."""

    def mamba_pages_past_hash(spec: KVCacheSpec) -> bool:
        if not isinstance(spec, MambaSpec) or spec.mamba_cache_mode != "align":
            return False
        if dcp_world_size > 1:
            return spec.block_size >= hash_block_size
        return spec.block_size > hash_block_size

    if not any(
        mamba_pages_past_hash(s) for g in kv_cache_groups for s in iter_layer_specs(g.kv_cache_spec)
    ):
        return False
    if manager_classes is None:
        return True
    return all(
        not group.kv_cache_spec.prefix_cacheable
        or getattr(cls, "supports_fine_grained_hash_lookup", False)
        or resolve_dcp_kv_block_size(group.kv_cache_spec, dcp_world_size) == hash_block_size
        for group, cls in zip(kv_cache_groups, manager_classes, strict=True)
    )


def resolve_kv_cache_block_sizes(
    kv_cache_config: KVCacheConfig, vllm_config: VllmConfig
) -> tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)`` in tokens.

    A group's block spans ``block_size x dcp`` tokens when it is DCP-sharded, ``block_size``
    otherwise (PCP does not widen it). One group: ``cache_config.block_size`` so scaled, for
    both; a ``prefix_match_unit`` other than that is a ``ValueError`` while hashes are read
    (prefix caching or a KV connector). Several groups: the scheduler aligns to the lcm of
    the groups' spans; requests are hashed every ``prefix_match_unit`` tokens (v0.22's
    ``hash_block_size``; default: the gcd of the prefix-cacheable groups' spans), which must
    divide each of those spans, and hits must land on whole compressed states
    (``tokens_per_state``), else ``ValueError``. Hashing follows the scheduler block when
    nothing reads the hashes or a Mamba group is not in ``"align"`` mode.
    """
    cache_config = vllm_config.cache_config
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    groups = kv_cache_config.kv_cache_groups
    requested = getattr(cache_config, "prefix_match_unit", None) or getattr(
        cache_config, "hash_block_size", None
    )
    hashes_read = bool(cache_config.enable_prefix_caching) or (
        getattr(vllm_config, "kv_transfer_config", None) is not None
    )
    if len(groups) <= 1:
        size = cache_config.block_size * (
            dcp if not groups or groups[0].kv_cache_spec.dcp_sharded else 1
        )
        if groups and hashes_read and requested not in (None, size):
            raise ValueError(
                f"prefix_match_unit: expected None or the block size {size} (one KV cache "
                f"group: prefix hits land on its blocks), got {requested}"
            )
        return size, size
    sizes = [resolve_dcp_kv_block_size(g.kv_cache_spec, dcp) for g in groups]
    scheduler_size = math.lcm(*sizes)
    layer_specs = [s for g in groups for s in iter_layer_specs(g.kv_cache_spec)]
    if not hashes_read or any(
        isinstance(s, MambaSpec) and s.mamba_cache_mode != "align" for s in layer_specs
    ):
        return scheduler_size, scheduler_size
    hashed = [
        size for g, size in zip(groups, sizes, strict=True) if g.kv_cache_spec.prefix_cacheable
    ] or sizes
    hash_size = requested if requested is not None else math.gcd(*hashed)
    if any(size % hash_size for size in hashed):
        raise ValueError(
            f"prefix_match_unit: expected a divisor of every prefix-cacheable KV cache group's "
            f"block size {hashed} (all groups: {sizes}), got {hash_size}"
        )
    hit_unit = hash_size if partial_hash_hits_enabled(groups, hash_size, dcp) else scheduler_size
    # Compressed attention states only: a Mamba page is one state by construction (upstream
    # gives it no tokens_per_state) and partial hits restore it from a checkpoint.
    ratios = sorted(
        {
            s.tokens_per_state
            for s in layer_specs
            if s.prefix_cacheable
            and not isinstance(s, MambaSpec)
            and isinstance(s.tokens_per_state, int)
            and s.tokens_per_state > 1
        }
    )
    if any(hit_unit % ratio for ratio in ratios):
        raise ValueError(
            f"prefix_match_unit: expected prefix-cache hits on multiples of each spec's "
            f"per-state compression {ratios} tokens, got hits every {hit_unit} tokens"
        )
    return scheduler_size, hash_size
