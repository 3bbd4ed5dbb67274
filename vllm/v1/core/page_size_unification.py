"""Page-size unification: the specs of a hybrid model's layers → one page size P.

Two policies. Upstream v0.33's (the default bounds 1, 1; :func:`unify_kv_cache_spec_page_size`
without bounds): P is the largest page; a smaller page that divides P grows its block size by
the ratio, a Mamba page is padded to P (its block size, the caching granularity, unchanged), and
a K/V attention page that does not divide P is padded to P as well (v0.22 refused it). A latent
(MLA) page that does not divide P raises :class:`PageSizeUnificationError`: sparse MLA indexes
its cache in whole token rows, so its block stride cannot be padded to an arbitrary size; the
grouping then tries the full-allocation fallback. The rest of this docstring is the planner's
policy (bounds :data:`MAX_PAGE_GROWTH`, :data:`MAX_EXACT_PAGE_GROWTH`).

In the hybrid allocator layout (:mod:`vllm.v1.core.kv_cache_utils`) all groups draw block ids
from one pool and layers at the same position in each group share one tensor, so every page
must have one size P. The policy:

- an attention-like spec may grow its block size by an integer factor m (page ∝ tokens,
  so bytes per token are unchanged; only the allocation granularity grows);
- a Mamba state cannot be split, so P ≥ the largest Mamba page, and Mamba pages are padded
  (``page_size_padded``) up to P — upstream raises the attention block size until the
  attention page ≥ the Mamba page, then pads the Mamba page; this policy gives the same
  result (e.g. Qwen3-Next: block 544, Nemotron-H: block 2080);
- plain attention pages (K/V, not latent) are **never padded**: the worker splits a page of
  ``block_size`` slots into kernel blocks (the largest size the backend supports that
  divides it, e.g. FlashInfer's 16/32/64) and rejects a padded page it would have to split
  (``init_layer_kv_caches._attention_view``). So P is a multiple of L = lcm(base pages of the plain
  attention specs), and each such spec takes block ``block_size × P / page`` — a multiple
  of the requested block size with a page of exactly P. E.g. GPT-OSS nvfp4 with bf16
  sliding-window layers (H=8, D=64): 32768 B and 9216 B per 16 tokens, L = 294912 B, so
  sliding block 144 and full block 512 (not full 112 padded to 65536 B);
- only pages no backend splits are padded up to P: Mamba states (one view per page), latent
  (MLA) pages, whose backend's kernel block is the whole block, and K/V pages holding key
  sink rows (their page is not proportional to the block size, and their sink rows belong to
  the whole page). Such a spec takes the largest block multiple whose page fits in P;
- P is the candidate with the least padding (to 0.1 %), then the smallest; candidates are
  the multiples of L (without plain attention: the latent page sizes) from the largest base
  page B up to ``max_page_growth`` × B, or just the first multiple of L ≥ B when that lies
  beyond. Exact multiples (DeepSeek-V4 bf16: 1024 B/slot at ratio 4 vs 1024 B/token in the
  window) need no padding.

Waste bound: plain attention pages carry 0 padding bytes. P ≤ max(``max_page_growth`` × B,
⌈B / L⌉ × L), and L ≤ ``max_exact_page_growth`` (64) × B (else ``ValueError``), so P ≤ 64 B
and no block grows by more than 64 × B / (its base page). The page padding share of the
chosen P is at most that of the smallest candidate P₀ (+0.1 %, the rounding), where every
padded page of P₀ is short of P₀ by less than one step (L for Mamba, one block multiple for
the other padded pages). Larger blocks cost at most one partly filled block per group per
request.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import replace
from fractions import Fraction

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheSpec,
    LatentPageSpec,
    MambaSpec,
    MLAAttentionSpec,
    cdiv,
)

__all__ = [
    "MAX_EXACT_PAGE_GROWTH",
    "MAX_PAGE_GROWTH",
    "PageSizeUnificationError",
    "unify_kv_cache_spec_page_size",
]

MAX_PAGE_GROWTH = 2
"""The planner's bound: the unified page is searched up to this many times the largest base
page (further only when the exact attention page needs it)."""

MAX_EXACT_PAGE_GROWTH = 64
"""The planner's bound: the least common multiple of the plain attention pages may be at most
this many times the largest base page; beyond it the planner refuses rather than pad."""


class PageSizeUnificationError(ValueError, NotImplementedError):
    """The pages cannot be unified within the bounds. A ``ValueError`` like every planning error
    here, and a ``NotImplementedError`` as upstream raises for pages that do not divide the
    largest one."""


def _is_state(spec: KVCacheSpec) -> bool:
    return isinstance(spec, MambaSpec)


def _unpadded(spec: KVCacheSpec, block_size: int) -> KVCacheSpec:
    return replace(spec, block_size=block_size, page_size_padded=None)  # type: ignore[type-var]


def _is_plain_attention(spec: KVCacheSpec) -> bool:
    """K/V attention pages that a backend may split into kernel blocks (not latent, not state,
    no key sink rows: a page's sink rows make its size no multiple of a smaller page's)."""
    return (
        not _is_state(spec)
        and not isinstance(spec, LatentPageSpec)
        and getattr(spec, "sink_bytes_per_page", 0) == 0
    )


def _unify_to_largest_page(kv_cache_specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Upstream v0.33's rule: every page becomes the largest one, P bytes. A page dividing P
    grows its block size by the ratio (Mamba excepted: its page does not scale with the block
    size); Mamba pages and K/V attention pages that do not divide P are padded to P, block size
    unchanged. :class:`PageSizeUnificationError` for any other page that does not divide P (a
    latent MLA page, whose cache is addressed in whole token rows)."""
    target = max(spec.page_size_bytes for spec in kv_cache_specs.values())
    unified: dict[str, KVCacheSpec] = {}
    for name, spec in kv_cache_specs.items():
        page = spec.page_size_bytes
        if page == target:
            new = spec
        elif isinstance(spec, MambaSpec) or (
            target % page != 0
            and isinstance(spec, AttentionSpec)
            and not isinstance(spec, MLAAttentionSpec)
        ):
            new = replace(spec, page_size_padded=target)  # type: ignore[type-var]
        elif target % page == 0:
            new = replace(spec, block_size=spec.block_size * (target // page))  # type: ignore[type-var]
        else:
            raise PageSizeUnificationError(
                f"kv_cache_specs: layer {name!r} has a {page}-byte page that does not divide "
                f"the largest page ({target} bytes) and cannot be padded (only Mamba and "
                f"non-MLA attention pages can); got {type(spec).__name__}"
            )
        if new.page_size_bytes != target:
            raise PageSizeUnificationError(
                f"kv_cache_specs: layer {name!r} ({type(spec).__name__}) cannot reach the "
                f"{target}-byte page: got {new.page_size_bytes} bytes"
            )
        unified[name] = new
    return unified


def unify_kv_cache_spec_page_size(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    max_page_growth: int = 1,
    max_exact_page_growth: int = 1,
) -> dict[str, KVCacheSpec]:
    """The same layers with one page size P (policies in the module docstring).

    The default bounds (1, 1) select upstream v0.33's rule (:func:`_unify_to_largest_page`);
    the planner passes :data:`MAX_PAGE_GROWTH` and :data:`MAX_EXACT_PAGE_GROWTH` for the search
    below. ``ValueError`` when a bound is below 1.

    Plain attention specs get block sizes that are integer multiples of their own with pages
    of exactly P (never padded: the worker splits their pages into kernel blocks and rejects
    padding it would have to split); latent (MLA) specs take the largest block multiple whose
    page fits in P and are padded up to P; Mamba specs are padded to P. Specs are returned
    unchanged when they already share one page size. ``ValueError`` when plain attention pages
    have no common multiple within ``max_exact_page_growth`` × the largest base page
    (:class:`PageSizeUnificationError`).
    """
    for name, bound in (
        ("max_page_growth", max_page_growth),
        ("max_exact_page_growth", max_exact_page_growth),
    ):
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {bound!r}")
    distinct = list(dict.fromkeys(kv_cache_specs.values()))
    if len({s.page_size_bytes for s in distinct}) <= 1:
        return dict(kv_cache_specs)
    if max_page_growth == 1 and max_exact_page_growth == 1:
        return _unify_to_largest_page(kv_cache_specs)
    counts = {spec: 0 for spec in distinct}
    for spec in kv_cache_specs.values():
        counts[spec] += 1
    base_max = max(s.page_size_bytes for s in distinct)
    limit = max_page_growth * base_max
    scalable = [s for s in distinct if not _is_state(s)]
    plain = {s for s in scalable if _is_plain_attention(s)}

    # Plain attention pages are exact: P is a multiple of the lcm of their base pages.
    step = math.lcm(*(s.page_size_bytes for s in plain)) if plain else 0
    if step > max_exact_page_growth * base_max:
        raise PageSizeUnificationError(
            f"kv_cache_specs: the attention pages "
            f"{sorted({s.page_size_bytes for s in plain})} bytes have no common multiple "
            f"within {max_exact_page_growth}× the largest page ({base_max} bytes; the least "
            f"common multiple is {step}); padding them instead would break kernel-block "
            "splitting. Use block sizes whose pages divide each other"
        )
    candidates: list[int] = []
    if plain:
        first = cdiv(base_max, step) * step
        candidates = list(range(first, max(first, limit) + 1, step))
    top = candidates[-1] if candidates else limit

    # Pages each latent spec can have, by block multiple m = 1, 2, ... up to the top.
    ladders: dict[KVCacheSpec, list[int]] = {}
    for spec in scalable:
        if spec in plain:
            continue
        pages: list[int] = []
        m = 1
        while True:
            page = _unpadded(spec, spec.block_size * m).page_size_bytes
            pages.append(page)
            if page >= top:
                break
            m += 1
        ladders[spec] = pages

    def fit(spec: KVCacheSpec, target: int) -> tuple[int, int]:
        """(block multiple, unpadded page) of the largest page ≤ target."""
        if _is_state(spec):
            return 1, spec.page_size_bytes
        if spec in plain:
            return target // spec.page_size_bytes, target
        pages = ladders[spec]
        m = max(1, bisect.bisect_right(pages, target))  # pages[0] ≤ base_max ≤ target
        return m, pages[m - 1]

    if not plain:
        candidates = sorted(
            {p for pages in ladders.values() for p in pages if base_max <= p <= limit}
        )
        if not candidates:  # only Mamba specs: pad to the largest
            candidates = [base_max]
    total_layers = len(kv_cache_specs)

    def waste(target: int) -> Fraction:
        pad = sum(counts[s] * (target - fit(s, target)[1]) for s in distinct)
        return Fraction(pad, target * total_layers)

    target = min(candidates, key=lambda p: (round(float(waste(p)), 3), p))

    unified: dict[KVCacheSpec, KVCacheSpec] = {}
    anchor_block: int | None = None
    for spec in scalable:
        m, page = fit(spec, target)
        new = _unpadded(spec, spec.block_size * m)
        if page != target:
            new = replace(new, page_size_padded=target)  # type: ignore[type-var]
        elif anchor_block is None:
            anchor_block = new.block_size
        unified[spec] = new
    for spec in distinct:
        if _is_state(spec):
            new = replace(spec, page_size_padded=None if spec.page_size_bytes == target else target)
            if anchor_block is not None:
                new = replace(new, block_size=anchor_block)
            unified[spec] = new
    return {name: unified[spec] for name, spec in kv_cache_specs.items()}
