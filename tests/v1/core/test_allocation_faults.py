"""Regression tests of allocation faults that upstream's block manager has and ours must not:
a connector's pages evicting another group's prefix hit (one page in two groups), Mamba align
mode taking one page more than it checked for, and sink pages blocking a prefix-cache reset.
The property test (test_block_manager_properties.py) searches for the general case."""

from __future__ import annotations

import pytest
import torch

from tests.v1.core.block_manager_test_utils import (
    ManagerSim,
    config_of,
    full,
    make_request,
    mamba,
    sliding,
)
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.kv_cache_interface import SinkFullAttentionSpec


def test_connector_pages_never_evict_another_groups_hit() -> None:
    """Request ``b`` hits two pages in each group and gets 24 connector tokens. The full
    group's fresh pages come from the front of the free queue, where the sliding group's hit
    pages sit (request ``a`` freed them before ``c`` freed its pages): the full group must not
    take them before the sliding group has claimed them."""
    manager = KVCacheManager(
        config_of(17, full(4), sliding(4, 40)), max_model_len=64, hash_block_size=4
    )
    sim = ManagerSim(manager, chunk=16)
    for rid, tokens in (("a", range(16)), ("c", range(100, 116))):
        request = make_request(rid, list(tokens), 4)
        assert sim.schedule(request)
        sim.finish(request)
    manager.new_step_starts()
    b = make_request("b", list(range(8)) + [99] * 24, 4)
    assert sim.schedule(b, external=24)
    assert sim.last_hit is not None and sim.last_hit[1] == 8
    full_table, sliding_table = manager.get_block_ids("b")
    assert not set(full_table) & set(sliding_table)
    assert sliding_table[:2] == [b.block_id for b in sim.last_hit[0].blocks[1]]
    sim.check_invariants()
    sim.free_all_and_check_no_leak()


@pytest.mark.parametrize("num_blocks", range(3, 14))
def test_mamba_align_with_connector_tokens_fits_or_takes_nothing(num_blocks: int) -> None:
    """Align mode gives a new request's connector tokens a state page before its running
    state: the free-page check counts it, so a short pool answers None (nothing taken), never
    a ValueError from the pool after pages were taken."""
    manager = KVCacheManager(
        config_of(num_blocks, full(4), mamba(4, "align")), max_model_len=64, hash_block_size=4
    )
    sim = ManagerSim(manager, chunk=8)
    request = make_request("r", list(range(20)), 4)
    scheduled = sim.schedule(request, external=8)
    sim.check_invariants()
    # 16 tokens need 4 full-attention pages; Mamba the states after token 8 and token 16.
    assert scheduled == (num_blocks - 1 >= 4 + 2)
    sim.free_all_and_check_no_leak()


def _mamba_align_admission(
    num_blocks: int, hit: bool, external: int, new: int, spec: int
) -> tuple[int, KVCacheBlocks | None, int] | None:
    """(free pages before, the answer, pages taken) of one admission on full + Mamba align
    (``spec`` speculative pages), after an earlier request cached 8 tokens when ``hit``; None
    when the pool is too small for that earlier request."""
    state = mamba(4, "align")
    state = type(state)(
        block_size=4,
        shapes=state.shapes,
        dtypes=state.dtypes,
        mamba_cache_mode="align",
        num_speculative_blocks=spec,
    )
    manager = KVCacheManager(
        config_of(num_blocks, full(4), state), max_model_len=64, hash_block_size=4
    )
    if hit:
        sim = ManagerSim(manager, chunk=8)
        first = make_request("a", list(range(9)), 4)
        if not sim.schedule(first):
            return None
        sim.finish(first)
        manager.new_step_starts()
    request = make_request("b", list(range(8)) + [50] * 12, 4)
    blocks, num_hit, _ = manager.get_computed_blocks(request)
    assert num_hit == (8 if hit else 0)
    free = manager.block_pool.get_num_free_blocks()
    answer = manager.allocate_slots(
        request, new, num_hit, blocks, num_external_computed_tokens=external
    )
    return free, answer, free - manager.block_pool.get_num_free_blocks()


