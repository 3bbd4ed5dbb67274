"""HiSparse planning (vllm/v1/hisparse): groups, host pool, concurrency, and their errors."""

from types import SimpleNamespace

import pytest
import torch

from vllm.config import VllmConfig
from vllm.config.attention import HiSparseConfig
from vllm.v1.core import kv_cache_planning
from vllm.v1.hisparse.layout import (
    HISPARSE_HOT_SUFFIX,
    HISPARSE_RESIDENT_SUFFIX,
    create_hisparse_layout,
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
)
from vllm.v1.hisparse.runtime import ResolvedHiSparseConfig, hisparse_host_pool_gib
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheGroupRole,
    MLAAttentionSpec,
    SparseCacheRole,
)


def _specs(layers: int = 2) -> dict:
    specs = {}
    for i in range(layers):
        specs[f"l{i}.attn"] = MLAAttentionSpec(
            block_size=64,
            num_kv_heads=1,
            head_size=576,
            dtype=torch.bfloat16,
            is_index_group_leader=True,
        )
        specs[f"l{i}.attn.indexer"] = MLAAttentionSpec(
            block_size=64,
            num_kv_heads=1,
            head_size=128,
            dtype=torch.bfloat16,
            cache_role=SparseCacheRole.INDEXER,
        )
    return specs


def _config(**hisparse) -> SimpleNamespace:
    return SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=HiSparseConfig(**hisparse)),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(index_topk=128), max_model_len=256),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1,
            world_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
        cache_config=SimpleNamespace(num_gpu_blocks_override=None),
        speculative_config=None,
        kv_transfer_config=None,
        max_in_flight_tokens=256,
    )


def test_groups_split_source_indexer_resident_hot() -> None:
    groups = get_hisparse_kv_cache_groups(_config(), _specs())
    assert groups is not None
    source, indexer, *rest = groups
    assert source.host_resident and source.role is KVCacheGroupRole.HISPARSE_SOURCE
    assert indexer.role is KVCacheGroupRole.HISPARSE_INDEXER and not indexer.host_resident
    assert source.layer_names == ["l0.attn", "l1.attn"]
    # A sparse page (576 x 2 x 64 bytes) is larger than the indexer page, so each leader's
    # layer gets its own resident and hot group.
    resident = [g for g in rest if isinstance(g.kv_cache_spec, HiSparseResidentSpec)]
    hot = [g for g in rest if isinstance(g.kv_cache_spec, HiSparseHotSpec)]
    assert [g.layer_names for g in resident] == [
        ["l0.attn" + HISPARSE_RESIDENT_SUFFIX],
        ["l1.attn" + HISPARSE_RESIDENT_SUFFIX],
    ]
    assert [g.layer_names for g in hot] == [
        ["l0.attn" + HISPARSE_HOT_SUFFIX],
        ["l1.attn" + HISPARSE_HOT_SUFFIX],
    ]
    # Default hot buffer: (1 decode query + 1) x top-k rows = 256 rows = 4 pages of 64.
    assert {g.kv_cache_spec.blocks_per_request for g in hot} == {4}
    assert not any(g.enable_kv_transfer for g in resident + hot)
    spec = hot[0].kv_cache_spec
    assert not spec.prefix_cacheable and not spec.has_layer_views and not spec.uses_slot_mapping


def test_off_or_without_mla_is_none() -> None:
    config = _config()
    config.attention_config.hisparse_config = None
    assert get_hisparse_kv_cache_groups(config, _specs()) is None
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    assert get_hisparse_kv_cache_groups(_config(), {"a": full}) is None


def test_group_errors() -> None:
    specs = _specs()
    specs.pop("l0.attn.indexer")
    specs.pop("l1.attn.indexer")
    with pytest.raises(ValueError, match="sparse-MLA and indexer caches, got 2 sparse and 0"):
        get_hisparse_kv_cache_groups(_config(), specs)
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    with pytest.raises(ValueError, match="group_others: expected a grouping function"):
        get_hisparse_kv_cache_groups(_config(), _specs() | {"other": full})
    with pytest.raises(ValueError, match="device_buffer_size: expected at least 128 rows"):
        get_hisparse_kv_cache_groups(_config(device_buffer_size=64), _specs())
    with pytest.raises(ValueError, match="device_buffer_size: expected an int > 0"):
        HiSparseConfig(device_buffer_size=0)


def test_planning_groups_other_layers_after_hisparse() -> None:
    config = VllmConfig()
    config.attention_config.hisparse_config = HiSparseConfig()
    config.model_config = _config().model_config
    full = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=64, dtype=torch.float16)
    groups = kv_cache_planning.get_kv_cache_groups(config, _specs() | {"other": full})
    assert groups[-1].layer_names == ["other"]
    assert groups[0].host_resident


def test_host_pool_and_config() -> None:
    config = _config()
    groups = get_hisparse_kv_cache_groups(config, _specs())
    assert groups is not None
    page = _specs()["l0.attn"].page_size_bytes
    block = 2 * page  # a host block holds both sparse layers' pages
    with pytest.raises(ValueError, match="needs 6; increase host_pool_gib"):
        create_hisparse_layout(config, groups, host_budget=5 * block)
    out = get_hisparse_kv_cache_config(
        config, groups, available_memory=10**6, host_budget=8 * block
    )
    assert out.hisparse_host_num_blocks == 8 and out.host_group_ids == (0,)
    assert out.hisparse_host_block_stride == block
    host = [t for t in out.kv_cache_tensors if t.host_resident]
    assert [t.layers for t in host] == [["l0.attn", "l1.attn"]]
    assert (host[0].block_stride, host[0].layer_stride, host[0].size) == (page, page * 8, 8 * block)
    # Device blocks are as wide as the widest group (a sparse layer's resident page here).
    indexer_page = 2 * _specs()["l0.attn.indexer"].page_size_bytes
    assert out.num_blocks == 10**6 // max(indexer_page, page)
    device = [t for t in out.kv_cache_tensors if not t.host_resident]
    assert {t.block_stride for t in device} == {max(indexer_page, page)}
    assert kv_cache_planning.get_max_concurrency_for_kv_cache_config(config, out) > 0


def test_host_pool_gib_from_connector() -> None:
    config = SimpleNamespace(kv_transfer_config=None)
    assert hisparse_host_pool_gib(config) is None
    config.kv_transfer_config = SimpleNamespace(
        kv_connector="HiSparseConnector", kv_connector_extra_config={"host_pool_gib": 2}
    )
    assert hisparse_host_pool_gib(config) == 2.0
    two = {"kv_connector": "HiSparseConnector", "kv_connector_extra_config": {}}
    config.kv_transfer_config = SimpleNamespace(
        kv_connector="MultiConnector", kv_connector_extra_config={"connectors": [two, two]}
    )
    with pytest.raises(ValueError, match="at most one HiSparseConnector, got 2"):
        hisparse_host_pool_gib(config)


def test_resolved_config_limits() -> None:
    with pytest.raises(ValueError, match="at most 32768 rows"):
        ResolvedHiSparseConfig.from_vllm_config(_config(device_buffer_size=2**15 + 1), 128)
    resolved = ResolvedHiSparseConfig.from_vllm_config(_config(), 128)
    assert resolved is not None and resolved.device_buffer_size == 256
    assert resolved.max_union_rows == 128
