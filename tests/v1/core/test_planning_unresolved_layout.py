"""v0.33's ``get_kv_cache_config_from_groups`` refuses an unresolved cache layout; the
cross-worker flow and v0.22's name keep planning it v0.22's way."""

import pytest
import torch

from vllm.config import ModelConfig, VllmConfig
from vllm.v1.core import kv_cache_planning
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.kv_cache_interface import FullAttentionSpec

SPECS = {
    f"l{i}": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.half)
    for i in range(2)
}

BLOCKS = (1 << 20) // (2 * 8192)
"""Blocks in 1 MiB: two layers of 8192-byte pages (16 tokens x 2 heads x 64 x K+V x 2 B)."""


def config(layout: str | None) -> VllmConfig:
    cfg = VllmConfig(model_config=ModelConfig(max_model_len=64))
    cfg.cache_config.kv_cache_layout = layout
    return cfg


def test_unresolved_layout_is_refused_before_planning() -> None:
    groups = kv_cache_planning.get_kv_cache_groups(config(None), dict(SPECS))
    with pytest.raises(ValueError, match="kv_cache_layout: the KV cache layout has not been"):
        kv_cache_planning.get_kv_cache_config_from_groups(config(None), groups, 1 << 20)
    # No groups (an attention-free model): nothing to lay out.
    empty = kv_cache_planning.get_kv_cache_config_from_groups(config(None), [], 0)
    assert empty.num_blocks == 1
    resolved = kv_cache_planning.get_kv_cache_config_from_groups(config("LBNHC"), groups, 1 << 20)
    assert resolved.num_blocks == BLOCKS


def test_v022_names_and_cross_worker_flow_keep_planning_it() -> None:
    groups = kv_cache_planning.get_kv_cache_groups(config(None), dict(SPECS))
    v022 = kcu.get_kv_cache_config_from_groups(config(None), groups, 1 << 20)
    (cross,) = kcu.get_kv_cache_configs(config(None), [dict(SPECS)], [1 << 20])
    assert v022.num_blocks == cross.num_blocks == BLOCKS
