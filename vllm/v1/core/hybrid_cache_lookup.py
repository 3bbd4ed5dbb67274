"""Prefix lookup of the hybrid coordinator: one hit length every KV cache group accepts.

Groups are bundled by equal spec (one lookup serves a bundle). A candidate length starts at the
cap and only shrinks: each bundle either accepts it or answers a shorter hit, and any shrink
restarts the round. Hits land on ``cache_hit_alignment_tokens`` boundaries: the LCM of the
groups' pages, or the hash block when Mamba pages take partial hits (a state ending inside its
page; see :func:`~vllm.v1.core.kv_cache_sizing.partial_hash_hits_enabled`).
"""

from __future__ import annotations

from math import lcm
from typing import TYPE_CHECKING, NamedTuple

from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_hashing import BlockHash, resolve_block_hashes
from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.core.kv_cache_sizing import partial_hash_hits_enabled
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_manager_base import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec


class SpecGroup(NamedTuple):
    """One lookup unit: a prefix-cacheable spec, the KV cache groups sharing it and their
    manager class (one lookup serves them all)."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]


AttentionGroup = SpecGroup


class HybridCacheLookup:
    """The lookup half of ``HybridKVCacheCoordinator``: the bundling of its groups (set up by
    ``_init_lookup``) and the lookup over the bundles. The coordinator sets the attributes
    before ``attention_groups``."""

    kv_cache_config: KVCacheConfig
    single_type_managers: tuple[SingleTypeKVCacheManager, ...]
    block_pool: BlockPool
    hash_block_size: int
    dcp_world_size: int
    drop_eagle_group_ids: set[int]
    attention_groups: list[AttentionGroup]
    eagle_attn_group_indices: set[int]
    lcm_block_size: int
    enable_partial_hash_hits: bool
    cache_hit_alignment_tokens: int
    num_groups: int

    def _init_lookup(self) -> None:
        groups = self.kv_cache_config.kv_cache_groups
        self.num_groups = len(groups)
        self.enable_partial_hash_hits = partial_hash_hits_enabled(
            groups,
            self.hash_block_size,
            self.dcp_world_size,
            [type(m) for m in self.single_type_managers],
        )
        self.verify_and_split_kv_cache_groups()
        # Hits land on hash blocks when Mamba states may end inside their pages.
        self.cache_hit_alignment_tokens = (
            self.hash_block_size if self.enable_partial_hash_hits else self.lcm_block_size
        )
        for manager in self.single_type_managers:
            manager.cache_hit_alignment_tokens = self.cache_hit_alignment_tokens

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        """v0.33's name of :attr:`cache_hit_alignment_tokens` (tokens)."""
        return self.cache_hit_alignment_tokens

    def verify_and_split_kv_cache_groups(self) -> None:
        """Bundle prefix-cacheable groups with equal specs (one lookup serves them all), full
        attention first: its cheap left-to-right scan bounds the others. Groups that opt out
        of prefix caching (scratch rings, bounded-replay windows) are never looked up: their
        hits stay empty. Sets ``attention_groups``, ``lcm_block_size`` (tokens, over the
        looked-up groups) and ``eagle_attn_group_indices``."""
        groups = self.kv_cache_config.kv_cache_groups
        bundles: list[SpecGroup] = []
        for i, group in enumerate(groups):
            if not group.kv_cache_spec.prefix_cacheable:
                continue
            manager = self.single_type_managers[i]
            manager_cls = type(manager)
            for spec, group_ids, cls in bundles:
                # A role may give equal specs different managers, or a pool of their own
                # (host-resident groups): those are looked up apart.
                if (
                    spec == group.kv_cache_spec
                    and cls is manager_cls
                    and self.single_type_managers[group_ids[0]].block_pool is manager.block_pool
                ):
                    group_ids.append(i)
                    break
            else:
                bundles.append(SpecGroup(group.kv_cache_spec, [i], manager_cls))
        if not bundles:
            raise ValueError(
                "kv_cache_config: HybridKVCacheCoordinator expected a prefix-cacheable group, "
                "got none"
            )
        self.attention_groups = sorted(
            bundles, key=lambda bundle: not isinstance(bundle.spec, FullAttentionSpec)
        )
        # No partial-page hits: a hit length must be whole pages in every looked-up group.
        self.lcm_block_size = lcm(
            *(self.single_type_managers[b.group_ids[0]].block_size for b in bundles)
        )
        self.eagle_attn_group_indices = {
            idx
            for idx, (_, group_ids, _) in enumerate(self.attention_groups)
            if self.drop_eagle_group_ids.intersection(group_ids)
        }
        # One lookup serves a bundle: its groups publish the same pages (EAGLE's extra one).
        for idx in self.eagle_attn_group_indices:
            for group_id in self.attention_groups[idx][1]:
                self.single_type_managers[group_id].use_eagle = True

    def _lookup(
        self,
        bundle: AttentionGroup,
        block_hashes: list[BlockHash],
        max_length: int,
        use_eagle: bool,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """One bundle's hit pages and hit length (tokens), at most ``max_length`` tokens
        (before EAGLE's drop)."""
        spec, group_ids, manager_cls = bundle
        manager = self.single_type_managers[group_ids[0]]
        fine_grained = (
            self.enable_partial_hash_hits and manager_cls.supports_fine_grained_hash_lookup
        )
        return manager_cls.find_longest_cache_hit(
            block_hashes=resolve_block_hashes(
                block_hashes,
                self.hash_block_size,
                manager.block_size,
                supports_fine_grained_hash_lookup=fine_grained,
                alignment_tokens=self.cache_hit_alignment_tokens,
            ),
            max_length=max_length,
            kv_cache_group_ids=group_ids,
            block_pool=manager.block_pool,  # a host-resident group has a pool of its own
            kv_cache_spec=spec,
            drop_eagle_block=use_eagle,
            alignment_tokens=self.cache_hit_alignment_tokens,
            dcp_world_size=manager.dcp_world_size,
            pcp_world_size=manager.pcp_world_size,
        )

    def _eagle_lookup_length(self, bundle: AttentionGroup, candidate: int, num_hashed: int) -> int:
        """EAGLE matches one page (one hash block with partial hash hits) more, then drops it:
        that page may lie past the cap (it is not used), as long as its hash exists."""
        spec, group_ids, manager_cls = bundle
        margin = self.single_type_managers[group_ids[0]].block_size
        if self.enable_partial_hash_hits:
            if isinstance(spec, MambaSpec):
                return candidate  # Mamba reads one state and drops nothing
            if manager_cls.supports_fine_grained_hash_lookup:
                margin = min(margin, self.hash_block_size)
        return min(candidate + margin, num_hashed)

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """Fixed point: each bundle accepts the candidate length or lowers it; any lowering
        restarts the round. Lengths only decrease, so this ends. Full attention's hit is
        downward closed: looked up once, then only cut to the candidate. The third value is
        the longest single bundle's answer past the reconciled hit (tokens)."""
        hits: list[list[KVCacheBlock] | None] = [None] * self.num_groups
        longest = 0
        # With one full-attention bundle and one other, the other's answer is final.
        one_round = len(self.attention_groups) == 2 and isinstance(
            self.attention_groups[0][0], FullAttentionSpec
        )
        # Bundles whose EAGLE drop was applied at the current candidate: at most once each.
        eagle_done: set[int] = set()
        num_hashed = len(block_hashes) * self.hash_block_size
        full_lengths: dict[int, int] = {}
        hit_length = max_cache_hit_length
        while True:
            candidate = hit_length
            for idx, bundle in enumerate(self.attention_groups):
                spec, group_ids, _ = bundle
                if isinstance(spec, FullAttentionSpec) and hits[group_ids[0]] is not None:
                    candidate = min(candidate, full_lengths[idx])
                    continue
                use_eagle = idx in self.eagle_attn_group_indices and idx not in eagle_done
                max_length = (
                    self._eagle_lookup_length(bundle, candidate, num_hashed)
                    if use_eagle
                    else candidate
                )
                found, found_length = self._lookup(bundle, block_hashes, max_length, use_eagle)
                if found_length > candidate:
                    # A kind that keeps EAGLE's extra page (Mamba reads one state and drops
                    # nothing) answered past the candidate, which the groups looked up before
                    # do not cover: look again, up to the candidate.
                    found, found_length = self._lookup(bundle, block_hashes, candidate, False)
                if use_eagle:
                    eagle_done.add(idx)
                elif found_length < candidate:
                    eagle_done.clear()  # the drop must be re-checked at the shorter length
                candidate = found_length
                full_lengths[idx] = found_length
                longest = max(longest, found_length)
                for group_id, blocks in zip(group_ids, found, strict=True):
                    hits[group_id] = blocks
            if candidate >= hit_length:
                break
            hit_length = candidate
            if one_round:
                break
        # Full attention's hits (targets' and drafts') are cut to the reconciled length, but
        # for kinds that retain their longer hit.
        for spec, group_ids, _ in self.attention_groups:
            manager = self.single_type_managers[group_ids[0]]
            if not isinstance(spec, FullAttentionSpec) or manager.retains_longer_hit:
                continue
            keep = cdiv(hit_length, manager.block_size)
            for group_id in group_ids:
                blocks = hits[group_id]
                if blocks is not None:
                    del blocks[keep:]
        hit_blocks = tuple(blocks if blocks is not None else [] for blocks in hits)
        return hit_blocks, hit_length, longest - hit_length

    def find_longest_cache_hit_per_group(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
        """Each bundle's own longest hit (pages, tokens) up to ``max_cache_hit_length``
        tokens, not reconciled across groups; EAGLE bundles apply their drop."""
        hit_blocks: list[list[KVCacheBlock]] = [[] for _ in range(self.num_groups)]
        hit_lengths = [0] * self.num_groups
        num_hashed = len(block_hashes) * self.hash_block_size
        for idx, bundle in enumerate(self.attention_groups):
            spec, group_ids, _ = bundle
            use_eagle = idx in self.eagle_attn_group_indices
            max_length = (
                self._eagle_lookup_length(bundle, max_cache_hit_length, num_hashed)
                if use_eagle
                else max_cache_hit_length
            )
            found, found_length = self._lookup(bundle, block_hashes, max_length, use_eagle)
            for group_id, blocks in zip(group_ids, found, strict=True):
                hit_blocks[group_id] = blocks
                hit_lengths[group_id] = found_length
        return tuple(hit_blocks), tuple(hit_lengths)
