"""Planning with a DCP-sharded target and a replicated draft (upstream v0.33): packed groups
under a block-outermost layout, sliding windows promoted per sharding class with the hybrid
manager off, replicated windows sized without DCP, and the strided tensors the planner
emits once the layout is resolved, read back by the worker."""

from __future__ import annotations

import pytest
import torch

from vllm.config import ModelConfig, VllmConfig
from vllm.v1.attention.backends import MLACommonBackend, ReferenceAttentionBackend
from vllm.v1.core import kv_cache_planning
from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.worker.gpu.attn_utils import _reshape_kv_cache, init_layer_kv_caches
from vllm.v1.worker.gpu.kv_cache_buffers import _allocate_kv_cache

MEMORY = 16 * 1024 * 1024


def _config(layout: str | None, disable_hybrid: bool = False, dcp: int = 4) -> VllmConfig:
    config = VllmConfig(model_config=ModelConfig(max_model_len=1024))
    config.parallel_config.decode_context_parallel_size = dcp
    config.scheduler_config.disable_hybrid_kv_cache_manager = disable_hybrid
    config.cache_config.kv_cache_layout = layout
    return config


def _target() -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)


def _draft(sliding_window: int | None = None) -> FullAttentionSpec | SlidingWindowSpec:
    args = dict(block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    if sliding_window is None:
        return FullAttentionSpec(**args, dcp_sharded=False)
    return SlidingWindowSpec(**args, dcp_sharded=False, sliding_window=sliding_window)


@pytest.mark.parametrize("disable_hybrid", [False, True])
@pytest.mark.parametrize("window", [None, 256])
def test_block_outermost_layout_keeps_draft_pages_unchanged(
    disable_hybrid: bool, window: int | None
) -> None:
    config = _config("BLHNC", disable_hybrid)
    groups = get_kv_cache_groups(config, {"target": _target(), "draft": _draft(window)})
    assert [g.layer_names for g in groups] == [["target"], ["draft"]]
    # No page-size unification: the draft keeps 16-token blocks, all 1024 positions on a rank.
    assert [g.kv_cache_spec.block_size for g in groups] == [16, 16]
    assert [g.kv_cache_spec.max_num_blocks_per_req(config, 1024) for g in groups] == [16, 64]


def test_unresolved_layout_keeps_unified_pages() -> None:
    groups = get_kv_cache_groups(_config(None), {"target": _target(), "draft": _draft()})
    pages = {g.kv_cache_spec.page_size_bytes for g in groups}
    assert len(pages) == 1  # v0.22's path: one page size, the draft's block grown


def test_disabled_hybrid_promotes_windows_per_sharding_class() -> None:
    sharded_full = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16
    )
    sharded_window = SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16, sliding_window=64
    )
    specs = {"full": sharded_full, "window": sharded_window, "draft": _draft(128)}
    kv_cache_planning.unify_hybrid_kv_cache_specs(specs)
    assert isinstance(specs["window"], FullAttentionSpec) and specs["window"].sliding_window == 64
    # The replicated class has no full attention: its window stays a window.
    assert isinstance(specs["draft"], SlidingWindowSpec)


def test_disabled_hybrid_still_refuses_a_class_without_one_type() -> None:
    specs = {"window": _draft(64), "other_window": _draft(128)}
    with pytest.raises(ValueError, match="cannot be turned into one type"):
        kv_cache_planning.unify_hybrid_kv_cache_specs(specs)


def test_replicated_window_sized_without_dcp_sharded_refused() -> None:
    config = _config(None)
    assert _draft(256).max_memory_usage_bytes(config) > 0
    sharded = SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16, sliding_window=256
    )
    with pytest.raises(ValueError, match="sliding-window layers need 1 when DCP-sharded, got 4"):
        sharded.max_memory_usage_bytes(config)


def test_packed_config_is_strided_and_the_worker_reads_it() -> None:
    config = _config("BLHNC", dcp=1)
    target = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    draft = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, dcp_sharded=False
    )
    groups = get_kv_cache_groups(config, {"t.0": target, "t.1": target, "d.0": draft})
    assert [g.layer_names for g in groups] == [["t.0", "t.1"], ["d.0"]]
    kv = kv_cache_planning.get_kv_cache_config_from_groups(config, groups, MEMORY)
    block = max(2 * target.page_size_bytes, draft.page_size_bytes)
    assert kv.num_blocks == MEMORY // block
    assert {t.size for t in kv.kv_cache_tensors} == {block * kv.num_blocks}
    t_tensor, d_tensor = kv.kv_cache_tensors
    assert (t_tensor.layers, t_tensor.layer_stride, t_tensor.block_stride, t_tensor.offset) == (
        ["t.0", "t.1"],
        target.page_size_bytes,
        block,
        0,
    )
    assert (d_tensor.layers, d_tensor.block_stride, d_tensor.offset) == (["d.0"], block, 0)
    backends = [MLACommonBackend, ReferenceAttentionBackend]
    raw = _allocate_kv_cache(kv, "cpu")
    views = _reshape_kv_cache(kv, raw, backends)
    views["t.0"][1].fill_(1.0)
    views["t.1"][1].fill_(2.0)
    assert bool((views["t.0"][1] == 1.0).all())
    assert views["d.0"].data_ptr() == views["t.0"].data_ptr()  # the groups overlay each block


@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC", "BHLNC"])
def test_mixed_pages_of_several_groups_need_a_block_compact_outer_layout(layout: str) -> None:
    target = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(
            ["t"], UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"t": target})
        ),
        KVCacheGroupSpec(["d"], _draft()),
    ]
    with pytest.raises(ValueError, match=f"kv_cache_layout: {layout} cannot express"):
        kv_cache_planning.get_kv_cache_config_from_groups(_config(layout, dcp=1), groups, MEMORY)


def test_layer_outermost_layout_gives_each_layer_a_region() -> None:
    config = _config("LBNHC", dcp=1)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["a", "b"], spec)]
    kv = kv_cache_planning.get_kv_cache_config_from_groups(config, groups, MEMORY)
    (tensor,) = kv.kv_cache_tensors
    page = spec.page_size_bytes
    assert kv.num_blocks == MEMORY // (2 * page)
    assert (tensor.layer_stride, tensor.block_stride) == (page * kv.num_blocks, page)
    views = init_layer_kv_caches(kv, [ReferenceAttentionBackend], "cpu", model_dtype=torch.float32)
    assert views["b"].data_ptr() - views["a"].data_ptr() == page * kv.num_blocks
