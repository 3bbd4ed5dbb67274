"""KVCacheManager and the coordinators beyond upstream's tests: which coordinator a config
gets and the configs each refuses, KVCacheBlocks, the allocate_slots contract (errors, admission
gate, delayed caching, lookahead), freed attention pages for zeroing, common prefixes, stats."""

from __future__ import annotations

import pytest

from tests.v1.core.block_manager_test_utils import config_of, full, make_request, mamba, sliding
from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager


def manager(*specs, num_blocks: int = 20, **kw) -> KVCacheManager:
    kw.setdefault("hash_block_size", 4)
    return KVCacheManager(config_of(num_blocks, *specs), max_model_len=64, **kw)


def test_coordinator_kinds() -> None:
    assert isinstance(manager(full(4)).coordinator, UnitaryKVCacheCoordinator)
    hybrid = manager(full(4), sliding(8, 8)).coordinator
    assert isinstance(hybrid, HybridKVCacheCoordinator) and hybrid.lcm_block_size == 8
    # Full attention is looked up first; equal specs share one lookup.
    both = manager(sliding(4, 8), full(4), sliding(4, 8)).coordinator
    assert isinstance(both, HybridKVCacheCoordinator)
    assert [ids for _, ids, _ in both.attention_groups] == [[1], [0, 2]]
    off = manager(full(4), sliding(4, 8), enable_caching=False)
    assert isinstance(off.coordinator, KVCacheCoordinatorNoPrefixCache)
    assert off.get_num_common_prefix_blocks("x") == [0, 0]
    assert isinstance(manager(enable_caching=False).coordinator, KVCacheCoordinatorNoPrefixCache)


def test_coordinators_refuse_configs_they_cannot_serve() -> None:
    with pytest.raises(ValueError, match="hash_block_size: expected the group's block_size 4"):
        manager(full(4), hash_block_size=2)
    with pytest.raises(ValueError, match=r"hash_block_size: expected a divisor .*got 8 \(group 0"):
        manager(full(4), sliding(8, 8), hash_block_size=8)
    with pytest.raises(ValueError, match="dcp_world_size, pcp_world_size: hybrid models"):
        manager(full(4), sliding(4, 8), dcp_world_size=2)


def test_groups_of_one_kind_share_one_lookup() -> None:
    """Two groups of equal specs (as upstream's page unification can give): a hybrid
    coordinator with one bundle, whose single lookup serves both groups."""
    m = manager(full(4), full(4))
    coordinator = m.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    assert [ids for _, ids, _ in coordinator.attention_groups] == [[0, 1]]
    first = make_request("a", list(range(10)), 4)
    m.get_computed_blocks(first)
    blocks = m.allocate_slots(first, 10)
    assert blocks is not None
    first.num_computed_tokens = 10
    m.cache_blocks(first, 10)
    second = make_request("b", list(range(10)) + [99], 4)
    hit, num_hit_tokens, _ = m.get_computed_blocks(second)
    assert num_hit_tokens == 8
    assert hit.get_block_ids() == tuple(ids[:2] for ids in blocks.get_block_ids())


def test_kv_cache_blocks() -> None:
    m = manager(full(4), sliding(4, 8))
    request = make_request("a", list(range(10)), 4)
    blocks = m.allocate_slots(request, 10)
    assert blocks is not None
    ids = blocks.get_block_ids()
    assert [len(g) for g in ids] == [3, 3] and not set(ids[0]) & set(ids[1])
    assert m.get_block_ids("a") == ids
    both = blocks + blocks
    assert both.get_block_ids() == tuple(g + g for g in ids)
    empty = blocks.new_empty()
    assert empty.get_block_ids() == ([], []) and empty.get_block_ids(allow_none=True) is None
    # Published pages (the first two full ones) are no longer "unhashed".
    assert blocks.get_unhashed_block_ids_all_groups() == [ids[0][2:], ids[1][2:]]
    with pytest.raises(ValueError, match="blocks: expected 1 KV cache group, got 2"):
        blocks.get_unhashed_block_ids()
    assert m.get_blocks("unknown") is m.empty_kv_cache_blocks


def test_allocate_slots_contract() -> None:
    m = manager(full(4), num_blocks=6)  # 5 usable pages (one is the null page)
    request = make_request("a", list(range(12)), 4)
    with pytest.raises(ValueError, match="num_new_tokens: expected > 0 when there are no"):
        m.allocate_slots(request, 0)
    # The admission gate refuses a request whose whole sequence cannot fit.
    long = make_request("long", list(range(24)), 4)
    assert m.allocate_slots(long, 4, full_sequence_must_fit=True) is None
    assert m.block_pool.get_num_free_blocks() == 5
    # Lookahead slots count; delayed caching publishes nothing.
    blocks = m.allocate_slots(request, 8, num_lookahead_tokens=4, delay_cache_blocks=True)
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 3
    assert m.get_computed_blocks(make_request("b", list(range(12)), 4)) == (
        m.empty_kv_cache_blocks,
        0,
        0,
    )
    request.num_computed_tokens = 8
    m.cache_blocks(request, 8)
    hit, num, _ = m.get_computed_blocks(make_request("c", list(range(12)), 4))
    assert num == 8 and hit.get_block_ids()[0] == blocks.get_block_ids()[0][:2]
    # Not enough pages: None, and nothing taken.
    other = make_request("d", [99] * 20, 4)
    assert m.allocate_slots(other, 20) is None
    assert m.block_pool.get_num_free_blocks() == 2
    m.free(request)
    assert m.block_pool.get_num_free_blocks() == 5


