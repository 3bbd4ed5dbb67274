"""The KV-cache planner: per-layer specs → groups → ``KVCacheConfig`` for a memory budget.

Units: ``block_size`` is in tokens per page; memory, page sizes and every ``*_bytes`` quantity
are in bytes; ``available_memory`` is the KV-cache budget of **one** tensor-parallel rank.

How layers become groups and tensors (:func:`get_kv_cache_groups`,
:func:`get_kv_cache_config_from_groups`):

1. All layers have one spec → one group; one ``KVCacheTensor`` per layer.
2. All layers need the same slots (same spec class, block size, window, compress ratio) but
   differ in page size (e.g. some layers kept unquantized by ``kv_cache_dtype_skip_layers``) →
   one group whose spec is a ``UniformTypeKVCacheSpecs``; one tensor per layer, each of
   ``num_blocks`` pages of that layer's own page size.
3. Otherwise (hybrid: full + sliding, attention + Mamba, DeepSeek-V4's compressed layers) the
   upstream vLLM hybrid allocator layout: all groups draw block ids from one pool, and layers
   at the same position in each group share one tensor, so **every page must have one size P**
   (:func:`unify_kv_cache_spec_page_size`; policy and waste bound in
   :mod:`vllm.v1.core.page_size_unification`): attention-like specs grow their block size by an
   integer factor, plain attention pages are never padded, Mamba and latent pages are padded up
   to P.

   Layers with equal specs form a kind; each kind of c layers is split into ``cdiv(c, g)``
   groups of at most g layers (``layers[i::n]``, as upstream), and there are g tensors. Upstream
   takes g = the smallest kind's count; here g is the choice with the **fewest groups** whose
   empty group slots are ≤ ``max_group_padding`` (5 %) of all slots, ties broken by less
   padding. That reproduces upstream for n:1 patterns (GPT-OSS 18+18 → g=18, Qwen3-Next 36+12
   → g=12) and wastes less elsewhere (Gemma 3 52+10: upstream g=10 → 7 groups, 11 % empty;
   here g=13 → 5 groups, 4.6 % empty).

``num_blocks`` = ``available_memory // Σ(page size of every tensor)``; each tensor's size is
``num_blocks × its page size``. A request of ``max_model_len`` needs, per group,
``cdiv(spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens), page)`` blocks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vllm.config.cache import CacheConfig
from vllm.utils import check_positive_int
from vllm.v1.core.kv_bytes import kv_bytes_for_tokens, spec_bytes_per_token, total_state_bytes
from vllm.v1.core.model_config import load_model_config
from vllm.v1.core.model_families import parse_model_layout
from vllm.v1.core.model_specs import ModelKVSpecs, build_kv_cache_specs
from vllm.v1.core.page_size_unification import (
    MAX_EXACT_PAGE_GROWTH,
    MAX_PAGE_GROWTH,
    unify_kv_cache_spec_page_size,
)
from vllm.v1.kv_cache_format import AUTO
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    UniformTypeKVCacheSpecs,
    cdiv,
    iter_layer_specs,
)

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "InsufficientKVCacheMemoryError",
    "KVCachePlan",
    "MAX_EXACT_PAGE_GROWTH",
    "MAX_GROUP_PADDING",
    "MAX_PAGE_GROWTH",
    "blocks_per_request",
    "bytes_per_block",
    "check_enough_kv_cache_memory",
    "estimate_max_model_len",
    "get_kv_cache_config",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
    "iter_layer_specs",
    "plan_kv_cache",
    "plan_kv_cache_for_specs",
    "unify_kv_cache_spec_page_size",
]

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""Tokens scheduled per step (chunked-prefill chunk); bounds a sliding window's pages."""

MAX_GROUP_PADDING = 0.05
"""Largest fraction of empty group slots the group-size choice accepts before adding groups."""


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


# --------------------------------------------------------------------------------------------
# Groups


def _choose_group_size(counts: Sequence[int], max_group_padding: float) -> int:
    """Group size g: the fewest groups with empty slots ≤ ``max_group_padding``, then the
    fewest empty slots."""
    best: tuple[int, int, int] | None = None
    for g in range(1, max(counts) + 1):
        num_groups = sum(cdiv(c, g) for c in counts)
        padding = num_groups * g - sum(counts)
        if padding > max_group_padding * num_groups * g:
            continue
        key = (num_groups, padding, g)
        if best is None or key < best:
            best = key
    assert best is not None  # g = 1 never pads
    return best[2]


def _group_spec(layer_names: list[str], specs: Mapping[str, KVCacheSpec]) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(
        layer_names=list(layer_names),
        kv_cache_spec=KVCacheSpec.merge([specs[n] for n in layer_names]),
    )


def get_kv_cache_groups(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    *,
    max_group_padding: float = MAX_GROUP_PADDING,
    max_page_growth: int = MAX_PAGE_GROWTH,
) -> list[KVCacheGroupSpec]:
    """Groups of layers sharing a block table (policy in the module docstring).

    Hybrid models have their specs unified to one page size first; the returned groups carry
    the unified specs (block sizes raised, ``page_size_padded`` set where needed).
    """
    if not kv_cache_specs:
        return []
    specs = dict(kv_cache_specs)
    if len(set(specs.values())) == 1:
        return [_group_spec(list(specs), specs)]
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    if uniform is not None:
        return [KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=uniform)]
    specs = unify_kv_cache_spec_page_size(specs, max_page_growth)
    same_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        same_spec.setdefault(spec, []).append(name)
    group_size = _choose_group_size([len(v) for v in same_spec.values()], max_group_padding)
    groups: list[KVCacheGroupSpec] = []
    for layers in same_spec.values():
        num_groups = cdiv(len(layers), group_size)
        groups.extend(_group_spec(layers[i::num_groups], specs) for i in range(num_groups))
    return groups


