"""Mamba align-mode state pages offered to a KV connector (boundary-state offloads), the prompt
tail published inside a state page (offered as its copy, or once at finish), dropping offers
of a freed request, and the block-pool hooks behind them (unpinned pages, cross-pool frees,
the event medium, partial keys' block_size check)."""

from __future__ import annotations

import pytest
import torch

from tests.v1.core.block_manager_test_utils import full, make_request
from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

HASH = 2
MAMBA_BLOCK = 2 * HASH
# Replays match at most the prompt less one token: 7 tokens -> the tail at 6, inside page 1.
PROMPT = [0, 0, 1, 1, 2, 2, 3]
TAIL = 6


def make_manager() -> KVCacheManager:
    spec = MambaSpec(
        block_size=MAMBA_BLOCK,
        shapes=((1, 1),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
    )
    config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["attn"], full(HASH)),
            KVCacheGroupSpec(["ssm"], spec),
        ],
    )
    return KVCacheManager(config, max_model_len=1024, enable_caching=True, hash_block_size=HASH)


def prefill_prompt(manager: KVCacheManager, rid: str = "r"):
    request = make_request(rid, PROMPT, HASH)
    blocks, num_hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, TAIL, num_hit, blocks) is not None
    return request


def test_prompt_tail_is_offered_as_its_copy_not_the_overwritten_page() -> None:
    manager = make_manager()
    request = prefill_prompt(manager)
    source = manager.get_blocks("r").blocks[1][1]
    # Published at the tail, but its page is about to be overwritten: no offer yet.
    assert manager.block_pool.get_cached_block(request.block_hashes[2], [1]) == [source]
    assert manager.take_boundary_state_offloads() == {}

    request.num_computed_tokens = TAIL
    request.append_output_token_ids([3])
    assert manager.allocate_slots(request, 1) is not None
    copies, retained = manager.take_kv_cache_block_copies()
    (copy,) = [c for c in copies if c.src_block_id == source.block_id]
    assert manager.take_boundary_state_offloads() == {"r": [(1, copy.dst_block_id, TAIL)]}
    # The copy consumed the mark: finishing hands off nothing more.
    assert manager.finalize_partial_tail_offloads(request) == []
    manager.block_pool.free_blocks(retained)
    manager.free(request)


def test_finish_at_the_tail_offers_the_table_page_once() -> None:
    manager = make_manager()
    request = prefill_prompt(manager)
    source = manager.get_blocks("r").blocks[1][1]
    request.num_computed_tokens = TAIL
    assert manager.finalize_partial_tail_offloads(request) == [(1, source.block_id, TAIL)]
    assert manager.finalize_partial_tail_offloads(request) == []
    assert manager.take_boundary_state_offloads() == {}


@pytest.mark.parametrize(("num_computed", "num_in_flight"), [(TAIL + 1, 0), (TAIL, 1)])
def test_finish_past_the_tail_offers_nothing_and_consumes_the_mark(
    num_computed: int, num_in_flight: int
) -> None:
    manager = make_manager()
    request = prefill_prompt(manager)
    request.num_computed_tokens = num_computed
    request.num_in_flight_tokens = num_in_flight
    assert manager.finalize_partial_tail_offloads(request) == []
    request.num_in_flight_tokens = 0
    request.num_computed_tokens = TAIL
    assert manager.finalize_partial_tail_offloads(request) == []


def test_pop_blocks_for_free_drops_the_requests_offers() -> None:
    manager = make_manager()
    free_before = manager.block_pool.get_num_free_blocks()
    request = make_request("r", [0, 0, 1, 1, 2, 2], HASH)
    assert manager.allocate_slots(request, 6) is not None
    expected = [b for group in manager.get_blocks("r").blocks for b in group if not b.is_null]
    blocks = manager.pop_blocks_for_free(request)
    # Group after group, the table order within each; nothing freed yet.
    assert blocks == expected
    assert manager.get_blocks("r").get_block_ids() == ([], [])
    assert manager.take_boundary_state_offloads() == {}
    manager.block_pool.free_blocks(reversed(blocks))
    assert manager.block_pool.get_num_free_blocks() == free_before
    assert manager.pop_blocks_for_free(request) == []


