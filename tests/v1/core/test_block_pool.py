"""BlockPool: allocation, prefix lookup, LRU eviction order, KV events, reset."""

from __future__ import annotations

import pytest

from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.request import Request

BS = 4  # tokens per block


@pytest.fixture(autouse=True)
def _seed() -> None:
    init_none_hash(sha256)


def _request(tokens: list[int], rid: str = "r", **kw) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256),
        **kw,
    )


def _alloc_and_cache(pool: BlockPool, request: Request, group: int = 0) -> list[KVCacheBlock]:
    n = len(request.block_hashes)
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(request, blocks, 0, n, BS, group)
    return blocks


def test_null_block_and_allocation_counts() -> None:
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=BS)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 5 and pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3] and all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="Cannot get 3 free blocks"):
        pool.get_new_blocks(3)
    pool.free_blocks(blocks + [pool.null_block])  # the null block is never queued
    assert pool.get_num_free_blocks() == 5
    with pytest.raises(ValueError, match="num_gpu_blocks: expected a positive int"):
        BlockPool(0, True, BS)


def test_prefix_hit_touch_and_group_separation() -> None:
    pool = BlockPool(10, True, BS)
    a = _request(list(range(9)))
    blocks = _alloc_and_cache(pool, a)
    assert len(pool.cached_block_hash_to_block) == 2
    b = _request(list(range(9)), rid="b")
    hits = [pool.get_cached_block(h, [0]) for h in b.block_hashes]
    assert hits == [[blocks[0]], [blocks[1]]]
    assert pool.get_cached_block(b.block_hashes[0], [0, 1]) is None  # group 1 has nothing
    pool.free_blocks(reversed(blocks))
    free_before = pool.get_num_free_blocks()
    pool.touch([blocks[0], blocks[1]])  # a hit on free cached blocks takes them back
    assert pool.get_num_free_blocks() == free_before - 2 and blocks[0].ref_cnt == 1
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2


def test_lru_eviction_order_and_removed_events() -> None:
    pool = BlockPool(5, True, BS, enable_kv_cache_events=True)
    a = _request(list(range(8)), "a")
    b = _request(list(range(100, 108)), "b")
    blocks_a = _alloc_and_cache(pool, a)
    blocks_b = _alloc_and_cache(pool, b)
    pool.take_events()
    # Free a, then b, each tail first: the tail of the oldest chain is evicted first.
    pool.free_blocks(reversed(blocks_a))
    pool.free_blocks(reversed(blocks_b))
    order = [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()]
    assert order == [blocks_a[1].block_id, blocks_a[0].block_id, blocks_b[1].block_id,
                     blocks_b[0].block_id]  # fmt: skip
    new = pool.get_new_blocks(1)
    assert new == [blocks_a[1]] and new[0].block_hash is None
    assert pool.get_cached_block(a.block_hashes[1], [0]) is None
    assert pool.get_cached_block(a.block_hashes[0], [0]) == [blocks_a[0]]
    assert pool.take_events() == [BlockRemoved([a.block_hashes[1]], MEDIUM_GPU, group_idx=0)]
    assert pool.take_events() == []


def test_stored_event_carries_chain_tokens_and_extra_keys() -> None:
    pool = BlockPool(8, True, BS, enable_kv_cache_events=True)
    lora = LoRARequest("ad", 5, "/p")
    req = _request(list(range(12)), lora_request=lora, cache_salt="s")
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 1, BS, 2)
    pool.cache_full_blocks(req, blocks, 1, 3, BS, 2)
    first, second = pool.take_events()
    assert first == BlockStored(
        block_hashes=[req.block_hashes[0]], parent_block_hash=None, token_ids=[0, 1, 2, 3],
        block_size=BS, lora_id=5, medium=MEDIUM_GPU, lora_name="ad",
        extra_keys=[("ad", "s")], group_idx=2,
    )  # fmt: skip
    assert second.parent_block_hash == req.block_hashes[0]
    assert second.block_hashes == req.block_hashes[1:3]
    assert second.token_ids == list(range(4, 12))
    assert second.extra_keys == [("ad",), ("ad",)]
    assert blocks[2].block_hash == make_block_hash_with_group_id(req.block_hashes[2], 2)


