"""Upstream v0.33's planning surface beyond its own tests: config records, spec geometry,
the builder hook, per-worker configs with explicit global groups, and the error paths."""

from types import SimpleNamespace

import pytest
import torch

from vllm.config import ModelConfig, SpeculativeConfig, VllmConfig
from vllm.v1.core import kv_cache_config_builder, kv_cache_planning
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    compute_layer_kv_cache_shape_bytes,
    compute_layout_strides,
    create_kv_cache_views,
    group_kernel_blocks,
    is_full_attention_spec,
    iter_layer_specs,
    replace_as,
)
from vllm.v1.kv_cache_layout import KVCacheLayout


def full(**kw) -> FullAttentionSpec:
    return FullAttentionSpec(
        **{"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16} | kw
    )


def test_tensor_record_and_v022_alias() -> None:
    t = KVCacheTensor(size=64, shared_by=["a", "b"])
    assert t.layers == t.shared_by == ["a", "b"] and t.layer_stride == 0 and t.block_stride is None
    assert t == KVCacheTensor(64, ["a", "b"])
    with pytest.raises(TypeError, match="layers: expected the layer names"):
        KVCacheTensor(size=64)
    with pytest.raises(TypeError, match="layers: expected the layer names"):
        KVCacheTensor(64, ["a"], shared_by=["a"])


def test_config_projections_and_errors() -> None:
    groups = [
        KVCacheGroupSpec(["a"], full()),
        KVCacheGroupSpec(["b"], full(), enable_kv_transfer=False, host_resident=True),
    ]
    config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=groups)
    assert config.transfer_group_ids == (0,) and config.host_group_ids == (1,)
    with pytest.raises(ValueError, match=r"block_ids: expected one list per KV cache group \(2\)"):
        config.select_transfer_block_ids([[1]])
    with pytest.raises(ValueError, match="hisparse_host_num_blocks: expected pages"):
        config.num_blocks_of(KVCacheTensor(8, ["b"], host_resident=True))
    assert config.num_blocks_of(KVCacheTensor(8, ["a"])) == 4
    assert not config.needs_kv_cache_zeroing
    mixed = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[groups[0], KVCacheGroupSpec(["c"], full(dtype=torch.bfloat16))],
    )
    assert mixed.has_mixed_precision_kv_cache and mixed.needs_kv_cache_zeroing


def test_iter_layer_specs_both_forms() -> None:
    wrapped = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full(), "b": full()})
    assert iter_layer_specs(wrapped) == (full(), full())
    config = KVCacheConfig(1, [], [KVCacheGroupSpec(["a", "b"], wrapped)])
    assert list(iter_layer_specs(config)) == [("a", full()), ("b", full())]
    with pytest.raises(TypeError, match="config: expected a KVCacheSpec or KVCacheConfig"):
        iter_layer_specs("a")  # type: ignore[call-overload]
    assert is_full_attention_spec(wrapped) and not is_full_attention_spec(
        SlidingWindowSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=8
        )
    )


def test_dcp_sharding_widths_and_blocks() -> None:
    config = VllmConfig(model_config=ModelConfig(max_model_len=1024))
    config.parallel_config.decode_context_parallel_size = 4
    assert full().max_num_blocks_per_req(config, 1024) == 16
    draft = full(dcp_sharded=False)
    assert draft.max_num_blocks_per_req(config, 1024) == 64
    assert draft.max_memory_usage_bytes(config) == 64 * draft.page_size_bytes
    assert kcu.resolve_dcp_kv_block_size(full(), 4) == 64
    assert kcu.resolve_dcp_kv_cache_spec(draft, 4) is draft
    # Sharded and replicated layers never share a group.
    assert UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": draft}) is None
    odd = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full(), "b": draft})
    with pytest.raises(ValueError, match="one block-table width, got \\[16, 64\\]"):
        odd.max_num_blocks_per_req(config, 1024)


