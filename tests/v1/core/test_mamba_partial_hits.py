"""Partial hash hits: prefix hits ending inside a Mamba state page (and inside a full-attention
page), the copy-on-write of the shared page, and the block-pool keying behind them."""

from __future__ import annotations

import pytest
import torch

from tests.v1.core.block_manager_test_utils import full, make_request, sliding
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_block import KVCacheBlockCopy
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import partial_hash_hits_enabled
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

HASH = 16


def mamba(block_size: int) -> MambaSpec:
    return MambaSpec(
        block_size=block_size, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )


def make_manager(full_block: int = HASH, mamba_block: int = 64, **kwargs) -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["attn"], full(full_block)),
            KVCacheGroupSpec(["ssm"], mamba(mamba_block)),
        ],
    )
    return KVCacheManager(
        config, max_model_len=4096, enable_caching=True, hash_block_size=HASH, **kwargs
    )


def prefill(manager: KVCacheManager, request, num_tokens: int) -> None:
    assert manager.allocate_slots(request, num_tokens - request.num_computed_tokens) is not None
    request.num_computed_tokens = num_tokens
    manager.new_step_starts()


# --- BlockPool keying ---------------------------------------------------------------------


def hashed_request(num_tokens: int = 4 * HASH):
    return make_request("r", list(range(num_tokens)), HASH)


def test_cache_partial_block_keys_by_prefix_hash_with_events() -> None:
    pool = BlockPool(8, enable_caching=True, hash_block_size=HASH, enable_kv_cache_events=True)
    request = hashed_request()
    (block,) = pool.get_new_blocks(1)
    key = pool.cache_partial_block(request, block, 3 * HASH, 1, 4 * HASH)
    assert key is not None and block.block_hash == key
    assert block.block_hash_num_tokens == 3 * HASH
    assert pool.get_cached_block(request.block_hashes[2], [1]) == [block]
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.token_ids == list(range(2 * HASH, 3 * HASH))
    # Re-keying a state page drops its old key (one state per page).
    pool.cache_partial_block(request, block, HASH, 1, 4 * HASH, replace_existing_hashes=True)
    assert pool.get_cached_block(request.block_hashes[2], [1]) is None
    assert isinstance(pool.take_events()[0], BlockRemoved)
    assert pool.cache_partial_block(request, pool.null_block, HASH, 1, 4 * HASH) is None


def test_a_kv_page_keeps_its_longer_key_and_serves_shorter_prefixes() -> None:
    pool = BlockPool(8, enable_caching=True, hash_block_size=HASH, enable_kv_cache_events=True)
    request = hashed_request()
    (block,) = pool.get_new_blocks(1)
    long_key = pool.cache_partial_block(request, block, 3 * HASH, 0, 4 * HASH)
    short_key = pool.cache_partial_block(request, block, 2 * HASH, 0, 4 * HASH)
    assert block.block_hash == long_key and block.block_hash_num_tokens == 3 * HASH
    assert pool.cached_block_hashes_by_block == {block.block_id: {short_key}}
    for position in (1, 2):
        assert pool.get_cached_block(request.block_hashes[position], [0]) == [block]
    # The same key again is no new entry and no event.
    assert pool.cache_partial_block(request, block, 2 * HASH, 0, 4 * HASH) == short_key
    assert len(pool.take_events()) == 2
    # A longer key replaces both.
    pool.cache_partial_block(request, block, 4 * HASH, 0, 4 * HASH)
    assert pool.cached_block_hashes_by_block == {}
    assert pool.get_cached_block(request.block_hashes[1], [0]) is None
    assert pool.get_cached_block(request.block_hashes[2], [0]) is None
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 2