def test_new_attention_pages_are_reported_for_zeroing() -> None:
    m = manager(full(4), mamba(4), num_blocks=20)
    blocks = m.allocate_slots(make_request("a", list(range(6)), 4), 6)
    assert blocks is not None
    # Only plain full-attention pages (the Mamba pages hold states, not per-token K/V).
    assert m.take_new_block_ids() == blocks.get_block_ids()[0]
    assert m.take_new_block_ids() == []


def test_common_prefix_and_stats() -> None:
    m = manager(full(4), log_stats=True)
    prompt = list(range(17))
    first, second = make_request("a", prompt, 4), make_request("b", prompt, 4)
    for request in (first, second):
        hit, num, _ = m.get_computed_blocks(request)
        assert m.allocate_slots(request, 17 - num, num, hit) is not None
    # The second request hit the 4 full pages; both hold them.
    assert m.get_num_common_prefix_blocks("a") == [4]
    stats = m.make_prefix_cache_stats()
    assert stats is not None and (stats.requests, stats.queries, stats.hits) == (2, 34, 16)
    assert m.reset_prefix_cache() is False  # pages still in use
    m.free(first)
    m.free(second)
    assert m.reset_prefix_cache() is True
    stats = m.make_prefix_cache_stats()
    assert stats is not None and stats.reset and stats.requests == 0
    assert manager(full(4)).make_prefix_cache_stats() is None
    assert m.usage == 0.0


def test_eagle_group_choice() -> None:
    config = config_of(20, full(4), sliding(4, 8))
    config.kv_cache_groups[1].is_eagle_group = True
    m = KVCacheManager(config, max_model_len=64, hash_block_size=4, use_eagle=True)
    assert m.coordinator.eagle_group_ids == {1}
    # No group marked: every group drops its last hit page.
    unmarked = manager(full(4), sliding(4, 8), use_eagle=True)
    assert unmarked.coordinator.eagle_group_ids == {0, 1}
    assert KVCacheBlocks(((),)).get_block_ids(allow_none=True) is None


def test_hybrid_lookup_restarts_when_a_later_group_shortens() -> None:
    """Full, sliding and Mamba groups: the Mamba state at 16 tokens is gone, so the hit drops to
    12 and the sliding group (which accepted 16) must be looked up again at 12."""
    m = manager(full(4), sliding(4, 5), mamba(4, "all"))
    first = make_request("a", list(range(17)), 4)
    assert m.allocate_slots(first, 17) is not None
    mamba_table = m.coordinator.single_type_managers[2].req_to_blocks["a"]
    m.evict_blocks({mamba_table[3].block_id})
    hit, num, _ = m.get_computed_blocks(make_request("b", list(range(16)) + [50, 51], 4))
    assert num == 12
    full_ids, sliding_ids, mamba_ids = hit.get_block_ids()
    null = m.block_pool.null_block.block_id
    tables = [t.req_to_blocks["a"] for t in m.coordinator.single_type_managers]
    assert full_ids == [b.block_id for b in tables[0][:3]]
    assert sliding_ids == [null, null, tables[1][2].block_id]
    assert mamba_ids == [null, null, tables[2][2].block_id]


def test_external_tokens_get_pages_only_inside_the_window() -> None:
    """16 tokens come from a KV connector, 8 are computed: full attention takes pages for all
    24; the sliding group (the next token reads 7 back) nulls the 2 pages before its window."""
    m = manager(full(4), sliding(4, 8))
    request = make_request("a", list(range(24)), 4)
    free = m.block_pool.get_num_free_blocks()
    predicted = m.coordinator.get_num_blocks_to_allocate("a", 24, ((), ()), 0, 16, 16, 24)
    blocks = m.allocate_slots(request, 8, num_external_computed_tokens=16, delay_cache_blocks=True)
    assert blocks is not None
    assert [len(g) for g in blocks.get_block_ids()] == [2, 2]  # the pages for the new tokens
    full_ids, sliding_ids = m.get_block_ids("a")
    null = m.block_pool.null_block.block_id
    assert len(full_ids) == 6 and null not in full_ids
    assert sliding_ids[:2] == [null, null] and null not in sliding_ids[2:]
    assert free - m.block_pool.get_num_free_blocks() == predicted == 10
    m.free(request)
    assert m.block_pool.get_num_free_blocks() == free
