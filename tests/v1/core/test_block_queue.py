"""KVCacheBlock and FreeKVCacheBlockQueue: order, O(1) unlinking (only neighbours change),
error paths."""

from __future__ import annotations

import pytest

from vllm.v1.core.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id


def _ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def _links(blocks: list[KVCacheBlock]) -> list[tuple[int | None, int | None]]:
    return [
        (
            None if b.prev_free_block is None else id(b.prev_free_block),
            None if b.next_free_block is None else id(b.next_free_block),
        )
        for b in blocks
    ]


def test_queue_starts_in_given_order_and_pops_front_first() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 6 and _ids(queue) == [0, 1, 2, 3, 4, 5]
    assert queue.popleft() is blocks[0]
    assert [b.block_id for b in queue.popleft_n(2)] == [1, 2]
    assert blocks[1].prev_free_block is None and blocks[1].next_free_block is None
    assert queue.popleft_n(0) == []
    assert _ids(queue) == [3, 4, 5] and queue.num_free_blocks == 3
    assert queue.fake_free_list_head.next_free_block is blocks[3]


def test_remove_touches_only_the_neighbours() -> None:
    blocks = [KVCacheBlock(i) for i in range(200)]
    queue = FreeKVCacheBlockQueue(blocks)
    before = _links(blocks)
    queue.remove(blocks[100])
    after = _links(blocks)
    changed = [i for i in range(200) if before[i] != after[i]]
    assert changed == [99, 100, 101]
    assert blocks[99].next_free_block is blocks[101]
    assert blocks[101].prev_free_block is blocks[99]
    assert queue.num_free_blocks == 199
    with pytest.raises(RuntimeError, match="invalid block"):
        queue.remove(blocks[100])  # not in the queue any more


def test_append_goes_to_the_tail_and_append_n_keeps_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.append(blocks[4])
    queue.append_n([blocks[3], blocks[2]])
    queue.append_n([])
    assert _ids(queue) == [0, 1, 4, 3, 2] and queue.num_free_blocks == 5
    assert queue.fake_free_list_tail.prev_free_block is blocks[2]


def test_empty_queue_errors() -> None:
    queue = FreeKVCacheBlockQueue([])
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft()
    with pytest.raises(AssertionError, match="expected at most 0"):
        queue.popleft_n(1)


def test_popleft_all_then_refill() -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft_n(3) == blocks
    assert queue.num_free_blocks == 0 and _ids(queue) == []
    queue.append_n(blocks[::-1])
    assert _ids(queue) == [2, 1, 0]


def test_block_hash_is_set_once_until_reset() -> None:
    block = KVCacheBlock(7)
    key = make_block_hash_with_group_id(b"h" * 32, 1)
    block.block_hash = key
    with pytest.raises(AssertionError, match="block 7: expected no hash"):
        block.block_hash = key
    block.reset_hash()
    assert block.block_hash is None
    assert "block_id=7" in repr(block)
    assert not hasattr(block, "__dict__")  # slots: no per-block dict at 100k+ blocks