def test_published_whole_page_states_are_offered_once() -> None:
    manager = make_manager()
    request = make_request("r", [0, 0, 1, 1], HASH)
    assert manager.allocate_slots(request, MAMBA_BLOCK) is not None
    page = manager.get_blocks("r").blocks[1][0]
    assert manager.take_boundary_state_offloads() == {"r": [(1, page.block_id, MAMBA_BLOCK)]}
    request.num_computed_tokens = MAMBA_BLOCK
    request.append_output_token_ids([2])
    assert manager.allocate_slots(request, 1) is not None
    assert manager.take_boundary_state_offloads() == {}


# --- BlockPool hooks ------------------------------------------------------------------------


def test_unpinned_blocks_stay_readable_until_reused() -> None:
    pool = BlockPool(4, enable_caching=False, hash_block_size=HASH)
    first, second = pool.get_new_blocks(2)
    reused: list[int] = []
    pool.unpin_blocks([first, second], lambda block: reused.append(block.block_id))
    assert pool.get_num_free_blocks() == 3
    # Unpinned pages join the tail: the never-used page goes first.
    (fresh,) = pool.get_new_blocks(1)
    assert fresh.block_id not in (first.block_id, second.block_id) and reused == []
    # A touch takes a page back like any free page; its watcher stays until it is reused.
    pool.touch([first])
    assert pool.get_new_blocks(1) == [second] and reused == [second.block_id]
    pool.free_blocks([first, fresh, second])
    assert pool.reset_prefix_cache()
    assert reused == [second.block_id, first.block_id]


@pytest.mark.parametrize("case", ["null", "unreferenced", "listed_twice"])
def test_unpin_blocks_rejects_blocks_it_cannot_release(case: str) -> None:
    pool = BlockPool(4, enable_caching=False, hash_block_size=HASH)
    (block,) = pool.get_new_blocks(1)
    blocks = {
        "null": [pool.null_block],
        "unreferenced": [pool.blocks[2]],
        "listed_twice": [block, block],
    }[case]
    with pytest.raises(ValueError, match="blocks: expected non-null blocks holding"):
        pool.unpin_blocks(blocks, lambda b: None)
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 2


def test_free_blocks_returns_pages_to_their_own_pool() -> None:
    device = BlockPool(4, enable_caching=False, hash_block_size=HASH)
    host = BlockPool(4, enable_caching=False, hash_block_size=HASH)
    mixed = device.get_new_blocks(1) + host.get_new_blocks(2)
    device.free_blocks(mixed)
    assert device.get_num_free_blocks() == 3 and host.get_num_free_blocks() == 3
    # Pages built outside any pool belong to the pool freeing them.
    assert KVCacheBlock(5).pool is None


def test_events_report_the_pools_medium() -> None:
    pool = BlockPool(
        4, enable_caching=True, hash_block_size=HASH, enable_kv_cache_events=True, medium=MEDIUM_CPU
    )
    request = make_request("r", [0, 0, 1, 1], HASH)
    (block,) = pool.get_new_blocks(1)
    pool.cache_partial_block(request, block, HASH, 0, block_size=2 * HASH)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored) and event.medium == MEDIUM_CPU
    with pytest.raises(ValueError, match="medium: expected a non-empty medium name"):
        BlockPool(4, enable_caching=True, hash_block_size=HASH, medium="")


@pytest.mark.parametrize("block_size", [3, 0, True])
def test_cache_partial_block_checks_block_size(block_size: int) -> None:
    pool = BlockPool(4, enable_caching=True, hash_block_size=HASH)
    request = make_request("r", [0, 0, 1, 1], HASH)
    (block,) = pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="block_size: expected a positive multiple of 2"):
        pool.cache_partial_block(request, block, HASH, 0, block_size=block_size)
    assert block.block_hash is None
