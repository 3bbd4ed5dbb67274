"""Upstream v0.22's planning names, called the way upstream's engine and tests call them:
``vllm.v1.core.kv_cache_utils`` with a ``VllmConfig``, and the new spec surface."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.utils.mem_constants import GiB_bytes
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)

# bf16, 4 KV heads of 128, 32-token pages: 32 * 4 * 256 * 2 = 65,536 bytes per page.
PAGE = 65_536


def full(**kw) -> FullAttentionSpec:
    return FullAttentionSpec(
        **{"block_size": 32, "num_kv_heads": 4, "head_size": 128, "dtype": torch.bfloat16, **kw}
    )


def swa(window: int = 256) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=32, num_kv_heads=4, head_size=128, dtype=torch.bfloat16, sliding_window=window
    )


def config(max_model_len: int = 4096, **scheduler) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(max_model_len=max_model_len),
        scheduler_config=SchedulerConfig(max_model_len=max_model_len, **scheduler),
    )


def test_configs_take_upstream_shapes() -> None:
    cfg = VllmConfig(model_config=ModelConfig("org/model", runner="generate", max_model_len=64))
    assert cfg.scheduler_config is not None
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert cfg.scheduler_config.max_num_encoder_input_tokens == 2048
    assert cfg.cache_config.num_gpu_blocks_override is None
    assert cfg.parallel_config.decode_context_parallel_size == 1
    with_events = VllmConfig(
        model_config=ModelConfig(max_model_len=64),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    assert with_events.scheduler_config.disable_hybrid_kv_cache_manager is False
    with pytest.raises(ValueError, match="max_model_len: expected a positive int .*, got -2"):
        ModelConfig(max_model_len=-2)
    with pytest.raises(ValueError, match="mamba_cache_mode: expected one of all, align, none"):
        CacheConfig(mamba_cache_mode="some")
    with pytest.raises(ValueError, match="decode_context_parallel_size: expected a positive"):
        ParallelConfig(decode_context_parallel_size=0)


def test_world_size_and_kv_transfer_config() -> None:
    from vllm.config import KVTransferConfig

    parallel = ParallelConfig(
        tensor_parallel_size=4,
        pipeline_parallel_size=2,
        prefill_context_parallel_size=2,
        decode_context_parallel_size=2,  # reuses the tensor-parallel ranks: not counted
    )
    assert parallel.world_size == 16
    assert ParallelConfig().world_size == 1
    with pytest.raises(TypeError):
        ParallelConfig(world_size=2)  # type: ignore[call-arg]  # derived, as upstream
    transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
    assert VllmConfig(kv_transfer_config=transfer).kv_transfer_config is transfer
    assert VllmConfig().kv_transfer_config is None


def test_spec_memory_bounds_read_the_config() -> None:
    cfg = config(4096, max_num_batched_tokens=512)
    assert full().max_memory_usage_bytes(cfg) == 128 * PAGE
    # min(255 + 512, 4096) = 767 tokens -> 24 pages, + 1 for a window starting mid-page.
    assert swa().max_memory_usage_bytes(cfg) == 25 * PAGE
    chunked = ChunkedLocalAttentionSpec(
        block_size=32, num_kv_heads=4, head_size=128, dtype=torch.bfloat16, attention_chunk_size=64
    )
    assert chunked.max_admission_blocks_per_request(512, 4096) == 18
    assert EncoderOnlyAttentionSpec(**_attn()).max_memory_usage_bytes(cfg) == 0
    assert CrossAttentionSpec(**_attn()).max_memory_usage_bytes(cfg) == 16 * PAGE  # 512 tokens
    dcp = config(4096)
    dcp.parallel_config.decode_context_parallel_size = 2
    assert full().max_memory_usage_bytes(dcp) == 64 * PAGE
    with pytest.raises(ValueError, match="decode_context_parallel_size: sliding-window"):
        swa().max_memory_usage_bytes(dcp)
    mamba = MambaSpec(
        block_size=32, shapes=((4, 16),), dtypes=(torch.float32,), num_speculative_blocks=1
    )
    assert mamba.max_memory_usage_bytes(cfg) == 2 * 256
    cfg.cache_config.mamba_cache_mode = "align"
    assert mamba.max_memory_usage_bytes(cfg) == 3 * 256
    cfg.cache_config.mamba_cache_mode = "all"
    assert mamba.max_memory_usage_bytes(cfg) == (128 + 1) * 256


def _attn() -> dict:
    return dict(block_size=32, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)


def test_merge_windows_and_errors() -> None:
    merged = full().merge([full(), full(sliding_window=128)])
    assert merged.sliding_window == 128
    with pytest.raises(ValueError, match="sliding_window: layers of one KV cache group"):
        full().merge([full(sliding_window=64), full(sliding_window=128)])
    # Upstream's merge asserts; ours raises an error that is both.
    with pytest.raises(AssertionError, match="differ in num_kv_heads"):
        full().merge([full(), full(num_kv_heads=8)])
    with pytest.raises(ValueError, match="cannot merge FullAttentionSpec with SlidingWindow"):
        full().merge([full(), swa()])
    assert kcu.is_kv_cache_spec_uniform({"a": full(), "b": full(sliding_window=128)})
    assert not kcu.is_kv_cache_spec_uniform({"a": full(), "b": swa()})


def test_full_and_sink_full_layers_merge() -> None:
    sink = SinkFullAttentionSpec(**_attn(), sink_len=4)
    # As upstream: one group, of the first layer's class (and sink_len).
    as_full = full().merge([full(), sink])
    assert type(as_full) is FullAttentionSpec and as_full == full()
    as_sink = sink.merge([sink, full(sliding_window=64)])
    assert type(as_sink) is SinkFullAttentionSpec
    assert (as_sink.sink_len, as_sink.sliding_window) == (4, 64)
    assert kcu.is_kv_cache_spec_uniform({"a": full(), "b": sink})
    with pytest.raises(AssertionError, match="differ in num_kv_heads"):
        sink.merge([sink, full(num_kv_heads=8)])
    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    for specs in ([full(), mla], [mla, full()], [sink, mla]):
        with pytest.raises(AssertionError, match="cannot merge"):
            specs[0].merge(specs)


def test_spec_kinds_and_windows() -> None:
    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    sink = SinkFullAttentionSpec(**_attn(), sink_len=4)
    kinds = {
        get_kv_cache_spec_kind(s)
        for s in (mla, sink, full(), swa(), EncoderOnlyAttentionSpec(**_attn()))
    }
    assert kinds == {
        KVCacheSpecKind.MLA_ATTENTION,
        KVCacheSpecKind.SINK_FULL_ATTENTION,
        KVCacheSpecKind.FULL_ATTENTION,
        KVCacheSpecKind.SLIDING_WINDOW,
        KVCacheSpecKind.ENCODER_ONLY_ATTENTION,
    }
    group = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={"a": swa(), "b": swa()})
    assert get_kv_cache_spec_kind(group) == KVCacheSpecKind.SLIDING_WINDOW
    assert get_kv_cache_spec_sliding_window(group) == 256
    assert get_kv_cache_spec_sliding_window(full(sliding_window=64)) is None  # cached in full
    mixed = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={"a": full(), "b": swa()})
    assert get_kv_cache_spec_kind(mixed) == KVCacheSpecKind.UNKNOWN
    assert group.get_page_sizes() == [PAGE] and group.get_num_layer_tuples() == 2


def test_uniform_type_rule_is_upstreams() -> None:
    common = dict(block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8)
    v4 = dict(common, cache_dtype_str="fp8_ds_mla", model_version="deepseek_v4")
    compressed = {
        "c4": MLAAttentionSpec(**v4, compress_ratio=4),
        "c64": MLAAttentionSpec(**v4, compress_ratio=64),
        "plain": MLAAttentionSpec(**v4),
    }
    # Layers of different compress ratios need the same token slots: one uniform group.
    assert UniformTypeKVCacheSpecs.is_uniform_type(compressed)
    group = UniformTypeKVCacheSpecs.from_specs(compressed)
    assert group is not None and sorted(group.get_page_sizes()) == [584, 16 * 584, 64 * 584]
    # The first spec's kind decides, as upstream (a sliding-window MLA layer is a SWA layer).
    swa_mla = SlidingWindowMLASpec(**common, sliding_window=256)
    sliding = {"a": swa(256), "b": dataclasses.replace(swa_mla, block_size=32)}
    assert UniformTypeKVCacheSpecs.is_uniform_type(sliding)
    assert not UniformTypeKVCacheSpecs.is_uniform_type(dict(reversed(sliding.items())))
    with pytest.raises(NotImplementedError, match="EncoderOnlyAttentionSpec"):
        UniformTypeKVCacheSpecs.is_uniform_type({"e": EncoderOnlyAttentionSpec(**_attn())})
    assert not UniformTypeKVCacheSpecs.is_uniform_type(
        {"f": full(), "e": EncoderOnlyAttentionSpec(**_attn())}
    )


def test_fp8_ds_mla_layouts() -> None:
    common = dict(block_size=64, num_kv_heads=1, dtype=torch.uint8, cache_dtype_str="fp8_ds_mla")
    assert MLAAttentionSpec(head_size=576, **common).page_size_bytes == 64 * 656
    v4 = MLAAttentionSpec(head_size=512, model_version="deepseek_v4", compress_ratio=4, **common)
    assert v4.storage_block_size == 16 and v4.page_size_bytes == 16 * 584
    swa_v4 = SlidingWindowMLASpec(
        block_size=64,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.uint8,
        sliding_window=128,
        model_version="deepseek_v4",
        alignment=576,
    )
    assert swa_v4.page_size_bytes == 37_440  # 64 * 584 = 37,376 rounded up to 576


def test_get_kv_cache_configs_for_two_pipeline_stages() -> None:
    cfg = config(1024)
    stages = [{"l0": full(), "l1": swa()}, {"l2": full(), "l3": swa()}]
    configs = kcu.get_kv_cache_configs(cfg, stages, [100 * PAGE, 120 * PAGE])
    # Groups are global (one full, one sliding); each stage holds one layer of each.
    assert [len(c.kv_cache_groups) for c in configs] == [2, 2]
    assert configs[0].kv_cache_groups[0].layer_names == ["l0"]
    assert {c.num_blocks for c in configs} == {100}
    assert configs[1].kv_cache_tensors[0].size == 100 * PAGE
    scheduler = kcu.generate_scheduler_kv_cache_config(configs)
    assert scheduler.num_blocks == 100 and scheduler is not configs[0]
    with pytest.raises(ValueError, match="max seq len"):
        kcu.get_kv_cache_configs(cfg, stages, [10 * PAGE, 10 * PAGE])
    with pytest.raises(AssertionError, match="different specs on different workers"):
        kcu.get_kv_cache_configs(cfg, [{"l0": full()}, {"l0": swa()}], [GiB_bytes] * 2)


def test_override_and_auto_fit() -> None:
    cfg = config(4096)
    cfg.cache_config.num_gpu_blocks_override = 40
    cfg.model_config.original_max_model_len = -1
    (out,) = kcu.get_kv_cache_configs(cfg, [{"a": full()}], [GiB_bytes])
    # Upstream v0.33 plans the fit against the blocks left after the pool's null block.
    assert out.num_blocks == 40 and cfg.model_config.max_model_len == 39 * 32
    assert kcu.may_override_num_blocks(cfg, 7) == 40
    cfg.cache_config.num_gpu_blocks_override = None
    assert kcu.get_num_blocks(cfg, 2, 10 * PAGE, PAGE) == 5


@pytest.mark.parametrize(
    "hf_config,expected",
    [
        (SimpleNamespace(), 2048),  # no maximum given: upstream's assumption
        (SimpleNamespace(max_position_embeddings=40960), 40960),
        (SimpleNamespace(max_position_embeddings=4096, n_positions=2048), 2048),
        (SimpleNamespace(max_position_embeddings=8192, model_max_length=131072), 131072),
        (
            SimpleNamespace(
                max_position_embeddings=4096, rope_scaling={"rope_type": "linear", "factor": 4.0}
            ),
            16384,
        ),
        (
            SimpleNamespace(
                max_position_embeddings=163840,
                rope_scaling={"type": "yarn", "factor": 40.0},  # already scaled
            ),
            163840,
        ),
        (
            SimpleNamespace(
                max_position_embeddings=131072,
                model_type="gemma3_text",
                rope_scaling={"rope_type": "linear", "factor": 8.0},
            ),
            131072,
        ),
    ],
)
def test_minus_one_starts_from_the_models_maximum(hf_config, expected) -> None:
    model_config = ModelConfig(max_model_len=-1, hf_config=hf_config)
    assert model_config.original_max_model_len == -1
    assert model_config.max_model_len == expected


def test_minus_one_fits_the_length_to_memory() -> None:
    cfg = config(4096)
    cfg.model_config = ModelConfig(
        max_model_len=-1, hf_config=SimpleNamespace(max_position_embeddings=4096)
    )
    (out,) = kcu.get_kv_cache_configs(cfg, [{"a": full()}], [11 * PAGE])
    assert out.num_blocks == 11 and cfg.model_config.max_model_len == 10 * 32
    roomy = config(4096)
    roomy.model_config = ModelConfig(
        max_model_len=-1, hf_config=SimpleNamespace(max_position_embeddings=4096)
    )
    kcu.get_kv_cache_configs(roomy, [{"a": full()}], [GiB_bytes])
    assert roomy.model_config.max_model_len == 4096  # the model's maximum fits


def test_upstream_and_planner_group_sizes() -> None:
    specs = {f"f{i}": full() for i in range(3)} | {f"s{i}": swa() for i in range(7)}
    upstream = kcu.get_kv_cache_groups(config(), dict(specs))
    assert [len(g.layer_names) for g in upstream] == [3, 3, 2, 2]  # g = 3, padded to 12 slots
    planner = kcu.get_kv_cache_groups(config(), dict(specs), policy=kcu.PLANNER_LAYOUT)
    assert len(planner) == 10  # no group size under 5 % padding but 1
    assert kcu.UPSTREAM_LAYOUT.group_size([13, 12]) == 13


def test_page_unification_rules() -> None:
    half = SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=128, dtype=torch.bfloat16, sliding_window=64
    )
    unified = kcu.unify_kv_cache_spec_page_size({"a": full(), "b": half})
    assert unified["b"].block_size == 64 and unified["b"].page_size_bytes == PAGE
    odd = SlidingWindowSpec(
        block_size=32, num_kv_heads=3, head_size=128, dtype=torch.bfloat16, sliding_window=64
    )
    # Upstream v0.33 pads a K/V page that does not divide the largest one (v0.22 refused it).
    padded = kcu.unify_kv_cache_spec_page_size({"a": full(), "b": odd})["b"]
    assert padded.block_size == 32 and padded.page_size_padded == PAGE
    planner = kcu.unify_kv_cache_spec_page_size(
        {"a": full(), "b": odd}, kcu.MAX_PAGE_GROWTH, kcu.MAX_EXACT_PAGE_GROWTH
    )
    assert kcu.is_kv_cache_page_size_uniform(planner)


def test_disabled_hybrid_manager_caches_windows_in_full() -> None:
    specs = {"a": full(), "b": swa()}
    kcu.unify_hybrid_kv_cache_specs(specs)
    assert specs["b"] == full(sliding_window=256)
    cfg = config()
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = True
    groups = kcu.get_kv_cache_groups(cfg, {"a": full(), "b": swa()})
    assert len(groups) == 1 and groups[0].kv_cache_spec == full(sliding_window=256)
    with pytest.raises(ValueError, match="cannot be turned into one type"):
        kcu.unify_hybrid_kv_cache_specs({"a": swa(), "b": swa(window=512)})


def test_memory_helpers() -> None:
    cfg = config(2048)
    specs = {"a": full(), "b": full()}
    assert kcu.max_memory_usage_bytes(cfg, specs.values()) == 2 * 64 * PAGE
    assert kcu.estimate_max_model_len(cfg, specs, 2 * 10 * PAGE) == 320
    assert cfg.model_config.max_model_len == 2048  # restored
    # v0.33: the pool's null block (one page of each layer) is not the request's.
    kcu.check_enough_kv_cache_memory(cfg, specs, 130 * PAGE)
    with pytest.raises(kcu.InsufficientKVCacheMemoryError, match="max_model_len=2048"):
        kcu.check_enough_kv_cache_memory(cfg, specs, 128 * PAGE)
    with pytest.raises(kcu.InsufficientKVCacheMemoryError, match="largest max_model_len .* 288"):
        kcu.check_enough_kv_cache_memory(cfg, specs, 20 * PAGE)
    groups = kcu.create_kv_cache_group_specs(specs, [["a", "b"]])
    kv_config = kcu.get_kv_cache_config_from_groups(cfg, groups, 2 * 128 * PAGE)
    assert kv_config.num_blocks == 128
    assert kcu.get_max_concurrency_for_kv_cache_config(cfg, kv_config) == 2.0
    assert kcu.get_uniform_page_size(specs.values()) == PAGE
    assert kcu.resolve_kv_cache_block_sizes(kv_config, cfg) == (16, 16)  # cache_config's


def test_hybrid_block_sizes_and_projection() -> None:
    cfg = config()
    groups = [
        KVCacheGroupSpec(["a"], full()),
        KVCacheGroupSpec(["b"], full(block_size=64), is_eagle_group=True),
    ]
    kv_config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=groups)
    assert kcu.resolve_kv_cache_block_sizes(kv_config, cfg) == (64, 32)
    cfg.cache_config.hash_block_size = 48
    with pytest.raises(ValueError, match="prefix_match_unit: expected a divisor"):
        kcu.resolve_kv_cache_block_sizes(kv_config, cfg)
    projected = kcu._project_kv_cache_groups_to_worker(groups, {"a": full()})
    assert [g.layer_names for g in projected] == [["a"], []]
    assert projected[1].is_eagle_group  # v0.33: the global flag survives on an empty group
    assert not kv_config.has_mamba_layers and not kv_config.needs_kv_cache_zeroing


def test_model_grouping_and_builder_probe() -> None:
    """v0.33's builder surface: a model that groups its own layers is asked (not with
    HiSparse); a custom placement's bytes per block come from a one-block probe, which must
    have one device backing; bad groupings are ValueError and AssertionError."""
    from types import SimpleNamespace

    from vllm.v1.core import kv_cache_planning as kcp
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = full()
    own = [KVCacheGroupSpec(["a"], spec)]
    model_cls = SimpleNamespace(get_kv_cache_groups=lambda config, specs: own)
    registry = SimpleNamespace(resolve_model_cls=lambda archs, model_config: (model_cls, "x"))
    config = SimpleNamespace(
        model_config=SimpleNamespace(
            supports_kv_cache_grouping=True, registry=registry, architectures=["X"]
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
    )
    builder = kcp.DefaultKVCacheConfigBuilder()
    assert builder.get_kv_cache_groups(config, {"a": spec}) is own
    with pytest.raises(AssertionError, match=r"miss layers \['b'\]"):
        kcp.get_kv_cache_groups_from_builder(builder, config, {"a": spec, "b": spec})
    config.attention_config.hisparse_config = object()
    with pytest.raises(ValueError, match="expected no HiSparse"):
        builder.get_kv_cache_groups(config, {"a": spec})

    class PerGroupBackings(kcp.DefaultKVCacheConfigBuilder):
        def get_kv_cache_config_from_groups(self, vllm_config, groups, num_blocks):
            tensors = [
                KVCacheTensor(size=p * num_blocks, layers=g.layer_names, block_stride=p)
                for g, p in zip(groups, (64, 32), strict=True)
            ]
            return KVCacheConfig(num_blocks, tensors, groups)

    vllm_config = VllmConfig(model_config=ModelConfig(max_model_len=64))
    groups = [KVCacheGroupSpec(["a"], spec), KVCacheGroupSpec(["b"], spec)]
    with pytest.raises(ValueError, match="expected one device backing for a block"):
        kcp._pool_bytes_per_block_from_builder(PerGroupBackings(), vllm_config, groups)