def test_spec_grid_and_views() -> None:
    spec = full()
    assert (spec.num_heads, spec.num_states, spec.state_content_size_bytes) == (2, 16, 256)
    assert compute_layer_kv_cache_shape_bytes(spec, 10, 8) == (20, 2, 8, 256)
    with pytest.raises(ValueError, match="kernel_block_size: expected a divisor of the block"):
        compute_layer_kv_cache_shape_bytes(spec, 10, 6)
    assert compute_layout_strides(spec, 10, 3, KVCacheLayout.BLHNC) == (8192, 24576, 4096, 256, 1)
    padded = full(page_size_padded=10000)
    assert compute_layout_strides(padded, 10, 3, KVCacheLayout.LBHNC)[:2] == (100000, 10000)
    with pytest.raises(ValueError, match="padded pages cannot be split"):
        compute_layout_strides(padded, 10, 3, KVCacheLayout.LBHNC, kernel_block_size=8)
    with pytest.raises(ValueError, match="fixed_strides: expected 5 positive"):
        compute_layout_strides(spec, 10, 3, KVCacheLayout.LBHNC, fixed_strides=(0,) * 5)
    raw = torch.arange(3 * 10 * 8192, dtype=torch.int32).to(torch.int8)
    tensor = KVCacheTensor(raw.numel(), ["a", "b", "c"], 81920, 8192)
    views = create_kv_cache_views(raw, spec, 10, KVCacheLayout.LBHNC, tensor)
    assert views[1].shape == (10, 2, 16, 128) and views[1].dtype == torch.float16
    assert views[1].view(torch.int8).flatten()[0] == raw[81920]
    split = create_kv_cache_views(raw, spec, 10, KVCacheLayout.LBHNC, tensor, kernel_block_size=8)
    assert group_kernel_blocks(split[0], 10).shape == (10, 2, 2, 8, 128)
    interleaved = KVCacheTensor(raw.numel(), ["a", "b", "c"], 8192, 24576)
    with pytest.raises(ValueError, match="BLHNC does not store blocks as dense pages"):
        create_kv_cache_views(raw, spec, 10, KVCacheLayout.BLHNC, interleaved, 8)
    with pytest.raises(ValueError, match="num_blocks: expected a divisor"):
        group_kernel_blocks(split[0], 3)
    mamba = MambaSpec(block_size=16, shapes=((2, 3),), dtypes=(torch.float32,))
    assert (mamba.num_states, mamba.state_content_size_bytes) == (1, 24)
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=8
    )
    assert replace_as(swa, FullAttentionSpec, drop=("sliding_window",)) == full()


def test_head_size_v_zero_is_a_key_only_cache() -> None:
    assert full(head_size_v=0).page_size_bytes == full().page_size_bytes // 2
    with pytest.raises(ValueError, match="head_size_v: expected an int >= 0, got -1"):
        full(head_size_v=-1)


def test_lookahead_properties() -> None:
    config = VllmConfig(speculative_config=SpeculativeConfig(method="eagle"))
    assert config.num_prefill_lookahead_tokens == 1 and config.num_hash_lookahead_tokens == 1
    mtp = SpeculativeConfig(
        method="mtp",
        num_speculative_tokens=3,
        draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(num_nextn_predict_layers=3)),
    )
    assert VllmConfig(speculative_config=mtp).num_hash_lookahead_tokens == 3
    dflash = VllmConfig(speculative_config=SpeculativeConfig(method="dflash"))
    assert dflash.num_prefill_lookahead_tokens == 1 and dflash.num_hash_lookahead_tokens == 0
    assert VllmConfig().max_concurrent_batches == 1
    config.scheduler_config.async_scheduling = True
    assert config.max_concurrent_batches == 2
    assert config.max_in_flight_tokens == 2 * config.scheduler_config.max_num_batched_tokens


