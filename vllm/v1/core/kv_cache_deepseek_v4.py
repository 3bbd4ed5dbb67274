"""DeepSeek-V4's KV-cache groups: upstream v0.22's layer-tuple layout, used by
:func:`~vllm.v1.core.kv_cache_grouping.get_kv_cache_groups` and the sizing functions of
:mod:`vllm.v1.core.kv_cache_sizing`.

Every DeepSeek-V4 layer needs the same token slots, but the full-MLA caches (compressed KV at
ratio 4 and 128, indexer keys) and the sliding-window caches (the SWA latent, the compressors'
states) differ in block size and window. The layers therefore form several
``UniformTypeKVCacheSpecs`` groups:

* group 0 holds every full-MLA layer; its distinct page sizes (bytes) make one *layer tuple*
  (one layer of each size), and it holds ``get_num_layer_tuples()`` tuples;
* each sliding-window kind (same block size and window) is split into sub-groups of about as
  many tuples as group 0, after each of its pages is padded up to the nearest full-MLA page.

The tensors are laid out tuple by tuple: tensor ``(t, p)`` has pages of ``p`` bytes and holds
layer ``t`` of size ``p`` of every group, so one block id costs
``sum(full-MLA page sizes) x num_layer_tuples`` bytes (:class:`LayerTupleLayout`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import (
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
    cdiv,
)

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig

__all__ = ["LayerTupleLayout", "group_and_unify_kv_cache_specs", "layer_tuple_layout"]

_DEEPSEEK_V4 = "deepseek_v4"
"""The specs' ``model_version`` of DeepSeek-V4 layers."""


def group_and_unify_kv_cache_specs(
    kv_cache_spec: dict[str, KVCacheSpec],
) -> list[UniformTypeKVCacheSpecs] | None:
    """DeepSeek-V4's uniform groups: first all full-MLA layers, then one group per
    ``(block_size, sliding_window)`` of the sliding-window MLA layers (SWA latents, ratio-4
    compressor states, ratio-128 compressor states), in order of first appearance.

    None without a sliding-window MLA layer (as upstream), and also where upstream would fail
    an assertion or drop layers: a layer of another spec type, no full-MLA layer, or full-MLA
    layers of several block sizes (tokens).
    """
    if not any(isinstance(spec, SlidingWindowMLASpec) for spec in kv_cache_spec.values()):
        return None
    full: dict[str, KVCacheSpec] = {}
    windowed: dict[tuple[int, int], dict[str, KVCacheSpec]] = defaultdict(dict)
    for name, spec in kv_cache_spec.items():
        if isinstance(spec, SlidingWindowMLASpec):
            windowed[(spec.block_size, spec.sliding_window)][name] = spec
        elif isinstance(spec, MLAAttentionSpec):
            full[name] = spec
        else:
            return None
    if not full:
        return None
    groups = [UniformTypeKVCacheSpecs.from_specs(full)]
    groups.extend(UniformTypeKVCacheSpecs.from_specs(specs) for specs in windowed.values())
    if any(group is None for group in groups):
        return None
    return [group for group in groups if group is not None]