@pytest.mark.parametrize(
    "hit, external, new, spec",
    [
        (False, 8, 8, 0),  # connector tokens end on a page boundary
        (False, 1, 1, 0),  # ... inside a page that the new tokens do not leave
        (False, 1, 0, 1),  # only connector tokens, one speculative page
        (True, 1, 8, 0),  # a cached state that the connector's tokens pass (not taken)
        (True, 4, 4, 2),
        (True, 0, 8, 1),  # a plain hit
    ],
)
def test_mamba_align_counts_exactly_the_pages_it_takes(
    hit: bool, external: int, new: int, spec: int
) -> None:
    """The free-page check of align mode asks for exactly the pages the allocation takes: the
    smallest pool that admits the request has no page to spare, one page less answers None."""
    for num_blocks in range(3, 30):
        outcome = _mamba_align_admission(num_blocks, hit, external, new, spec)
        if outcome is None:
            continue
        free, answer, taken = outcome
        if answer is not None:
            assert taken == free, f"admitted with {free} free pages but took {taken}"
            return
        assert taken == 0
    raise AssertionError("never admitted")


def test_reset_prefix_cache_succeeds_with_sink_pages() -> None:
    """Sink pages are reserved for all requests, not in use by one: once every request has
    finished, a reset succeeds and the old prefix no longer hits."""
    sink = SinkFullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16, sink_len=8
    )
    manager = KVCacheManager(config_of(12, sink), max_model_len=64, hash_block_size=4)
    sim = ManagerSim(manager, chunk=16)
    request = make_request("a", list(range(12)), 4)
    assert sim.schedule(request)
    assert not manager.reset_prefix_cache()  # "a" still holds pages
    sim.finish(request)
    again = make_request("b", list(range(12)), 4)
    assert manager.get_computed_blocks(again)[1] == 8
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(again)[1] == 0
    assert manager.block_pool.get_num_free_blocks() == 12 - 1 - 2


def test_reserving_more_pages_than_are_free_is_refused_whole() -> None:
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=4)
    with pytest.raises(ValueError, match="num_blocks: expected at most the 3 free pages, got 4"):
        pool.reserve_blocks(4)
    assert pool.get_num_free_blocks() == 3 and pool.num_reserved_blocks == 0
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="num_blocks: expected a non-negative int"):
            pool.reserve_blocks(bad)  # type: ignore[arg-type]
    assert pool.get_num_free_blocks() == 3 and pool.num_reserved_blocks == 0


def test_an_eagle_hit_covers_the_same_tokens_in_every_group() -> None:
    """With EAGLE, full attention drops its extra page while Mamba (which reads one state)
    does not: a hybrid hit must still be the length every group's pages cover."""
    manager = KVCacheManager(
        config_of(20, full(4), mamba(4, "all")),
        max_model_len=64,
        hash_block_size=4,
        use_eagle=True,
    )
    sim = ManagerSim(manager, chunk=16)
    first = make_request("a", list(range(13)), 4)
    assert sim.schedule(first)
    sim.finish(first)
    manager.new_step_starts()
    second = make_request("b", list(range(12)) + [7] * 3, 4)
    blocks, num_tokens, _ = manager.get_computed_blocks(second)
    assert num_tokens == 8 and [len(b) for b in blocks.blocks] == [2, 2]


def test_connector_pages_are_listed_for_zeroing_unless_a_load_writes_them() -> None:
    """Upstream v0.33's two halves of taking a new request's pages, called on one manager:
    the connector's fresh pages are listed for zeroing unless ``record_for_zeroing=False``,
    and only when the config needs zeroing (a Mamba group: v0.33's ``needs_kv_cache_zeroing``)."""
    cases = ((True, True, 2), (False, True, 0), (True, False, 0))
    for record, with_mamba, expected in cases:
        specs = (full(4), mamba(4)) if with_mamba else (full(4),)
        config = config_of(16, *specs)
        manager = KVCacheManager(config, max_model_len=64, hash_block_size=4)
        single = manager.coordinator.single_type_managers[0]
        single.add_local_computed_blocks("r", [], 0, 8)
        single.allocate_external_computed_blocks("r", 0, 8, record_for_zeroing=record)
        assert len(single.req_to_blocks["r"]) == 2
        assert len(manager.take_new_block_ids()) == expected
