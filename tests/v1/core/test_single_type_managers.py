"""The single-type managers beyond upstream's own tests: which manager serves each spec, the
admission cap, sink and cross-attention managers, Mamba's align mode and same-step rule, context
parallel block sizes, EAGLE drops, and the errors for misuse."""

from __future__ import annotations

import pytest
import torch

from tests.v1.core.block_manager_test_utils import full, make_request, mamba, sliding
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    CircularBufferManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    RSWAManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
    spec_manager_map,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)

ATTN = dict(num_kv_heads=1, head_size=8, dtype=torch.float16)


def manager_for(spec, pool: BlockPool, **kw):
    return get_manager_for_kv_cache_spec(
        spec,
        max_in_flight_tokens=kw.pop("max_num_batched_tokens", 32),
        max_model_len=kw.pop("max_model_len", 256),
        block_pool=pool,
        enable_caching=kw.pop("enable_caching", True),
        kv_cache_group_id=0,
        **kw,
    )


def test_every_spec_gets_upstreams_manager() -> None:
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=4)
    cases = [
        (FullAttentionSpec(block_size=4, **ATTN), FullAttentionManager),
        (MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16),
         FullAttentionManager),
        (HiddenStateCacheSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16),
         FullAttentionManager),
        (sliding(4, 8), SlidingWindowManager),
        (SlidingWindowMLASpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16,
                              sliding_window=8), SlidingWindowManager),
        (ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **ATTN),
         ChunkedLocalAttentionManager),
        (mamba(4), MambaManager),
        (CrossAttentionSpec(block_size=4, **ATTN), CrossAttentionManager),
        (SinkFullAttentionSpec(block_size=4, sink_len=4, **ATTN), SinkFullAttentionManager),
        (RSWASpec(block_size=4, rswa_window=8, **ATTN), RSWAManager),
        (CircularBufferSpec(block_size=4, **ATTN), CircularBufferManager),
    ]  # fmt: skip
    assert {type(spec) for spec, _ in cases} == set(spec_manager_map)
    for spec, cls in cases:
        assert type(manager_for(spec, pool)) is cls
        assert spec_manager_map[type(spec)] is cls


def test_admission_cap_only_for_recycling_kinds() -> None:
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=4)
    swa = manager_for(sliding(4, 9), pool, max_num_batched_tokens=16, max_model_len=1000)
    # The spec's own rule: cdiv(9 - 1 + 16, 4) + 1 pages.
    assert swa._max_admission_blocks_per_request == 7
    assert swa.get_num_blocks_to_allocate("r", 400, [], 0, 0, 400, apply_admission_cap=True) == 7
    assert swa.get_num_blocks_to_allocate("r", 400, [], 0, 0, 400) == 100
    chunked = manager_for(
        ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **ATTN),
        pool,
        max_num_batched_tokens=16,
    )
    assert chunked._max_admission_blocks_per_request == 6
    assert manager_for(full(4), pool)._max_admission_blocks_per_request is None


def test_unmapped_specs_are_refused_by_name() -> None:
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=4)
    with pytest.raises(ValueError, match=r"kv_cache_spec: expected one of .*got EncoderOnly"):
        manager_for(EncoderOnlyAttentionSpec(block_size=4, **ATTN), pool)
    uniform = UniformTypeKVCacheSpecs(block_size=4, kv_cache_specs={"a": full(4)})
    with pytest.raises(ValueError, match="generate_scheduler_kv_cache_config"):
        manager_for(uniform, pool)
    # A spec handed to another kind's lookup is a TypeError naming both.
    with pytest.raises(TypeError, match="kv_cache_spec: SlidingWindowManager expected"):
        SlidingWindowManager.find_longest_cache_hit([], 8, [0], pool, full(4), False, 4)


