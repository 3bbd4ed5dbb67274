"""Sizing by block count: ``kv_cache_memory_for_blocks`` gives the bytes for which
``get_kv_cache_configs`` yields exactly N blocks, and upstream's ``num_gpu_blocks_override``
gives N blocks end to end (config → allocated caches)."""

from __future__ import annotations

import pytest
import torch

from vllm.config import ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.attention.backends import ReferenceAttentionBackend
from vllm.v1.core.kv_cache_utils import (
    PLANNER_LAYOUT,
    get_kv_cache_configs,
    kv_cache_memory_for_blocks,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    KVQuantMode,
    SlidingWindowSpec,
)
from vllm.v1.worker.gpu.attn_utils import init_layer_kv_caches

PAGE = 32 * 4 * 256 * 2  # bf16, 32-token pages, 4 KV heads of 128: 65,536 bytes


def _config(max_model_len: int = 1024) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(max_model_len=max_model_len),
        scheduler_config=SchedulerConfig(max_model_len=max_model_len),
    )


def _full(**kw: object) -> FullAttentionSpec:
    fields = {"block_size": 32, "num_kv_heads": 4, "head_size": 128, "dtype": torch.bfloat16}
    return FullAttentionSpec(**{**fields, **kw})  # type: ignore[arg-type]


def _swa() -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=32, num_kv_heads=4, head_size=128, dtype=torch.bfloat16, sliding_window=256
    )


UNIFORM = {f"l{i}": _full() for i in range(3)}
HYBRID = {"f0": _full(), "f1": _full()} | {f"s{i}": _swa() for i in range(5)}
MIXED_HEADS = {"a": _full(), "b": _full(head_size=64), "c": _full(head_size=256)}
NVFP4 = {f"l{i}": _full(dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4) for i in range(2)}


@pytest.mark.parametrize("specs", [UNIFORM, HYBRID, MIXED_HEADS, NVFP4], ids=str)
@pytest.mark.parametrize("num_blocks", [200, 201, 1000])
def test_memory_for_blocks_yields_exactly_that_many(
    specs: dict[str, KVCacheSpec], num_blocks: int
) -> None:
    before = dict(specs)
    memory = kv_cache_memory_for_blocks(_config(), specs, num_blocks)
    assert specs == before
    (config,) = get_kv_cache_configs(_config(), [dict(specs)], [memory])
    assert config.num_blocks == num_blocks
    assert sum(t.size for t in config.kv_cache_tensors) == memory  # no byte left over
    # One byte less is one block less: the helper gives the least memory for N blocks.
    (smaller,) = get_kv_cache_configs(_config(), [dict(specs)], [memory - 1])
    assert smaller.num_blocks == num_blocks - 1


def test_memory_for_blocks_worked_numbers_and_errors() -> None:
    assert kv_cache_memory_for_blocks(_config(), UNIFORM, 100) == 100 * 3 * PAGE
    # Hybrid: 2 full + 5 sliding layers form groups of 2 (2, 2, 2, 1): 2 tensors of one page.
    assert kv_cache_memory_for_blocks(_config(), HYBRID, 100) == 100 * 2 * PAGE
    planner = kv_cache_memory_for_blocks(_config(), HYBRID, 400, policy=PLANNER_LAYOUT)
    (config,) = get_kv_cache_configs(_config(), [dict(HYBRID)], [planner], policy=PLANNER_LAYOUT)
    assert config.num_blocks == 400
    assert kv_cache_memory_for_blocks(_config(), {}, 5) == 0
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"num_blocks: expected a positive int, got {bad!r}"):
            kv_cache_memory_for_blocks(_config(), UNIFORM, bad)  # type: ignore[arg-type]


def test_num_gpu_blocks_override_end_to_end() -> None:
    """Upstream's way: the override decides ``num_blocks`` whatever the budget, and the caches
    allocated from the config hold exactly that many pages."""
    vllm_config = _config()
    vllm_config.cache_config.num_gpu_blocks_override = 150
    (config,) = get_kv_cache_configs(vllm_config, [dict(HYBRID)], [10**12])
    assert config.num_blocks == 150
    caches = init_layer_kv_caches(
        config, {name: ReferenceAttentionBackend for name in HYBRID}, "cpu"
    )
    assert {name: cache.shape[0] for name, cache in caches.items()} == dict.fromkeys(HYBRID, 150)