def test_eviction_and_moves_take_every_key_of_a_page() -> None:
    pool = BlockPool(8, enable_caching=True, hash_block_size=HASH, enable_kv_cache_events=True)
    request = hashed_request()
    src, dst = pool.get_new_blocks(2)
    pool.cache_partial_block(request, src, 3 * HASH, 0, 4 * HASH)
    pool.cache_partial_block(request, src, HASH, 0, 4 * HASH)
    pool.move_block_hashes(src, dst)
    assert src.block_hash is None and src.block_id not in pool.cached_block_hashes_by_block
    assert dst.block_hash_num_tokens == 3 * HASH
    for position in (0, 2):
        assert pool.get_cached_block(request.block_hashes[position], [0]) == [dst]
    pool.take_events()
    pool.evict_blocks({dst.block_id})
    assert pool.cached_block_hashes_by_block == {}
    assert len(pool.take_events()) == 2
    for position in (0, 2):
        assert pool.get_cached_block(request.block_hashes[position], [0]) is None


@pytest.mark.parametrize("num_tokens", [0, HASH + 1, 5 * HASH])
def test_cache_partial_block_rejects_bad_positions(num_tokens: int) -> None:
    pool = BlockPool(8, enable_caching=True, hash_block_size=HASH)
    (block,) = pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="num_tokens: expected"):
        pool.cache_partial_block(hashed_request(), block, num_tokens, 0, 4 * HASH)
    assert block.block_hash is None


def test_move_block_hash_and_full_promotion() -> None:
    pool = BlockPool(8, enable_caching=True, hash_block_size=HASH)
    request = hashed_request()
    src, dst = pool.get_new_blocks(2)
    key = pool.cache_partial_block(request, src, HASH, 0, 2 * HASH)
    pool.move_block_hashes(src, dst)
    assert src.block_hash is None and dst.block_hash == key
    assert dst.block_hash_num_tokens == HASH
    with pytest.raises(ValueError, match="dst_block: expected"):
        pool.move_block_hashes(dst, dst)
    # A page keyed inside it gets its full key once full (the partial key goes).
    pool.cache_full_blocks(request, [dst], 0, 1, 2 * HASH, 0)
    assert dst.block_hash_num_tokens == 2 * HASH
    assert pool.get_cached_block(request.block_hashes[0], [0]) is None
    assert pool.get_cached_block(request.block_hashes[1], [0]) == [dst]


# --- when partial hits are on -------------------------------------------------------------


def test_partial_hash_hits_enabled_rules() -> None:
    groups = [KVCacheGroupSpec(["a"], full(HASH)), KVCacheGroupSpec(["m"], mamba(64))]
    classes = [FullAttentionManager, MambaManager]
    assert partial_hash_hits_enabled(groups, HASH, 1, classes)
    assert not partial_hash_hits_enabled(groups, 64, 1, classes)  # page == hash block
    # DCP widens the sharded attention pages: a Mamba page of one hash block is enough.
    assert partial_hash_hits_enabled(groups, HASH, 2, classes)
    one_hash = [groups[0], KVCacheGroupSpec(["m"], mamba(HASH))]
    assert partial_hash_hits_enabled(one_hash, HASH, 2, classes)
    assert not partial_hash_hits_enabled(one_hash, HASH, 1, classes)
    swa = [KVCacheGroupSpec(["s"], sliding(32, 64)), groups[1]]
    assert not partial_hash_hits_enabled(swa, HASH, 1, [SlidingWindowManager, MambaManager])
    manager = make_manager()
    assert manager.coordinator.enable_partial_hash_hits
    assert manager.coordinator.cache_hit_alignment_tokens == HASH


# --- Mamba producer / consumer ------------------------------------------------------------


def test_producer_prompt_tail_moves_to_a_copy_before_it_is_overwritten() -> None:
    manager = make_manager()
    tokens = list(range(100))  # prompt tail boundary: (100 - 1) // 16 * 16 = 96
    producer = make_request("p", tokens, HASH)
    prefill(manager, producer, 96)
    tail_key = producer.block_hashes[5]
    (state,) = manager.block_pool.get_cached_block(tail_key, [1])
    assert state.block_hash_num_tokens == 96
    assert manager.get_block_ids("p")[1][1] == state.block_id
    prefill(manager, producer, 100)
    (copy,) = manager.block_pool.get_cached_block(tail_key, [1])
    assert copy is not state and state.block_hash is None
    copies, retained = manager.take_kv_cache_block_copies()
    assert copies == [KVCacheBlockCopy(state.block_id, copy.block_id)]
    assert retained == [state, copy]
    manager.block_pool.free_blocks(retained)
    manager.free(producer)
    consumer = make_request("c", tokens, HASH)
    _, num_hit, _ = manager.get_computed_blocks(consumer)
    assert num_hit == 96