def test_masked_and_null_blocks_are_not_cached() -> None:
    pool = BlockPool(8, True, BS, enable_kv_cache_events=True)
    req = _request(list(range(12)))
    real = pool.get_new_blocks(2)
    blocks = [pool.null_block, real[0], real[1]]
    pool.cache_full_blocks(req, blocks, 0, 3, BS, 0, block_mask=[True, True, False])
    assert pool.null_block.block_hash is None and real[1].block_hash is None
    assert pool.get_cached_block(req.block_hashes[1], [0]) == [real[0]]
    (event,) = pool.take_events()
    assert event.block_hashes == [req.block_hashes[1]] and event.extra_keys == [None]
    with pytest.raises(ValueError, match="block_mask: expected 1 entries, got 2"):
        pool.cache_full_blocks(req, blocks, 2, 3, BS, 1, block_mask=[True, True])


def test_larger_group_blocks_use_last_chained_hash() -> None:
    pool = BlockPool(8, True, hash_block_size=BS)
    req = _request(list(range(16)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 2 * BS, 1)
    assert pool.get_cached_block(req.block_hashes[1], [1]) == [blocks[0]]
    assert pool.get_cached_block(req.block_hashes[3], [1]) == [blocks[1]]


def test_duplicate_blocks_under_one_key() -> None:
    cache = BlockHashToBlockMap()
    key = make_block_hash_with_group_id(b"k" * 32, 0)
    b1, b2 = KVCacheBlock(1), KVCacheBlock(2)
    cache.insert(key, b1)
    cache.insert(key, b2)
    assert cache.get_one_block(key) is b1 and len(cache) == 1
    assert cache.pop(key, 3) is None
    assert cache.pop(key, 1) is b1 and cache.get_one_block(key) is b2
    assert cache._cache[key] == {2: b2}  # the duplicate form stays until the key empties
    assert cache.pop(key, 2) is b2 and cache.get_one_block(key) is None and len(cache) == 0


def test_evict_blocks_and_reset_prefix_cache() -> None:
    collector = KVCacheMetricsCollector(sample_rate=1.0)
    pool = BlockPool(6, True, BS, enable_kv_cache_events=True, metrics_collector=collector)
    req = _request(list(range(8)))
    blocks = _alloc_and_cache(pool, req)
    pool.take_events()
    pool.evict_blocks({blocks[0].block_id})
    assert blocks[0].block_hash is None and blocks[0].ref_cnt == 1  # still in use
    assert isinstance(pool.take_events()[0], BlockRemoved)
    with pytest.raises(AssertionError, match=r"block_ids: expected ids in \[0, 6\), got 6"):
        pool.evict_blocks({6})
    assert pool.reset_prefix_cache() is False  # blocks still used
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert blocks[1].block_hash is None and len(pool.cached_block_hash_to_block) == 0
    assert pool.take_events() == [AllBlocksCleared()]
    assert collector.block_metrics == {}


def test_events_off_queue_nothing() -> None:
    pool = BlockPool(4, True, BS)
    _alloc_and_cache(pool, _request(list(range(8))))
    assert pool.take_events() == [] and pool.kv_event_queue == []


def test_no_caching_keeps_no_hashes_on_reuse() -> None:
    pool = BlockPool(3, False, BS)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    assert pool.get_new_blocks(2) == blocks


def test_a_block_listed_twice_is_queued_once() -> None:
    pool = BlockPool(4, True, BS)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])  # a second request shares it
    pool.free_blocks([block, block])
    assert block.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()].count(1) == 1