def test_sink_manager_reserves_its_pages_for_good() -> None:
    pool = BlockPool(num_gpu_blocks=10, enable_caching=True, hash_block_size=4)
    free = pool.get_num_free_blocks()
    sink = manager_for(SinkFullAttentionSpec(block_size=4, sink_len=8, **ATTN), pool)
    assert isinstance(sink, SinkFullAttentionManager)
    assert len(sink.sink_blocks) == 2 and pool.get_num_free_blocks() == free - 2
    for bad in (0, 6):
        with pytest.raises(ValueError, match=f"sink_len: expected a positive multiple.*got {bad}"):
            manager_for(SinkFullAttentionSpec(block_size=4, sink_len=bad, **ATTN), pool)


def test_cross_attention_sizes_by_encoder_tokens_and_never_caches() -> None:
    pool = BlockPool(num_gpu_blocks=10, enable_caching=False, hash_block_size=4)
    cross = manager_for(CrossAttentionSpec(block_size=4, **ATTN), pool, enable_caching=False)
    assert cross.get_num_blocks_to_allocate("r", 10, [], 0, 0, 10) == 3
    assert len(cross.allocate_new_blocks("r", 10, 10)) == 3
    assert cross.get_num_common_prefix_blocks("r") == 0
    request = make_request("r", [1] * 8, 4)
    with pytest.raises(ValueError, match="enable_caching: cross-attention"):
        cross.cache_blocks(request, 8)
    with pytest.raises(ValueError, match="enable_caching: cross-attention has no reusable"):
        CrossAttentionManager.find_longest_cache_hit(
            [], 8, [0], pool, CrossAttentionSpec(block_size=4, **ATTN), False, 4
        )
    with pytest.raises(ValueError, match="new_computed_blocks: cross-attention expected no"):
        cross.allocate_new_computed_blocks("s", [pool.blocks[1]], 4, 0)
    cross.free("r")
    assert pool.get_num_free_blocks() == 9


def _cached_request(pool: BlockPool, tokens: list[int], block_size: int, rid: str = "a"):
    """A request whose full pages are allocated and published in ``pool`` (group 0)."""
    request = make_request(rid, tokens, block_size)
    blocks = pool.get_new_blocks(len(tokens) // block_size)
    pool.cache_full_blocks(request, blocks, 0, len(blocks), block_size, 0)
    return request, blocks


def test_full_attention_hit_alignment_eagle_and_context_parallel() -> None:
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=4)
    request, blocks = _cached_request(pool, list(range(20)), 4)
    spec = full(4)
    (hit,), _ = FullAttentionManager.find_longest_cache_hit(
        request.block_hashes, 20, [0], pool, spec, False, 4
    )
    assert hit == blocks
    (hit,), _ = FullAttentionManager.find_longest_cache_hit(
        request.block_hashes, 20, [0], pool, spec, False, 8
    )
    assert hit == blocks[:4]  # 16 tokens: the largest multiple of 8
    (hit,), _ = FullAttentionManager.find_longest_cache_hit(
        request.block_hashes, 19, [0], pool, spec, True, 4
    )
    assert hit == blocks[:3]  # 4 pages fit in 19 tokens, EAGLE drops the last
    # Decode context parallelism: one logical page spans block_size x world tokens.
    cp = manager_for(spec, pool, dcp_world_size=2)
    assert cp.block_size == 8
    assert cp.get_num_blocks_to_allocate("x", 17, [], 0, 0, 17) == 3


