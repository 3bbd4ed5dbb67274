"""Block-manager behaviour added for upstream v0.33's test_prefix_caching.py that its cases do
not pin: the errors for bad arguments, the shared-prefix boundary, hit events on request, the
Mamba state hand-offs being dropped with their request, context parallelism in hybrid models,
and the backend-side prefill checkpoint helper agreeing with the spec's rules."""

from __future__ import annotations

import pytest

from tests.v1.core.block_manager_test_utils import config_of, full, make_request, mamba, sliding
from vllm.distributed.kv_events import BlockStored
from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.hisparse.coordinator import get_hisparse_coordinator


def manager(*specs, num_blocks: int = 32, **kw) -> KVCacheManager:
    return KVCacheManager(
        config_of(num_blocks, *specs), max_model_len=1024, hash_block_size=4, **kw
    )


def test_reserved_blocks_gate_only_this_steps_pages() -> None:
    m = manager(full(4), num_blocks=9)  # 8 usable pages
    request = make_request("r", list(range(32)), 4)
    for bad, error in ((-1, ValueError), (True, TypeError), (1.5, TypeError)):
        with pytest.raises(error, match="reserved_blocks: expected an int >= 0"):
            m.allocate_slots(request, 8, reserved_blocks=bad)
    # 2 pages now; the whole prompt (8 pages) must fit the pool, not the pool less the
    # reservation.
    assert m.allocate_slots(request, 8, full_sequence_must_fit=True, reserved_blocks=6)
    request.num_computed_tokens = 8
    assert m.allocate_slots(request, 8, reserved_blocks=5) is None  # 2 needed, 6 - 5 left
    assert m.block_pool.get_num_free_blocks() == 6
    assert m.allocate_slots(request, 8, reserved_blocks=4) is not None


def test_hash_lookahead_is_checked_and_reaches_the_pool() -> None:
    with pytest.raises(ValueError, match="num_hash_lookahead_tokens: expected an int >= 0"):
        manager(full(4), num_hash_lookahead_tokens=-1)
    assert (
        manager(full(4), num_hash_lookahead_tokens=True).block_pool.num_hash_lookahead_tokens == 1
    )


def test_shared_prefix_boundary_is_where_a_group_hit_further() -> None:
    m = manager(full(4), mamba(4, "align"), num_blocks=64)
    first = make_request("a", list(range(12)) + [90] * 8, 4)
    m.allocate_slots(first, 20)
    first.num_computed_tokens = 20
    # Full attention holds the 12 shared tokens; Mamba holds states only where steps ended.
    second = make_request("b", list(range(12)) + [91] * 8, 4)
    blocks, num_hit, boundary = m.get_computed_blocks(second)
    assert num_hit == 0 and boundary == 12
    assert m.get_computed_blocks(second, max_cache_hit_length=4)[2] == 4
    # One group: nothing lags.
    single = manager(full(4))
    single.allocate_slots(make_request("a", list(range(12)), 4), 12)
    assert single.get_computed_blocks(make_request("b", list(range(13)), 4))[1:] == (12, 0)


def test_full_report_mode_emits_the_hit_blocks() -> None:
    m = manager(full(4), enable_kv_cache_events=True)
    m.allocate_slots(make_request("a", list(range(12)), 4), 12)
    m.take_events()
    reader = make_request("b", list(range(13)), 4)
    m.get_computed_blocks(reader)
    assert m.take_events() == []  # incremental reports (the default) say nothing on a hit
    reader.kv_cache_report_mode = "full"
    m.get_computed_blocks(reader)
    (event,) = m.take_events()
    assert isinstance(event, BlockStored) and event.parent_block_hash is None
    assert len(event.block_hashes) == 3 and event.token_ids == list(range(12))


def test_cached_block_events_need_the_hashes() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4,
                     enable_kv_cache_events=True)  # fmt: skip
    request = make_request("r", list(range(8)), 4)
    with pytest.raises(ValueError, match="num_cached_blocks: expected at most 2"):
        pool.emit_cached_block_events(request, 3, 4, 0)
    pool.emit_cached_block_events(request, 1, 8, 0)  # coarser pages than the hashes
    (event,) = pool.take_events()
    assert event.block_size == 8 and event.token_ids == list(range(8))


def test_uncached_pages_are_reused_first() -> None:
    m = manager(full(4), num_blocks=8)
    request = make_request("r", list(range(10)), 4)
    blocks = m.allocate_slots(request, 10)
    assert blocks is not None
    full_ids, (partial_id,) = blocks.get_block_ids()[0][:2], blocks.get_block_ids()[0][2:]
    m.free(request)
    order = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    assert order[0] == partial_id and order[-2:] == full_ids[::-1]


def test_boundary_state_offers_are_dropped_with_their_request() -> None:
    m = manager(mamba(4, "align"))
    request = make_request("r", list(range(16)), 4)
    m.allocate_slots(request, 4)
    request.num_computed_tokens = 4
    m.allocate_slots(request, 4)
    m.free(request)
    assert m.take_boundary_state_offloads() == {}
    assert manager(full(4)).take_boundary_state_offloads() == {}


def test_hybrid_context_parallelism_shards_full_attention_only() -> None:
    m = manager(full(4), mamba(4, "align"), dcp_world_size=2, scheduler_block_size=8)
    attention, state = m.coordinator.single_type_managers
    assert (attention.block_size, state.block_size) == (8, 4)
    # Prefill context parallelism splits a step's tokens, not a page (v0.33).
    pcp = manager(full(4), mamba(4, "align"), dcp_world_size=2, pcp_world_size=2)
    assert pcp.coordinator.group_block_sizes == (8, 4)
    assert pcp.coordinator.scheduler_block_size == 8
    with pytest.raises(ValueError, match="expected full-attention or replicated groups, got "
                       "SlidingWindowSpec"):  # fmt: skip
        manager(full(4), sliding(4, 8), dcp_world_size=2, scheduler_block_size=8)


def test_hisparse_coordinator_needs_a_hisparse_group() -> None:
    with pytest.raises(ValueError, match="kv_cache_manager: expected a KV cache manager with a "):
        get_hisparse_coordinator(manager(full(4)))


def test_prefill_checkpoints_follow_the_spec_rules() -> None:
    # Two rows: a 96-token prefill from scratch checkpoints at 80 (the last hash boundary
    # leaving a token), in column 96 // 32 - 2 = 1; a 4-token decode has none.
    offsets, cols = compute_mamba_prefill_checkpoints(
        [96, 100], [96, 4], hash_block_size=16, mamba_block_size=32, checkpoint_alignment=16,
        drop_eagle_block=False, cache_hit_alignment_tokens=16,
    )  # fmt: skip
    assert (offsets, cols) == ([80, 0], [1, -1])
    eagle, _ = compute_mamba_prefill_checkpoints([96], [96], 16, 32, 16, True, 16)
    assert eagle == [80]  # one hash block below the last full one (96 - 16)
    assert compute_mamba_prefill_checkpoints([96], [96], 16, 32, None, False, 16) == ([0], [-1])
    with pytest.raises(ValueError, match="query_lens: expected 2 lengths"):
        compute_mamba_prefill_checkpoints([96, 100], [96], 16, 32, 16, False, 16)
