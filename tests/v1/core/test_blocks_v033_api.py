"""Upstream v0.33's block-manager signatures beyond upstream's own tests: the scheduler block
size, ``max_in_flight_tokens`` and its v0.22 alias, prefill lookahead, hashes covering lookahead
tokens, hashes of coarser pages, ``set_block_hash``, the pool leaving the null page alone,
``pop_blocks_for_free`` and the errors for misuse."""

from __future__ import annotations

import pytest

from tests.v1.core.block_manager_test_utils import config_of, full, make_request, sliding
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    BlockHashListWithBlockSize,
    KVCacheBlock,
    get_request_block_hasher,
    make_block_hash_with_group_id,
)
from vllm.v1.core.prefix_retention import replay_boundaries
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request


def request(tokens: list[int], lookahead: int = 0, **kw) -> Request:
    return Request(
        request_id=kw.pop("rid", "r"),
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        block_hasher=get_request_block_hasher(4, sha256, lookahead),
        **kw,
    )


def test_lookahead_hashes_cover_the_next_tokens() -> None:
    plain = request(list(range(10)))
    ahead = request(list(range(10)), lookahead=2)
    other = request(list(range(9)) + [99], lookahead=2)
    assert len(plain.block_hashes) == 2
    # Block 2 (tokens [4, 8)) needs tokens 8 and 9: both exist, so both blocks hash.
    assert len(ahead.block_hashes) == 2
    assert ahead.block_hashes[0] != plain.block_hashes[0]
    assert other.block_hashes[0] == ahead.block_hashes[0]  # token 9 is past block 1's lookahead
    assert other.block_hashes[1] != ahead.block_hashes[1]
    assert len(request(list(range(9)), lookahead=2).block_hashes) == 1
    with pytest.raises(ValueError, match="num_hash_lookahead_tokens: expected an int >= 0"):
        get_request_block_hasher(4, sha256, -1)


def test_session_id_is_kept_but_not_hashed() -> None:
    a = request(list(range(8)), session_id="s1")
    b = request(list(range(8)), rid="b")
    assert a.session_id == "s1" and b.session_id is None
    assert a.block_hashes == b.block_hashes


def test_coarse_page_hash_is_the_last_fine_hash() -> None:
    r = request(list(range(16)))
    coarse = BlockHashListWithBlockSize(r.block_hashes, 4, 8)
    assert list(coarse) == [r.block_hashes[1], r.block_hashes[3]]


def test_set_block_hash_records_covered_tokens_until_reset() -> None:
    block = KVCacheBlock(3)
    key = make_block_hash_with_group_id(b"h" * 32, 0)
    block.set_block_hash(key, 6)
    assert block.block_hash == key and block.block_hash_num_tokens == 6
    with pytest.raises(AssertionError, match="expected no hash before caching"):
        block.set_block_hash(key)
    block.reset_hash()
    assert block.block_hash is None and block.block_hash_num_tokens is None


def test_pool_leaves_the_null_page_alone_and_knows_writable_pages() -> None:
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=4)
    null = pool.null_block
    pool.touch([null, null])
    pool.free_blocks([null])
    assert null.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    (page,) = pool.get_new_blocks(1)
    assert pool.is_block_writable(page) and not pool.is_block_writable(null)
    pool.touch([page])
    assert not pool.is_block_writable(page)
    assert MEDIUM_GPU == "GPU" and MEDIUM_CPU == "CPU"


def test_pop_blocks_for_free_hands_back_without_freeing() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4)
    m = FullAttentionManager(full(4), pool, True, 0, scheduler_block_size=8)
    assert m.scheduler_block_size == 8
    pages = m.allocate_new_blocks("r", 8, 8)
    assert m.pop_blocks_for_free("r") == pages and "r" not in m.req_to_blocks
    assert all(p.ref_cnt == 1 for p in pages)
    assert m.pop_blocks_for_free("unknown") == []
    with pytest.raises(ValueError, match="scheduler_block_size: expected a positive multiple"):
        FullAttentionManager(full(4), pool, True, 0, scheduler_block_size=6)


def test_manager_takes_v033_and_v022_arguments() -> None:
    config = config_of(16, full(4), sliding(4, 8))
    m = KVCacheManager(config, 64, 8, 4, max_in_flight_tokens=16)
    assert m.coordinator.scheduler_block_size == 8
    assert {s.scheduler_block_size for s in m.coordinator.single_type_managers} == {8}
    legacy = KVCacheManager(config, max_model_len=64, hash_block_size=4, max_num_batched_tokens=16)
    assert legacy.coordinator.scheduler_block_size == 4
    swa = legacy.coordinator.single_type_managers[1]
    assert (
        swa.max_admission_blocks_per_request
        == m.coordinator.single_type_managers[1].max_admission_blocks_per_request
    )
    with pytest.raises(TypeError, match="max_num_batched_tokens: expected only"):
        KVCacheManager(config, 64, 4, 4, max_in_flight_tokens=16, max_num_batched_tokens=16)
    with pytest.raises(TypeError, match="hash_block_size: expected tokens"):
        KVCacheManager(config, 64)
    with pytest.raises(ValueError, match="scheduler_block_size: expected a multiple of 4"):
        KVCacheManager(config, 64, 6, 2)


def test_prefill_lookahead_tokens_are_not_published() -> None:
    m = KVCacheManager(config_of(16, full(4)), 64, 4, 4, num_prefill_lookahead=3)
    r = make_request("r", list(range(13)), 4)
    m.allocate_slots(r, 13)
    # 13 computed tokens, the last 2 may be re-prefilled: 11 final tokens, 2 full pages.
    assert len(m.block_pool.cached_block_hash_to_block) == 2
    with pytest.raises(ValueError, match="expected >= num_prefill_lookahead 8"):
        KVCacheManager(config_of(16, full(4)), 64, 4, 4, use_eagle=True, num_prefill_lookahead=8)
    with pytest.raises(TypeError, match="num_prefill_lookahead: expected an int"):
        KVCacheManager(config_of(16, full(4)), 64, 4, 4, num_prefill_lookahead=1.5)


def swa_config(retention: int | None, *specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(
        num_blocks=100,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention,
    )


@pytest.mark.parametrize(
    ("retention", "expected"),
    [(None, set(range(16))), (64, {3, 7, 11, 14, 15}), (0, {14})],
)
def test_sliding_window_retention_keeps_segment_and_replay_tails(retention, expected) -> None:
    m = KVCacheManager(swa_config(retention, sliding(16, 16)), 8192, 16, 16)
    tokens = [i for i in range(16) for _ in range(16)]
    r = make_request("r", tokens, 16)
    assert m.allocate_slots(r, len(tokens)) is not None
    cached = {i for i, h in enumerate(r.block_hashes) if m.block_pool.get_cached_block(h, [0])}
    # Segments of 64 tokens keep their last page; the replay boundary (255 -> 240) its page 14.
    assert cached == expected
    _, num_hit, _ = m.get_computed_blocks(make_request("again", tokens, 16))
    assert num_hit == 240


def test_retention_interval_is_checked_against_the_config() -> None:
    with pytest.raises(ValueError, match="prefix_cache_retention_interval: expected 0 or None"):
        KVCacheManager(swa_config(64, full(16)), 8192, 16, 16)
    with pytest.raises(ValueError, match="retention_interval: expected None or a non-negative"):
        KVCacheManager(swa_config(24, sliding(16, 16)), 8192, 16, 16)
    assert replay_boundaries(256, 16, use_eagle=False) == (255,)
    assert replay_boundaries(256, 16, use_eagle=True) == (224, 240)