def test_sliding_window_hits_and_mask() -> None:
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=4)
    request, blocks = _cached_request(pool, list(range(24)), 4)
    spec = sliding(4, 6)  # the next token reads 5 earlier tokens: the last 2 pages
    (hit,), _ = SlidingWindowManager.find_longest_cache_hit(
        request.block_hashes, 23, [0], pool, spec, False, 4
    )
    assert [b.is_null for b in hit] == [True] * 3 + [False] * 2
    assert hit[3:] == blocks[3:5]
    # In a hybrid with 16-token alignment only the tail pages of each segment are published.
    swa = manager_for(spec, pool)
    mask = SlidingWindowManager.reachable_block_mask(0, 8, 16, swa.kv_cache_spec, False)
    assert mask == [False, False, True, True] * 2
    # With EAGLE the run ends one page past each boundary.
    mask = SlidingWindowManager.reachable_block_mask(0, 8, 16, swa.kv_cache_spec, True)
    assert mask == [False, False, True, True, True, False, True, True]
    assert SlidingWindowManager.reachable_block_mask(0, 4, 16, sliding(4, 20), False) is None
    with pytest.raises(ValueError, match="dcp_world_size, pcp_world_size: sliding window"):
        SlidingWindowManager.find_longest_cache_hit([], 8, [0], pool, spec, False, 4, 2)


def test_chunked_local_refuses_eagle_and_other_alignments() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4)
    spec = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **ATTN)
    with pytest.raises(ValueError, match="drop_eagle_block: chunked local attention expected"):
        ChunkedLocalAttentionManager.find_longest_cache_hit([], 8, [0], pool, spec, True, 4)
    with pytest.raises(ValueError, match="alignment_tokens: .*expected its block_size 4, got 8"):
        ChunkedLocalAttentionManager.find_longest_cache_hit([], 8, [0], pool, spec, False, 8)


def test_mamba_align_mode_keeps_running_state_and_speculative_pages() -> None:
    """align: nulls before the running state, the state two steps back is freed, the
    speculative page moves along instead of being reallocated."""
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=4)
    spec = mamba(4, "align")
    spec = type(spec)(
        block_size=4,
        shapes=spec.shapes,
        dtypes=spec.dtypes,
        mamba_cache_mode="align",
        num_speculative_blocks=1,
    )
    m = manager_for(spec, pool)
    assert isinstance(m, MambaManager)
    free = pool.get_num_free_blocks()
    assert m.get_num_blocks_to_allocate("r", 8, [], 0, 0, 8) == 2  # state + 1 speculative
    first = m.allocate_new_blocks("r", 8, 8)
    table = m.req_to_blocks["r"]
    assert len(first) == 3 and table[0].is_null and table[1:] == first[1:]
    state, spec_page = table[1], table[2]
    # Next step (tokens 8..11): one new page; the old speculative page holds the new state.
    m.remove_skipped_blocks("r", 8)
    assert m.get_num_blocks_to_allocate("r", 12, [], 8, 8, 12) == 1
    m.allocate_new_blocks("r", 12, 12)
    assert table[:3] == [table[0], state, spec_page] and len(table) == 4
    assert m.last_state_block_idx["r"] == 1
    newest = table[3]
    # Computed past it, the state from two steps back returns to the pool.
    m.remove_skipped_blocks("r", 12)
    assert table[1].is_null
    # A longer step: the speculative page moves to the tail instead of a new allocation.
    m.allocate_new_blocks("r", 20, 20)
    assert [b.is_null for b in table] == [True, True, False, True, False, False]
    assert table[2] is spec_page and table[4] is newest
    assert m.last_state_block_idx["r"] == 2
    assert pool.get_num_free_blocks() == free - 3
    m.free("r")
    assert pool.get_num_free_blocks() == free and not m.last_state_block_idx


def test_mamba_state_cached_this_step_waits_for_the_next() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4)
    m = manager_for(mamba(4, "all"), pool)
    request = make_request("a", list(range(9)), 4)
    m.allocate_new_blocks("a", 9, 9)
    m.cache_blocks(request, 8)
    (hit,), _ = MambaManager.find_longest_cache_hit(
        request.block_hashes, 8, [0], pool, m.kv_cache_spec, False, 4
    )
    assert hit[0].is_null and not hit[1].is_null
    assert m.get_num_blocks_to_allocate("b", 9, hit, 8, 8, 9) == pool.num_gpu_blocks + 1
    m.new_step_starts()
    assert m.get_num_blocks_to_allocate("b", 9, hit, 8, 8, 9) == 1