def _approximate_gcd(values: Sequence[int], *, lower_bound: int | None = None) -> int:
    """The chunk size d in ``[max(lower_bound, 1), max(values)]`` that wastes the fewest slots
    when every value is rounded up to a multiple of d (``sum(-x mod d)``); ties go to the
    larger d. ``lower_bound`` itself when it exceeds every value. ``ValueError`` for no values
    or a value that is not positive."""
    if not values:
        raise ValueError(f"values: expected at least one value, got {list(values)!r}")
    if any(x <= 0 for x in values):
        raise ValueError(f"values: expected positive ints, got {list(values)!r}")
    low = max(1, lower_bound if lower_bound is not None else 1)
    best, best_pad = low, None
    for d in range(low, max(values) + 1):
        pad = sum(-x % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def _padded_page_buckets(
    windowed: UniformTypeKVCacheSpecs, full_page_sizes: Sequence[int]
) -> dict[int, list[str]] | None:
    """The layers of ``windowed`` by the full-MLA page size (bytes) each is padded to (the
    nearest one at least its page), in order of first appearance. None when a page exceeds
    every full-MLA page or the sizes do not get the same number of layers."""
    buckets: dict[int, list[str]] = defaultdict(list)
    for name, spec in windowed.kv_cache_specs.items():
        fitting = [size for size in full_page_sizes if size >= spec.page_size_bytes]
        if not fitting:
            return None
        buckets[min(fitting)].append(name)
    if len({len(names) for names in buckets.values()}) != 1:
        return None
    return buckets


def _fits_layer_tuples(grouped_specs: Sequence[UniformTypeKVCacheSpecs]) -> bool:
    """True when :func:`_get_kv_cache_groups_uniform_groups` can lay out ``grouped_specs``:
    full-MLA layers first, then sliding-window MLA groups whose pages pad up to full-MLA pages
    with as many layers per size."""
    if not grouped_specs:
        return False
    full, *windowed = grouped_specs
    if not all(isinstance(s, MLAAttentionSpec) for s in full.kv_cache_specs.values()):
        return False
    full_pages = full.get_page_sizes()
    return all(
        all(isinstance(s, SlidingWindowMLASpec) for s in group.kv_cache_specs.values())
        and _padded_page_buckets(group, full_pages) is not None
        for group in windowed
    )


def _get_kv_cache_groups_uniform_groups(
    grouped_specs: list[UniformTypeKVCacheSpecs],
) -> list[KVCacheGroupSpec]:
    """The groups of the layer-tuple layout (module docstring) for the output of
    :func:`group_and_unify_kv_cache_specs`.

    The tuple count is :func:`_approximate_gcd` of the groups' tuple counts, at least the
    full-MLA group's. A sliding-window group of n layers per page size becomes
    ``cdiv(n, tuples)`` sub-groups, tuple i going to sub-group ``i % count``, and each of its
    pages is padded (``page_size_padded``) to the nearest full-MLA page size. Upstream pads the
    caller's specs in place; here the groups hold padded copies (``dataclasses.replace``) and
    ``grouped_specs`` and the caller's dict are left as they were: the groups are the same.
    ``ValueError`` when the specs cannot be laid out this way.
    """
    if not _fits_layer_tuples(grouped_specs):
        raise ValueError(
            "grouped_specs: expected a full-MLA group then sliding-window MLA groups whose "
            "pages pad up to full-MLA pages with as many layers per page size, got "
            f"{[sorted(g.get_page_sizes()) for g in grouped_specs]} (page sizes in bytes)"
        )
    full = grouped_specs[0]
    counts = [group.get_num_layer_tuples() for group in grouped_specs]
    num_layer_tuples = _approximate_gcd(counts, lower_bound=counts[0])
    groups = [KVCacheGroupSpec(list(full.kv_cache_specs), full)]
    for windowed in grouped_specs[1:]:
        buckets = _padded_page_buckets(windowed, full.get_page_sizes())
        assert buckets is not None  # checked by _fits_layer_tuples
        padded = {
            name: _pad_page(windowed.kv_cache_specs[name], size)
            for size, names in buckets.items()
            for name in names
        }
        layer_tuples = list(zip(*buckets.values(), strict=True))
        num_sub_groups = cdiv(len(layer_tuples), num_layer_tuples)
        for i in range(num_sub_groups):
            names = [name for tup in layer_tuples[i::num_sub_groups] for name in tup]
            sub = UniformTypeKVCacheSpecs.from_specs({name: padded[name] for name in names})
            assert sub is not None  # a subset of one uniform group
            groups.append(KVCacheGroupSpec(names, sub))
    return groups


def _pad_page(spec: KVCacheSpec, page_size: int) -> KVCacheSpec:
    """``spec`` with pages of ``page_size`` bytes (unchanged when they already are)."""
    if spec.page_size_bytes == page_size:
        return spec
    return replace(spec, page_size_padded=page_size)


def _annotate_eagle_groups_deepseek_v4(
    vllm_config: VllmConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    kv_cache_groups: list[KVCacheGroupSpec],
) -> None:
    """With an EAGLE-style drafter and DeepSeek-V4 layers, flag (``is_eagle_group``, in place)
    the group holding the last layer of ``kv_cache_spec``: DeepSeek-V4's MTP layer comes
    last."""
    spec_config = vllm_config.speculative_config
    if spec_config is None or not spec_config.use_eagle():
        return
    if not any(getattr(s, "model_version", None) == _DEEPSEEK_V4 for s in kv_cache_spec.values()):
        return
    last_layer = next(reversed(kv_cache_spec))
    for group in kv_cache_groups:
        if last_layer in group.layer_names:
            group.is_eagle_group = True
            return


@dataclass(frozen=True)
class LayerTupleLayout:
    """The shared tensors of layer-tuple groups: ``page_sizes`` are the full-MLA group's
    distinct page sizes (bytes, ascending), one tensor each per tuple, ``num_layer_tuples``
    the most tuples any group has."""

    page_sizes: tuple[int, ...]
    num_layer_tuples: int

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id takes over all tensors: one page of each size per tuple."""
        return sum(self.page_sizes) * self.num_layer_tuples


def layer_tuple_layout(kv_cache_groups: Sequence[KVCacheGroupSpec]) -> LayerTupleLayout | None:
    """The tensor layout when ``kv_cache_groups`` are DeepSeek-V4's (several groups, all
    ``UniformTypeKVCacheSpecs``, the full-MLA group first), else None."""
    specs = [group.kv_cache_spec for group in kv_cache_groups]
    uniform = [spec for spec in specs if isinstance(spec, UniformTypeKVCacheSpecs)]
    if len(specs) < 2 or len(uniform) != len(specs):
        return None
    return LayerTupleLayout(
        page_sizes=tuple(sorted(uniform[0].get_page_sizes())),
        num_layer_tuples=max(spec.get_num_layer_tuples() for spec in uniform),
    )
