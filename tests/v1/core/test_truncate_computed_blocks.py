"""KVCacheManager.truncate_computed_blocks (a lookup result cut to a shorter aligned length)
and the hybrid lookup's handling of groups that opt out of prefix caching."""

from __future__ import annotations

import pytest
import torch

from tests.v1.core.block_manager_test_utils import full, make_request
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.truncated_hits import HitTruncationError
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

HASH = 2
MAMBA_BLOCK = 2 * HASH


def make_manager(*, with_ring: bool = False) -> KVCacheManager:
    groups = [
        KVCacheGroupSpec(["attn"], full(HASH)),
        KVCacheGroupSpec(
            ["ssm"],
            MambaSpec(
                block_size=MAMBA_BLOCK,
                shapes=((1, 1),),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
            ),
        ),
    ]
    if with_ring:
        ring = CircularBufferSpec(
            block_size=MAMBA_BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        groups.append(KVCacheGroupSpec(["ring"], ring))
    config = KVCacheConfig(num_blocks=24, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(config, max_model_len=1024, enable_caching=True, hash_block_size=HASH)


def cached_hit(manager: KVCacheManager) -> KVCacheBlocks:
    """A 6-token hit: three full-attention pages and a Mamba state inside its second page."""
    producer = make_request("producer", [0, 0, 1, 1, 2, 2, 3], HASH)
    blocks, num_hit, _ = manager.get_computed_blocks(producer)
    assert manager.allocate_slots(producer, 6, num_hit, blocks) is not None
    manager.free(producer)
    manager.new_step_starts()
    blocks, num_hit, _ = manager.get_computed_blocks(
        make_request("consumer", [0, 0, 1, 1, 2, 2, 3, 3], HASH)
    )
    assert num_hit == 6
    return blocks


def test_truncation_is_a_view_that_keeps_null_placeholders() -> None:
    manager = make_manager()
    blocks = cached_hit(manager)
    ref_cnts = [b.ref_cnt for group in blocks.blocks for b in group]
    truncated = manager.truncate_computed_blocks(blocks, MAMBA_BLOCK)
    assert [len(g) for g in truncated.blocks] == [2, 1]
    assert truncated.blocks[1][0].is_null
    assert [len(g) for g in blocks.blocks] == [3, 2]
    assert [b.ref_cnt for group in blocks.blocks for b in group] == ref_cnts
    # Nothing kept: the shared empty answer.
    assert manager.truncate_computed_blocks(blocks, 0) is manager.empty_kv_cache_blocks


def test_a_short_mamba_hit_is_allowed_a_short_attention_hit_is_not() -> None:
    manager = make_manager()
    blocks = cached_hit(manager)
    short_mamba = KVCacheBlocks((list(blocks.blocks[0]), []))
    assert [len(g) for g in manager.truncate_computed_blocks(short_mamba, 4).blocks] == [2, 0]
    short_attention = KVCacheBlocks((list(blocks.blocks[0][:1]), list(blocks.blocks[1])))
    with pytest.raises(HitTruncationError, match="expected at most group 0's hit of 2 tokens"):
        manager.truncate_computed_blocks(short_attention, 4)


@pytest.mark.parametrize(
    ("num_tokens", "error", "match"),
    [
        (6, HitTruncationError, "expected a multiple of group 1's block_size 4"),
        (-4, HitTruncationError, "num_computed_tokens: expected >= 0"),
        (True, TypeError, "num_computed_tokens: expected an int"),
    ],
)
def test_bad_lengths_are_refused(num_tokens: int, error: type[Exception], match: str) -> None:
    manager = make_manager()
    blocks = cached_hit(manager)
    with pytest.raises(error, match=match):
        manager.truncate_computed_blocks(blocks, num_tokens)


def test_truncation_errors_are_assertion_errors_too() -> None:
    # v0.33 asserts these conditions; callers catching AssertionError keep working.
    manager = make_manager()
    with pytest.raises(AssertionError):
        manager.truncate_computed_blocks(cached_hit(manager), 6)
    with pytest.raises(ValueError, match="blocks: expected 2 KV cache groups, got 1"):
        manager.truncate_computed_blocks(KVCacheBlocks(([],)), 0)


def test_scratch_groups_are_skipped_by_lookup_and_truncation() -> None:
    manager = make_manager(with_ring=True)
    coordinator = manager.coordinator
    # The ring is never looked up, and does not stop partial hash hits.
    assert [g.group_ids for g in coordinator.attention_groups] == [[0], [1]]
    assert coordinator.enable_partial_hash_hits
    assert coordinator._cache_hit_alignment_tokens == HASH
    blocks = cached_hit(manager)
    assert blocks.blocks[2] == []
    assert [len(g) for g in manager.truncate_computed_blocks(blocks, 4).blocks] == [2, 1, 0]
    ring_page = manager.block_pool.get_new_blocks(1)
    with pytest.raises(HitTruncationError, match="expected no hit pages for scratch group 2"):
        manager.truncate_computed_blocks(KVCacheBlocks(([], [], ring_page)), 0)
