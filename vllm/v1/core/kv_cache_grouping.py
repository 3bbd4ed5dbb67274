"""Layers → KV-cache groups: upstream v0.22's grouping functions, the one implementation the
planner (:mod:`vllm.v1.core.kv_cache_utils`) also uses.

A group is a set of layers sharing one block table. The layout rules:

1. every layer has one spec (a full-attention layer that records a window merges with plain
   full attention) → one group;
2. all layers need the same token slots but differ in page size → one group whose spec is a
   ``UniformTypeKVCacheSpecs``;
3. DeepSeek-V4 (full-MLA and sliding-window MLA layers) → several ``UniformTypeKVCacheSpecs``
   groups sharing layer-tuple tensors (:mod:`vllm.v1.core.kv_cache_deepseek_v4`); specs that do
   not fit that layout (upstream fails an assertion on them) take rule 4;
4. otherwise (hybrid) the pages are unified to one size P
   (:func:`~vllm.v1.core.page_size_unification.unify_kv_cache_spec_page_size`), layers with
   equal specs form a kind, and each kind of c layers is split into ``cdiv(c, g)`` groups of at
   most g layers (``layers[i::n]``), so that a tensor can hold layer i of every group. When the
   pages cannot be unified (an MLA page that does not divide the largest) and MLA layers sit
   next to sliding-window ones, v0.33's fallback allocates the sliding-window layers as full
   attention (compute unchanged) in one ``UniformTypeKVCacheSpecs`` group.

The group size g is a policy (:class:`KVCacheLayoutPolicy`). Upstream's
(:data:`UPSTREAM_LAYOUT`, the default of every upstream name): g = the smallest kind's count,
or the largest one when it is under 1.5x the smallest (GPT-OSS + EAGLE: 13 full + 12 sliding →
g = 13), and P = the largest page. The planner's (:data:`PLANNER_LAYOUT`): the fewest groups
whose empty group slots are ≤ 5 % of all slots, and P searched more widely (see
:mod:`vllm.v1.core.page_size_unification`). Units: page sizes in bytes, block sizes in tokens.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.core.kv_cache_deepseek_v4 import (
    _annotate_eagle_groups_deepseek_v4,
    _approximate_gcd,
    _fits_layer_tuples,
    _get_kv_cache_groups_uniform_groups,
    group_and_unify_kv_cache_specs,
)
from vllm.v1.core.page_size_unification import (
    MAX_EXACT_PAGE_GROWTH,
    MAX_PAGE_GROWTH,
    unify_kv_cache_spec_page_size,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
    replace_as,
)

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig
    from vllm.v1.kv_cache_layout import KVCacheLayout

logger = logging.getLogger(__name__)

__all__ = [
    "PLANNER_LAYOUT",
    "UPSTREAM_LAYOUT",
    "KVCacheLayoutPolicy",
    "create_kv_cache_group_specs",
    "generate_scheduler_kv_cache_config",
    "get_kv_cache_groups",
    "get_packed_kv_cache_groups",
    "get_uniform_page_size",
    "resolved_layout",
    "is_kv_cache_page_size_uniform",
    "is_kv_cache_spec_uniform",
    "is_kv_cache_type_attention_free",
    "unify_hybrid_kv_cache_specs",
]


@dataclass(frozen=True)
class KVCacheLayoutPolicy:
    """How hybrid layers are laid out.

    ``max_group_padding``: None for upstream's group size rule, else the largest fraction of
    empty group slots accepted before adding groups (fewest groups first, then least padding).
    ``max_page_growth`` / ``max_exact_page_growth``: the page-size unification bounds (multiples
    of the largest base page; 1 and 1 are upstream's exact-divisor rule).
    """

    max_group_padding: float | None = None
    max_page_growth: int = 1
    max_exact_page_growth: int = 1

    def group_size(self, counts: Sequence[int]) -> int:
        """Layers per group for kinds of ``counts`` layers."""
        if self.max_group_padding is None:
            smallest, largest = min(counts), max(counts)
            # A kind barely larger than the smallest (a drafter's extra layer) pads the others
            # instead of doubling the groups.
            return largest if largest < smallest * 1.5 else smallest
        best: tuple[int, int, int] | None = None
        for g in range(1, max(counts) + 1):
            num_groups = sum(cdiv(c, g) for c in counts)
            padding = num_groups * g - sum(counts)
            if padding > self.max_group_padding * num_groups * g:
                continue
            key = (num_groups, padding, g)
            if best is None or key < best:
                best = key
        assert best is not None  # g = 1 never pads
        return best[2]


UPSTREAM_LAYOUT = KVCacheLayoutPolicy()
"""Upstream vLLM's layout rules (the default of every upstream-named function)."""

PLANNER_LAYOUT = KVCacheLayoutPolicy(
    max_group_padding=0.05,
    max_page_growth=MAX_PAGE_GROWTH,
    max_exact_page_growth=MAX_EXACT_PAGE_GROWTH,
)
"""The planner's rules: fewer groups and less padding where upstream's heuristic wastes memory
(Gemma 3 52 + 10 layers: 5 groups, 4.6 % empty, instead of 7 groups, 11 % empty), and pages that
need not divide each other (design.md §4)."""


def create_kv_cache_group_specs(
    kv_cache_spec: dict[str, KVCacheSpec], grouped_layer_names: list[list[str]]
) -> list[KVCacheGroupSpec]:
    """One group per list of ``grouped_layer_names``, its spec the merge of its layers' specs."""
    groups = []
    for layer_names in grouped_layer_names:
        specs = [kv_cache_spec[name] for name in layer_names]
        groups.append(KVCacheGroupSpec(layer_names, specs[0].merge(specs)))
    return groups


def is_kv_cache_spec_uniform(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    """True when all layers merge into one spec (full attention with and without a recorded
    window counts as one); an empty dict (no KV cache) is uniform. Specs that differ raise an
    ``AssertionError`` in ``merge`` (caught here); two different windows raise ``ValueError``."""
    if not kv_cache_spec:
        return True
    specs = list(kv_cache_spec.values())
    try:
        specs[0].merge(specs)
    except AssertionError:
        return False
    return True


def is_kv_cache_page_size_uniform(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    """True when every layer's page has one size."""
    return len({spec.page_size_bytes for spec in kv_cache_spec.values()}) == 1


def is_kv_cache_type_attention_free(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    """True for a model without cache-holding layers (an empty dict)."""
    return not kv_cache_spec


def get_uniform_page_size(kv_cache_specs: Iterable[KVCacheSpec]) -> int:
    """The one page size (bytes) of ``kv_cache_specs``; ``AssertionError`` when there are
    several."""
    page_sizes = {spec.page_size_bytes for spec in kv_cache_specs}
    assert len(page_sizes) == 1, f"kv_cache_specs: expected one page size, got {page_sizes}"
    return page_sizes.pop()


_PROMOTIONS: tuple[tuple[type[AttentionSpec], type[AttentionSpec]], ...] = (
    (SlidingWindowMLASpec, MLAAttentionSpec),
    (SlidingWindowSpec, FullAttentionSpec),
    (ChunkedLocalAttentionSpec, FullAttentionSpec),
)
"""Local-attention spec classes → the class they are cached as with full allocation (most
derived first: a sliding-window MLA spec is also a sliding-window spec)."""


def _full_attention_like(spec: AttentionSpec, block_size: int) -> AttentionSpec:
    """``spec`` cached as full attention (latent specs stay latent), its window recorded, with
    ``block_size`` tokens per block. A padded page keeps its padding, grown with the block when
    the real page outgrows it. Only allocation changes: the layer still computes over its
    window."""
    target = next(dst for src, dst in _PROMOTIONS if isinstance(spec, src))
    target_fields = {f.name for f in fields(target) if f.init}
    padded = spec.page_size_padded
    if padded is not None:
        padded = max(padded, spec.real_page_size_bytes * block_size // spec.block_size)
    return replace_as(
        spec,
        target,
        drop=[f.name for f in fields(spec) if f.name not in target_fields],
        block_size=block_size,
        page_size_padded=padded,
    )


def _is_one_type(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    return is_kv_cache_spec_uniform(kv_cache_spec) or UniformTypeKVCacheSpecs.is_uniform_type(
        kv_cache_spec
    )


def _promote_local_specs(kv_cache_spec: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """One set of layers as one type: when it has full attention next to sliding-window or
    chunked-local layers, those are cached as full attention recording their window, with the
    full-attention block size when there is one (else their own). ``ValueError`` when the
    layers still differ in type afterwards."""
    if _is_one_type(kv_cache_spec):
        return kv_cache_spec
    specs = kv_cache_spec.values()
    full_blocks = {s.block_size for s in specs if isinstance(s, FullAttentionSpec)}
    local = tuple(src for src, _ in _PROMOTIONS)
    promoted = dict(kv_cache_spec)
    if full_blocks and any(isinstance(s, local) for s in specs):
        full_block = next(iter(full_blocks)) if len(full_blocks) == 1 else None
        for name, spec in kv_cache_spec.items():
            if isinstance(spec, local):
                block = full_block if full_block is not None else spec.block_size
                promoted[name] = _full_attention_like(spec, block)
    if not _is_one_type(promoted):
        raise ValueError(
            "kv_cache_spec: the layers' specs cannot be turned into one type for full "
            "allocation (that needs full attention next to the sliding-window or chunked "
            f"layers); got {sorted({type(s).__name__ for s in specs})}"
        )
    return promoted


def _full_allocation_fallback_groups(
    kv_cache_spec: dict[str, KVCacheSpec],
) -> list[KVCacheGroupSpec] | None:
    """One group for MLA layers next to sliding-window layers whose pages cannot be unified:
    the sliding-window layers are allocated as full attention (their compute keeps the
    window), so every layer shares one block table. None when that does not apply (hidden-state,
    sliding-window MLA or chunked layers; no MLA or no sliding window; no common type)."""
    specs = kv_cache_spec.values()
    if any(isinstance(s, (HiddenStateCacheSpec, SlidingWindowMLASpec)) for s in specs):
        return None
    if any(isinstance(s, ChunkedLocalAttentionSpec) for s in specs):
        return None
    if not (
        any(isinstance(s, MLAAttentionSpec) for s in specs)
        and any(isinstance(s, SlidingWindowSpec) for s in specs)
    ):
        return None
    try:
        promoted = _promote_local_specs(kv_cache_spec)
    except ValueError:
        return None
    uniform = UniformTypeKVCacheSpecs.from_specs(promoted)
    if uniform is None:
        return None
    logger.warning(
        "KV cache pages cannot be unified to one size; sliding-window layers are allocated as "
        "full attention (their attention compute is unchanged)"
    )
    return [KVCacheGroupSpec(list(uniform.kv_cache_specs), uniform)]


def unify_hybrid_kv_cache_specs(kv_cache_spec: dict[str, KVCacheSpec]) -> None:
    """With the hybrid allocator disabled: in each sharding class (DCP-replicated attention
    layers, e.g. a draft model's, and the rest), turn sliding-window and chunked-local layers
    into full-attention specs that record their window, in place, when the class also has full
    attention. The classes keep separate groups: a replicated draft must hold every position
    that a sharded target spreads over its DCP ranks. ``ValueError`` when a class's specs
    still differ in type afterwards."""
    classes: dict[bool, dict[str, KVCacheSpec]] = {}
    for name, spec in kv_cache_spec.items():
        replicated = isinstance(spec, AttentionSpec) and not spec.dcp_sharded
        classes.setdefault(replicated, {})[name] = spec
    for specs in classes.values():
        promoted = _promote_local_specs(specs)
        if promoted != specs:
            logger.warning(
                "The hybrid KV cache manager is disabled: local-attention layers are cached "
                "as full attention (no KV cache is freed outside their windows; their "
                "attention compute is unchanged)"
            )
            kv_cache_spec.update(promoted)


def _group_uniform_page_size(
    kv_cache_spec: dict[str, KVCacheSpec], policy: KVCacheLayoutPolicy
) -> list[KVCacheGroupSpec]:
    """Groups of layers whose pages have one size: equal specs form a kind, each kind split into
    groups of ``policy.group_size`` layers, layer i of a kind going to group ``i % n``. Taking
    every n-th layer keeps pipeline stages balanced: stage layers stay spread over the groups."""
    same_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_spec.items():
        same_spec.setdefault(spec, []).append(name)
    group_size = policy.group_size([len(layers) for layers in same_spec.values()])
    grouped: list[list[str]] = []
    for layers in same_spec.values():
        num_groups = cdiv(len(layers), group_size)
        grouped.extend(layers[i::num_groups] for i in range(num_groups))
    return create_kv_cache_group_specs(kv_cache_spec, grouped)


def resolved_layout(vllm_config: VllmConfig | None) -> KVCacheLayout | None:
    """The cache layout once resolved (``cache_config.kv_cache_layout``), else None: then
    the planner keeps v0.22's grouping and tensors."""
    cache_config = vllm_config.cache_config if vllm_config is not None else None
    if cache_config is None or cache_config.kv_cache_layout is None:
        return None
    return cache_config.get_resolved_kv_cache_layout()


def _uniform_type_buckets(kv_cache_spec: dict[str, KVCacheSpec]) -> list[dict[str, KVCacheSpec]]:
    """Layers greedily bucketed: each joins the first bucket it keeps one type with."""
    buckets: list[dict[str, KVCacheSpec]] = []
    for name, spec in kv_cache_spec.items():
        bucket = next(
            (b for b in buckets if UniformTypeKVCacheSpecs.is_uniform_type({**b, name: spec})),
            None,
        )
        if bucket is None:
            buckets.append({name: spec})
        else:
            bucket[name] = spec
    return buckets


def get_packed_kv_cache_groups(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec] | None:
    """Groups for a block-outermost layout whose layers' pages differ in size: no page-size
    unification; each block holds one page of every layer of a group side by side (the
    block's bytes are the widest group's pages). None when the layout is not resolved
    block-outermost or every page has one size.

    Layers are bucketed into one-type specs. A bucket with as many layers of each page size (a
    repeating pattern) is split into groups of the same number of pattern repeats, chosen over
    all such buckets to pad least (at least the largest mixed-size bucket's repeats, which
    stays whole); other buckets stay whole, except that state buckets (Mamba, circular
    buffers, and sliding windows when nothing repeats) are split so that a group fits in the
    block the other buckets already need."""
    layout = resolved_layout(vllm_config)
    if layout is None or not layout.is_block_outermost:
        return None
    if len({spec.page_size_bytes for spec in kv_cache_spec.values()}) <= 1:
        return None
    bucketed: list[tuple[UniformTypeKVCacheSpecs, dict[int, list[str]], bool]] = []
    for bucket in _uniform_type_buckets(kv_cache_spec):
        uniform = UniformTypeKVCacheSpecs.from_specs(bucket)
        assert uniform is not None  # bucketed by is_uniform_type
        by_page: dict[int, list[str]] = {}
        for name, spec in bucket.items():
            by_page.setdefault(spec.page_size_bytes, []).append(name)
        balanced = len({len(names) for names in by_page.values()}) == 1
        bucketed.append((uniform, by_page, balanced))

    floor = max(
        (
            u.get_max_layers_per_page_size()
            for u, by_page, bal in bucketed
            if bal and len(by_page) > 1
        ),
        default=0,
    )
    repeats = (
        _approximate_gcd(
            [u.get_max_layers_per_page_size() for u, _, bal in bucketed if bal],
            lower_bound=floor,
        )
        if floor
        else None
    )

    def pattern_groups(uniform: UniformTypeKVCacheSpecs, balanced: bool) -> int:
        if balanced and repeats is not None:
            return cdiv(uniform.get_max_layers_per_page_size(), repeats)
        return 1

    def is_state(uniform: UniformTypeKVCacheSpecs) -> bool:
        first = uniform.first_spec
        if isinstance(first, (MambaSpec, CircularBufferSpec)):
            return True
        return repeats is None and isinstance(first, SlidingWindowSpec)

    def widest_group_bytes(by_page: dict[int, list[str]], num_groups: int) -> int:
        return sum(cdiv(len(names), num_groups) * page for page, names in by_page.items())

    block_bytes = max(
        widest_group_bytes(
            by_page,
            len(u.kv_cache_specs) if is_state(u) else pattern_groups(u, balanced),
        )
        for u, by_page, balanced in bucketed
    )
    groups: list[KVCacheGroupSpec] = []
    for uniform, by_page, balanced in bucketed:
        num_groups = pattern_groups(uniform, balanced)
        if is_state(uniform):
            per_block = max(block_bytes // uniform.first_spec.page_size_bytes, 1)
            num_groups = max(num_groups, cdiv(len(uniform.kv_cache_specs), per_block))
        if num_groups == 1:
            groups.append(KVCacheGroupSpec(list(uniform.kv_cache_specs), uniform))
            continue
        pattern = list(zip(*by_page.values(), strict=False))
        for i in range(num_groups):
            names = [name for repeat in pattern[i::num_groups] for name in repeat]
            split = UniformTypeKVCacheSpecs.from_specs(
                {n: uniform.kv_cache_specs[n] for n in names}
            )
            assert split is not None  # a subset of a one-type bucket
            groups.append(KVCacheGroupSpec(names, split))
    return groups


def get_kv_cache_groups(
    vllm_config: VllmConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    *,
    policy: KVCacheLayoutPolicy = UPSTREAM_LAYOUT,
) -> list[KVCacheGroupSpec]:
    """Groups of layers sharing a block table (rules in the module docstring). Hybrid specs are
    unified to one page size first: the groups carry the unified specs. With
    ``scheduler_config.disable_hybrid_kv_cache_manager`` the specs are first made one type, in
    place (:func:`unify_hybrid_kv_cache_specs`). Hidden-state cache layers get groups of their
    own, with pages of the common size. DeepSeek-V4's layers form layer-tuple groups, the one
    holding the last layer flagged ``is_eagle_group`` with an EAGLE-style drafter."""
    scheduler = vllm_config.scheduler_config
    if scheduler is not None and scheduler.disable_hybrid_kv_cache_manager:
        unify_hybrid_kv_cache_specs(kv_cache_spec)
    if is_kv_cache_type_attention_free(kv_cache_spec):
        return []
    if is_kv_cache_spec_uniform(kv_cache_spec):
        return create_kv_cache_group_specs(kv_cache_spec, [list(kv_cache_spec)])
    uniform = UniformTypeKVCacheSpecs.from_specs(kv_cache_spec)
    if uniform is not None:
        return [KVCacheGroupSpec(list(uniform.kv_cache_specs), uniform)]
    hidden = {n: s for n, s in kv_cache_spec.items() if isinstance(s, HiddenStateCacheSpec)}
    rest = {n: s for n, s in kv_cache_spec.items() if n not in hidden}
    packed = get_packed_kv_cache_groups(vllm_config, rest)
    if packed is not None:
        # A block is as wide as its widest group: hidden-state pages need no alignment.
        return packed + [KVCacheGroupSpec([name], spec) for name, spec in hidden.items()]
    # DeepSeek-V4's layer tuples: v0.22's form, kept while no block-outermost layout packs.
    grouped = group_and_unify_kv_cache_specs(kv_cache_spec)
    if grouped is not None and _fits_layer_tuples(grouped):
        groups = _get_kv_cache_groups_uniform_groups(grouped)
        _annotate_eagle_groups_deepseek_v4(vllm_config, kv_cache_spec, groups)
        return groups
    try:
        rest = unify_kv_cache_spec_page_size(
            rest, policy.max_page_growth, policy.max_exact_page_growth
        )
    except NotImplementedError:
        fallback = _full_allocation_fallback_groups(kv_cache_spec)
        if fallback is None:
            raise
        return fallback
    groups = _group_uniform_page_size(rest, policy)
    if hidden:
        page = get_uniform_page_size(g.kv_cache_spec for g in groups)
        # A hidden-state block divides every group's block, so it never coarsens the hash
        # block (the gcd of the groups' blocks).
        common_block = math.gcd(*(g.kv_cache_spec.block_size for g in groups))
        for name, spec in hidden.items():
            per_token = spec.num_kv_heads * spec.head_size * get_dtype_size(spec.dtype)
            fits = max(page // per_token, 1)
            block = max(d for d in range(1, min(common_block, fits) + 1) if common_block % d == 0)
            aligned = replace(spec, block_size=block, page_size_padded=page)
            groups.append(KVCacheGroupSpec([name], aligned))
    return groups


def generate_scheduler_kv_cache_config(kv_cache_configs: list[KVCacheConfig]) -> KVCacheConfig:
    """The scheduler's view of the workers' configs (which differ only in layer names): a copy
    of the first, each ``UniformTypeKVCacheSpecs`` group spec replaced by one of its layers'
    specs (they need the same slots). ``AssertionError`` when ``num_blocks`` (or HiSparse's
    host pages) differ."""
    num_blocks = {cfg.num_blocks for cfg in kv_cache_configs}
    assert len(num_blocks) == 1, f"kv_cache_configs: expected one num_blocks, got {num_blocks}"
    host_blocks = {cfg.hisparse_host_num_blocks for cfg in kv_cache_configs}
    assert len(host_blocks) == 1, (
        f"kv_cache_configs: expected one hisparse_host_num_blocks, got {host_blocks}"
    )
    cfg = copy.deepcopy(kv_cache_configs[0])
    for group in cfg.kv_cache_groups:
        if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs):
            group.kv_cache_spec = next(iter(group.kv_cache_spec.kv_cache_specs.values()))
    return cfg


def _project_kv_cache_groups_to_worker(
    global_kv_cache_groups: list[KVCacheGroupSpec],
    worker_spec: dict[str, KVCacheSpec],
) -> list[KVCacheGroupSpec]:
    """The global groups restricted to the layers of one worker (a pipeline stage): same
    groups in the same order, possibly empty; a ``UniformTypeKVCacheSpecs`` keeps only the
    worker's layers."""
    projected = []
    for group in global_kv_cache_groups:
        names = [name for name in group.layer_names if name in worker_spec]
        spec = group.kv_cache_spec
        if names and isinstance(spec, UniformTypeKVCacheSpecs):
            spec = UniformTypeKVCacheSpecs(
                block_size=spec.block_size,
                kv_cache_specs={name: spec.kv_cache_specs[name] for name in names},
            )
        projected.append(
            KVCacheGroupSpec(
                names,
                spec,
                is_eagle_group=group.is_eagle_group,
                host_resident=group.host_resident,
                enable_kv_transfer=group.enable_kv_transfer,
                role=group.role,
            )
        )
    return projected