def test_consumer_copies_the_shared_partial_pages() -> None:
    manager = make_manager(full_block=32)
    tokens = list(range(90))  # prompt tail boundary 80: inside a 32- and a 64-token page
    producer = make_request("p", tokens, HASH)
    prefill(manager, producer, 80)
    prefill(manager, producer, 90)
    manager.free(producer)
    _, retained = manager.take_kv_cache_block_copies()
    manager.block_pool.free_blocks(retained)
    consumer = make_request("c", tokens + [7] * 40, HASH)
    blocks, num_hit, _ = manager.get_computed_blocks(consumer)
    assert num_hit == 80
    shared_attn = blocks.blocks[0][-1]
    shared_state = blocks.blocks[1][-1]
    assert shared_attn.block_hash_num_tokens == shared_state.block_hash_num_tokens == 80
    assert manager.allocate_slots(consumer, 50, num_hit, blocks) is not None
    ids = manager.get_block_ids("c")
    assert ids[0][2] != shared_attn.block_id and ids[1][1] != shared_state.block_id
    copies, retained = manager.take_kv_cache_block_copies()
    assert set(copies) == {
        KVCacheBlockCopy(shared_attn.block_id, ids[0][2]),
        KVCacheBlockCopy(shared_state.block_id, ids[1][1]),
    }
    manager.block_pool.free_blocks(retained)
    # The shared pages stay cached for other requests, unreferenced.
    assert manager.block_pool.get_cached_block(consumer.block_hashes[4], [0]) == [shared_attn]
    assert shared_attn.ref_cnt == 0 and shared_state.ref_cnt == 0
    manager.free(consumer)
    assert manager.block_pool.get_num_free_blocks() == 63


def test_lookahead_hash_flags_do_not_drop_without_eagle() -> None:
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["attn"], full(HASH), is_eagle_group=True),
            KVCacheGroupSpec(["ssm"], mamba(64)),
        ],
    )
    manager = KVCacheManager(
        config, max_model_len=4096, enable_caching=True, hash_block_size=HASH, use_eagle=False
    )
    assert not manager.coordinator.drop_eagle_group_ids
    assert not manager.coordinator.single_type_managers[0].use_eagle


def test_shared_prefix_checkpoint_needs_eagle_groups_and_partial_hits() -> None:
    def build(flag_eagle: bool, mamba_block: int) -> KVCacheManager:
        config = KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(["attn"], full(HASH), is_eagle_group=flag_eagle),
                KVCacheGroupSpec(["ssm"], mamba(mamba_block)),
            ],
        )
        return KVCacheManager(
            config,
            max_model_len=4096,
            enable_caching=True,
            hash_block_size=HASH,
            enable_mamba_shared_prefix_checkpoint=True,
        )

    on = build(True, 64)
    assert on.mamba_shared_prefix_checkpoint
    assert on.coordinator.single_type_managers[1].shared_prefix_checkpoint
    assert not build(False, 64).mamba_shared_prefix_checkpoint  # no EAGLE group
    assert not build(True, HASH).mamba_shared_prefix_checkpoint  # no partial hits


def test_junction_state_inside_a_page_is_published() -> None:
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["attn"], full(HASH), is_eagle_group=True),
            KVCacheGroupSpec(["ssm"], mamba(64)),
        ],
    )
    manager = KVCacheManager(
        config,
        max_model_len=4096,
        enable_caching=True,
        hash_block_size=HASH,
        enable_mamba_shared_prefix_checkpoint=True,
    )
    request = make_request("r", list(range(200)), HASH)
    request.shared_prefix_boundary = 48  # a sibling was seen to diverge after 48 tokens
    prefill(manager, request, 48)
    (state,) = manager.block_pool.get_cached_block(request.block_hashes[2], [1])
    assert state.block_hash_num_tokens == 48