def test_configs_with_global_groups_and_capacity() -> None:
    config = VllmConfig(model_config=ModelConfig(max_model_len=256))
    specs = [{"a": full(), "b": full()}]
    groups = kv_cache_planning.get_global_kv_cache_groups(config, specs)
    page = full().page_size_bytes
    (out,) = kv_cache_planning.get_kv_cache_configs(config, specs, [40 * 2 * page], groups)
    assert out.num_blocks == 40 and out.kv_tp_replicas == 1
    assert kcu.get_kv_cache_capacity(config, out) == (int(40 / 16 * 256), 40 / 16)
    assert kcu.generate_scheduler_kv_cache_config([out]).num_blocks == 40
    with pytest.raises(ValueError, match="available_memory: expected one budget per worker"):
        kv_cache_planning.get_kv_cache_configs(config, specs, [], groups)
    with pytest.raises(ValueError, match=r"every layer in exactly one group.*miss layers \['b'\]"):
        kv_cache_planning.get_kv_cache_configs(
            config, specs, [10**6], [KVCacheGroupSpec(["a"], full())]
        )


def test_tp_replicas() -> None:
    replicated = full(max_tp_shards=2)
    groups = [KVCacheGroupSpec(["a"], replicated)]
    assert kv_cache_planning.kv_cache_groups_tp_replicas(groups, 8) == 4
    assert kv_cache_planning.kv_cache_groups_tp_replicas(groups, 8, dcp_size=2) == 1
    with pytest.raises(ValueError, match="max_tp_shards: expected a positive int"):
        full(max_tp_shards=0)


def test_builder_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    config = VllmConfig()
    builder = kv_cache_config_builder.get_kv_cache_config_builder(config)
    assert isinstance(builder, kv_cache_planning.DefaultKVCacheConfigBuilder)
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        current_platform,
        "get_kv_cache_config_builder_cls",
        lambda _: "builtins.dict",
        raising=False,
    )
    with pytest.raises(TypeError, match="builder: expected a KVCacheConfigBuilder subclass"):
        kv_cache_config_builder.get_kv_cache_config_builder(config)
    monkeypatch.setattr(
        current_platform, "get_kv_cache_config_builder_cls", lambda _: "nodots", raising=False
    )
    with pytest.raises(ValueError, match="builder: expected a qualified class name"):
        kv_cache_config_builder.get_kv_cache_config_builder(config)


def test_block_table_and_event_helpers() -> None:
    null = KVCacheBlock(0, is_null=True)
    real = [KVCacheBlock(i) for i in range(1, 4)]
    assert kcu.null_head_len([null] * 3 + real) == 3
    assert kcu.null_head_len([null, real[0], null] + real) == 1
    assert kcu.null_head_len([null] * 2) == 2 and kcu.null_head_len(real) == 0
    assert list(kcu.trim_null_head([null] + real)) == real
    keys = (("lora", "x", "/p"), ("mm", "h", 2), ("cache_salt", "s"))
    assert kcu.to_event_extra_keys([keys, None]) == [("x", ("h", 2), "s"), None]
    assert kcu.to_event_extra_keys([]) is None and kcu.to_event_extra_keys(None) is None


def test_uniform_type_rules_of_mamba_and_ring_specs() -> None:
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        MambaSpec,
        UniformTypeKVCacheSpecs,
    )

    def mamba(**kw) -> MambaSpec:
        return MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,), **kw)

    def ring() -> CircularBufferSpec:
        return CircularBufferSpec(block_size=4, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)

    assert UniformTypeKVCacheSpecs.is_uniform_type({"a": mamba(), "b": mamba()})
    for other in (
        mamba(num_prefill_checkpoint_blocks=1),
        MambaSpec(block_size=16, shapes=((4, 16),), dtypes=(torch.float32,)),
    ):
        assert not UniformTypeKVCacheSpecs.is_uniform_type({"a": mamba(), "b": other})
    assert UniformTypeKVCacheSpecs.is_uniform_type({"a": ring(), "b": ring()})
