"""Upstream v0.33's window specs and their managers beyond upstream's own tests: RSWASpec and
CircularBufferSpec construction, merging and page math; R-SWA's gap freeing; the ring page of
a circular buffer; and the errors for misuse."""

from __future__ import annotations

import pytest
import torch

from tests.v1.core.block_manager_test_utils import full, make_request
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.single_type_kv_cache_manager import (
    CircularBufferManager,
    FullAttentionManager,
    RSWAManager,
    get_manager_for_kv_cache_spec,
)
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    KVCacheSpecKind,
    RSWASpec,
    get_kv_cache_spec_kind,
)

ATTN = dict(num_kv_heads=2, head_size=8, dtype=torch.float16)


def rswa(window: int = 8, block_size: int = 4) -> RSWASpec:
    return RSWASpec(block_size=block_size, rswa_window=window, **ATTN)


def ring(block_size: int = 4) -> CircularBufferSpec:
    return CircularBufferSpec(block_size=block_size, **ATTN)


def test_rswa_spec_merges_one_window_and_checks_it() -> None:
    merged = RSWASpec.merge([rswa(), rswa()])
    assert isinstance(merged, RSWASpec) and merged.rswa_window == 8
    assert merged.page_size_bytes == 4 * 2 * 8 * 2 * 2  # tokens x heads x dim x K/V x bytes
    assert get_kv_cache_spec_kind(merged) is KVCacheSpecKind.FULL_ATTENTION
    with pytest.raises(ValueError, match="rswa_window: expected a positive int"):
        rswa(window=0)
    with pytest.raises(ValueError, match="must share one rswa_window, got \\[8, 16\\]"):
        RSWASpec.merge([rswa(8), rswa(16)])
    with pytest.raises(ValueError, match="expected only RSWASpec layers"):
        RSWASpec.merge([rswa(), full(4)])
    with pytest.raises(ValueError, match="expected at least one spec"):
        RSWASpec.merge([])


def test_circular_buffer_spec_is_one_unpublished_page() -> None:
    spec = ring(16)
    assert spec.page_size_bytes == 16 * 2 * 8 * 2 * 2  # tokens x heads x dim x K/V x bytes
    assert spec.max_memory_usage_bytes(None) == spec.page_size_bytes  # type: ignore[arg-type]
    assert spec.max_num_blocks_per_req(None, 10_000) == 1  # type: ignore[arg-type]
    assert not spec.prefix_cacheable and not spec.uses_slot_mapping
    assert spec.block_table_token_alignment is None
    assert get_kv_cache_spec_kind(spec) is KVCacheSpecKind.UNKNOWN


def manager(spec, pool: BlockPool, **kw):
    return get_manager_for_kv_cache_spec(
        spec,
        max_in_flight_tokens=32,
        max_model_len=256,
        block_pool=pool,
        enable_caching=True,
        kv_cache_group_id=0,
        **kw,
    )


def test_rswa_frees_the_gap_only_when_the_prompt_length_is_known() -> None:
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=4)
    m = manager(rswa(window=8), pool)
    assert type(m) is RSWAManager
    m.allocate_new_blocks("r", 40, 40)  # 10 pages
    free_before = pool.get_num_free_blocks()
    m.remove_skipped_blocks("r", 40)  # full attention without the prompt length
    assert pool.get_num_free_blocks() == free_before
    # Prompt of 6 tokens: the gap is pages [2, 8) (tokens [8, 32)); page 1 holds prompt tokens.
    m.remove_skipped_blocks("r", 40, num_prompt_tokens=6)
    blocks = m.req_to_blocks["r"]
    assert [b.is_null for b in blocks] == [False] * 2 + [True] * 6 + [False] * 2
    assert pool.get_num_free_blocks() == free_before + 6
    m.free("r")
    assert pool.get_num_free_blocks() == 15


def test_circular_buffer_holds_one_ring_page_and_is_never_published() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4)
    m = manager(ring(), pool, needs_kv_cache_zeroing=True)
    assert type(m) is CircularBufferManager and not m.records_new_block_ids
    request = make_request("r", list(range(12)), 4)
    assert m.get_num_blocks_to_allocate("r", 12, [], 0, 0, 12) == 1
    (page,) = m.allocate_new_blocks("r", 12, 12)
    assert m.get_num_blocks_to_allocate("r", 400, [], 12, 12, 400) == 0
    assert m.allocate_new_blocks("r", 400, 400) == []
    m.cache_blocks(request, 12)
    assert page.block_hash is None and len(pool.cached_block_hash_to_block) == 0
    hit = CircularBufferManager.find_longest_cache_hit(
        request.block_hashes, 12, [0, 1], pool, ring(), False, 4
    )
    assert hit == (([], []), 0)
    m.remove_skipped_blocks("r", 400)
    assert m.req_to_blocks["r"] == [page]
    with pytest.raises(ValueError, match="retention_interval: expected None or a non-negative"):
        m.cache_blocks(request, 12, 3)
    m.free("r")
    assert page.ref_cnt == 0 and pool.get_num_free_blocks() == 7


def test_window_managers_refuse_other_specs() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4)
    common = dict(block_pool=pool, enable_caching=True, kv_cache_group_id=0)
    with pytest.raises(TypeError, match="kv_cache_spec: RSWAManager expected RSWASpec"):
        RSWAManager(full(4), **common)
    with pytest.raises(TypeError, match="CircularBufferManager expected CircularBufferSpec"):
        CircularBufferManager(full(4), **common)
    with pytest.raises(TypeError, match="expected CircularBufferSpec, got FullAttentionSpec"):
        CircularBufferManager.find_longest_cache_hit([], 4, [0], pool, full(4), False, 4)
    # A plain full-attention spec keeps its own manager.
    assert type(manager(full(4), pool)) is FullAttentionManager