def _layer_page_sizes(groups: Sequence[KVCacheGroupSpec]) -> dict[str, int]:
    pages: dict[str, int] = {}
    for group in groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            if isinstance(spec, UniformTypeKVCacheSpecs):
                pages[name] = spec.kv_cache_specs[name].page_size_bytes
            else:
                pages[name] = spec.page_size_bytes
    return pages


def _tensor_layout(groups: Sequence[KVCacheGroupSpec]) -> list[tuple[int, list[str]]]:
    """(page size, layers) of each tensor, before ``num_blocks`` is known."""
    pages = _layer_page_sizes(groups)
    if len(groups) == 1:
        return [(pages[name], [name]) for name in groups[0].layer_names]
    width = max(len(g.layer_names) for g in groups)
    layout = []
    for i in range(width):
        shared = [g.layer_names[i] for g in groups if i < len(g.layer_names)]
        sizes = {pages[name] for name in shared}
        if len(sizes) != 1:
            raise ValueError(
                f"kv_cache_groups: layers sharing tensor {i} must have one page size, got "
                f"{dict(zip(shared, (pages[n] for n in shared), strict=True))}"
            )
        layout.append((sizes.pop(), shared))
    return layout


def bytes_per_block(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Bytes one block id takes across all tensors (the sum of the tensors' page sizes)."""
    return sum(page for page, _ in _tensor_layout(groups))


def blocks_per_request(
    groups: Sequence[KVCacheGroupSpec],
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> int:
    """Blocks one request of ``max_model_len`` tokens needs, summed over groups (each group
    from its spec's ``max_memory_usage_bytes``; a Mamba group needs one block)."""
    total = 0
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        usage = spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
        total += cdiv(usage, spec.page_size_bytes)
    return total


def get_kv_cache_config_from_groups(
    groups: Sequence[KVCacheGroupSpec], available_memory: int
) -> KVCacheConfig:
    """The ``KVCacheConfig`` with the most blocks that fit in ``available_memory`` bytes.

    Each layer appears in exactly one tensor; each tensor is ``num_blocks`` pages of the one
    page size its layers share. ``num_blocks`` may be 0 when not even one block fits.
    """
    if available_memory < 0:
        raise ValueError(f"available_memory: expected ≥ 0 bytes, got {available_memory}")
    layout = _tensor_layout(groups)
    per_block = sum(page for page, _ in layout)
    num_blocks = available_memory // per_block if per_block else 0
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=page * num_blocks, shared_by=list(shared)) for page, shared in layout
        ],
        kv_cache_groups=list(groups),
    )


def _gib(num_bytes: int | float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def estimate_max_model_len(
    groups: Sequence[KVCacheGroupSpec],
    num_blocks: int,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> int:
    """The largest length ≤ ``max_model_len`` (tokens) whose one request fits in
    ``num_blocks``; 0 when not even one token fits."""
    lo, hi = 0, max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        batched = None if max_num_batched_tokens is None else min(max_num_batched_tokens, mid)
        if blocks_per_request(groups, mid, batched) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_enough_kv_cache_memory(
    groups: Sequence[KVCacheGroupSpec],
    available_memory: int,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> None:
    """Raise :class:`InsufficientKVCacheMemoryError` (a ``ValueError``) naming the bytes
    needed when not even one request of ``max_model_len`` tokens fits in ``available_memory``."""
    per_block = bytes_per_block(groups)
    num_blocks = available_memory // per_block
    needed_blocks = blocks_per_request(groups, max_model_len, max_num_batched_tokens)
    if needed_blocks <= num_blocks:
        return
    needed = needed_blocks * per_block
    fits = estimate_max_model_len(groups, num_blocks, max_model_len, max_num_batched_tokens)
    hint = (
        f"the largest max_model_len that fits is {fits}"
        if fits
        else "not even a 1-token request fits"
    )
    raise InsufficientKVCacheMemoryError(
        f"available_memory: one request of max_model_len={max_model_len} tokens needs "
        f"{needed} bytes ({_gib(needed)}) of KV cache ({needed_blocks} blocks of {per_block} "
        f"bytes), more than the {available_memory} bytes ({_gib(available_memory)}) available; "
        f"{hint}. Raise the memory budget, lower max_model_len, pick a smaller kv_cache_dtype "
        f"or use more tensor parallelism.",
        needed_bytes=needed,
        available_bytes=available_memory,
        max_model_len=max_model_len,
        max_model_len_that_fits=fits,
    )


def get_kv_cache_config(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    max_model_len: int,
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> KVCacheConfig:
    """Groups + tensors for ``kv_cache_specs`` in ``available_memory`` bytes; raises when not
    even one request of ``max_model_len`` tokens fits."""
    check_positive_int("max_model_len", max_model_len)
    groups = get_kv_cache_groups(kv_cache_specs)
    if not groups:
        raise ValueError("kv_cache_specs: the model has no layer that needs a KV cache")
    check_enough_kv_cache_memory(groups, available_memory, max_model_len, max_num_batched_tokens)
    return get_kv_cache_config_from_groups(groups, available_memory)


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
        return estimate_max_model_len(
            self.kv_cache_config.kv_cache_groups,
            self.kv_cache_config.num_blocks,
            self.max_model_len,
            self.max_num_batched_tokens,
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
        config_out = get_kv_cache_config_from_groups(
            get_kv_cache_groups(base.specs), available_memory
        )
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
