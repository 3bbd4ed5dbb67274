"""KVCacheManager on the KV cache configs our planner makes for real hybrid models: gpt-oss
(sliding window + full attention), Qwen3-Next and Nemotron-H (Mamba + full attention) and
DeepSeek-V4 (sliding-window MLA + compressed MLA groups of four block sizes). Each runs requests
through chunked prefill with a shared prefix: the second request hits the longest prefix that is
whole blocks of every group, the hit pages hold that prefix, and nothing leaks."""

from __future__ import annotations

import math
import random

import pytest

from tests.v1.core.block_manager_test_utils import ManagerSim, make_request
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import KVCacheConfig

# model -> (max_model_len, tokens per step, pages in the pool, manager classes of the groups)
MODELS = {
    "gpt-oss-20b": (1024, 64, 200, [SlidingWindowManager, FullAttentionManager]),
    "qwen3-next-80b-a3b-instruct": (4096, 512, 40, [MambaManager] * 3 + [FullAttentionManager]),
    "nemotron-h-56b-base-8k": (8192, 2048, 40, [MambaManager] * 5 + [FullAttentionManager]),
    "deepseek-v4-flash": (
        131072,
        8192,
        2000,
        [SlidingWindowManager] * 2 + [FullAttentionManager] * 3,
    ),
}


def scheduler_config(model: str, max_model_len: int, step: int, num_blocks: int) -> KVCacheConfig:
    """The scheduler's view of the planner's config for ``model`` with ``num_blocks`` pages."""
    probe = kcu.plan_kv_cache(model, None, 1 << 40, max_model_len, max_num_batched_tokens=step)
    plan = kcu.plan_kv_cache(
        model, None, num_blocks * probe.bytes_per_block, max_model_len, max_num_batched_tokens=step
    )
    assert plan.kv_cache_config.num_blocks == num_blocks
    return kcu.generate_scheduler_kv_cache_config([plan.kv_cache_config])


def hash_block_size(config: KVCacheConfig, max_model_len: int, step: int) -> int:
    vllm_config = kcu.planner_vllm_config(max_model_len, step)
    vllm_config.cache_config.enable_prefix_caching = True
    return kcu.resolve_kv_cache_block_sizes(config, vllm_config)[1]


@pytest.mark.parametrize("model", list(MODELS))
def test_shared_prefix_hits_whole_blocks_of_every_group(model: str) -> None:
    max_model_len, step, num_blocks, manager_classes = MODELS[model]
    config = scheduler_config(model, max_model_len, step, num_blocks)
    hash_size = hash_block_size(config, max_model_len, step)
    manager = KVCacheManager(
        config,
        max_model_len=max_model_len,
        hash_block_size=hash_size,
        max_num_batched_tokens=step,
        log_stats=True,
    )
    coordinator = manager.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    assert [type(m) for m in coordinator.single_type_managers] == manager_classes
    block_sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    lcm = math.lcm(*block_sizes)
    assert coordinator.lcm_block_size == lcm

    rng = random.Random(model)
    length = max_model_len * 3 // 4
    shared = length * 9 // 10
    prompt = [rng.randrange(1000) for _ in range(length)]
    sim = ManagerSim(manager, step)
    first = make_request("first", prompt, hash_size)
    for _ in range(math.ceil(length / step)):
        assert sim.schedule(first)
        sim.check_invariants()
    manager.new_step_starts()

    second = make_request("second", prompt[:shared] + [1000 + i for i in range(8)], hash_size)
    assert sim.schedule(second)  # checks that every non-null hit page holds this prefix
    sim.check_invariants()
    assert sim.last_hit is not None
    hit, num_hit = sim.last_hit
    expected = shared // lcm * lcm
    assert expected > 0 and num_hit == expected
    for single, blocks in zip(coordinator.single_type_managers, hit.blocks, strict=True):
        real = [b for b in blocks if not b.is_null]
        if isinstance(single, FullAttentionManager):
            assert len(real) == len(blocks)  # every page of the prefix
        else:
            assert 0 < len(real) < len(blocks)  # only the window's tail / the last state
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and (stats.requests, stats.hits) == (2, expected)
    sim.free_all_and_check_no_leak()
