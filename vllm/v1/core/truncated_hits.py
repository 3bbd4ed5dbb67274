"""Cutting a prefix-cache lookup result back to a shorter aligned length.

A scheduler may keep fewer hit tokens than the lookup found (a KV connector supplies the rest,
or the hit must end on its chunk grid). The cut is a pure view: no page changes hands, no
reference count moves, and the lookup result itself stays as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.core.mamba_manager import MambaManager
from vllm.v1.core.single_type_manager_base import SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import KVCacheGroupSpec


class HitTruncationError(ValueError, AssertionError):
    """A hit cannot be cut at the asked length (an AssertionError too: v0.33 asserts)."""


def truncate_hit_blocks(
    blocks: Sequence[Sequence[KVCacheBlock]],
    groups: Sequence[KVCacheGroupSpec],
    managers: Sequence[SingleTypeKVCacheManager],
    num_computed_tokens: int,
) -> tuple[list[KVCacheBlock], ...]:
    """Each group's first ``num_computed_tokens // block_size`` hit pages (null placeholders
    kept), ``num_computed_tokens`` in tokens. Every prefix-cacheable group's page must divide
    it and, but for Mamba, its hit must reach it: a Mamba hit may stop short, since an external
    load can supply the final state. Scratch groups (not prefix-cacheable) never carry hits."""
    if len(blocks) != len(groups):
        raise HitTruncationError(
            f"blocks: expected {len(groups)} KV cache groups, got {len(blocks)}"
        )
    if isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, int):
        raise TypeError(
            f"num_computed_tokens: expected an int (tokens), got {num_computed_tokens!r}"
        )
    if num_computed_tokens < 0:
        raise HitTruncationError(
            f"num_computed_tokens: expected >= 0 (tokens), got {num_computed_tokens}"
        )
    truncated: list[list[KVCacheBlock]] = []
    for group_id, (group_blocks, group, manager) in enumerate(
        zip(blocks, groups, managers, strict=True)
    ):
        if not group.kv_cache_spec.prefix_cacheable:
            if group_blocks:
                raise HitTruncationError(
                    f"blocks: expected no hit pages for scratch group {group_id}, "
                    f"got {len(group_blocks)}"
                )
            truncated.append([])
            continue
        if num_computed_tokens % manager.block_size:
            raise HitTruncationError(
                f"num_computed_tokens: expected a multiple of group {group_id}'s block_size "
                f"{manager.block_size} (tokens), got {num_computed_tokens}"
            )
        num_blocks = num_computed_tokens // manager.block_size
        if isinstance(manager, MambaManager):
            num_blocks = min(num_blocks, len(group_blocks))
        elif num_blocks > len(group_blocks):
            raise HitTruncationError(
                f"num_computed_tokens: expected at most group {group_id}'s hit of "
                f"{len(group_blocks) * manager.block_size} tokens, got {num_computed_tokens}"
            )
        truncated.append(list(group_blocks[:num_blocks]))
    return tuple(truncated)
