"""v0.33 planning rules that upstream's tests do not pin: block sizes under DCP and
``prefix_match_unit``, the one tensor builder's HiSparse pages, bounded-replay windows,
draft-group flags, the constructible base spec and ``DeviceConfig``."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
from vllm.v1.hisparse.layout import _build_hisparse_kv_cache_tensors
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiSparseHotSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)


def _full(block_size: int = 16, **kw) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16, **kw
    )


def _swa_mla(bounded_replay: bool) -> SlidingWindowMLASpec:
    return SlidingWindowMLASpec(
        block_size=32,
        num_kv_heads=1,
        head_size=64,
        dtype=torch.uint8,
        sliding_window=64,
        bounded_replay=bounded_replay,
    )


def _vllm_config(*, dcp: int = 1, pcp: int = 1, prefix_match_unit: int | None = None):
    cache = CacheConfig(block_size=16)
    cache.prefix_match_unit = prefix_match_unit  # type: ignore[attr-defined]
    return VllmConfig(
        model_config=ModelConfig(max_model_len=256),
        cache_config=cache,
        parallel_config=ParallelConfig(
            decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp
        ),
    )


def _kv_config(*specs: KVCacheSpec) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=groups)


def test_one_group_scales_by_dcp_only_when_sharded_and_never_by_pcp() -> None:
    sharded = _kv_config(_full())
    replicated = _kv_config(_full(dcp_sharded=False))
    assert kcu.resolve_kv_cache_block_sizes(sharded, _vllm_config(dcp=2)) == (32, 32)
    assert kcu.resolve_kv_cache_block_sizes(replicated, _vllm_config(dcp=2)) == (16, 16)
    assert kcu.resolve_kv_cache_block_sizes(sharded, _vllm_config(pcp=2)) == (16, 16)


def test_one_group_rejects_another_prefix_match_unit() -> None:
    config = _kv_config(_full())
    assert kcu.resolve_kv_cache_block_sizes(config, _vllm_config(prefix_match_unit=16)) == (
        16,
        16,
    )
    with pytest.raises(ValueError, match="prefix_match_unit: expected None or the block size 16"):
        kcu.resolve_kv_cache_block_sizes(config, _vllm_config(prefix_match_unit=8))


def test_several_groups_hash_over_prefix_cacheable_groups_only() -> None:
    config = _kv_config(_full(block_size=64), _swa_mla(bounded_replay=True))
    # The 32-token bounded-replay window never hashes: the gcd is the 64-token group's.
    assert kcu.resolve_kv_cache_block_sizes(config, _vllm_config()) == (64, 64)
    with pytest.raises(ValueError, match="prefix_match_unit: expected a divisor"):
        kcu.resolve_kv_cache_block_sizes(config, _vllm_config(prefix_match_unit=48))


def test_hits_must_land_on_whole_compressed_states() -> None:
    compressed = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
    mla = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=16, dtype=torch.uint8, tokens_per_state=8
    )
    config = _kv_config(compressed, mla, _full(block_size=32))
    assert kcu.resolve_kv_cache_block_sizes(config, _vllm_config()) == (32, 16)
    mamba = MambaSpec(
        block_size=32, shapes=((4,),), dtypes=(torch.float16,), mamba_cache_mode="align"
    )
    # A Mamba page past the hash block lets hits land every hash block: 4 tokens split
    # the 8-token compressed states.
    partial = _kv_config(mla, mamba)
    with pytest.raises(ValueError, match="per-state compression"):
        kcu.resolve_kv_cache_block_sizes(partial, _vllm_config(prefix_match_unit=4))


def test_partial_hash_hits_look_inside_packed_groups() -> None:
    mamba = MambaSpec(
        block_size=64, shapes=((4,),), dtypes=(torch.float16,), mamba_cache_mode="align"
    )
    packed = UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs={"m0": mamba, "m1": mamba})
    groups = [KVCacheGroupSpec(["m0", "m1"], packed), KVCacheGroupSpec(["a"], _full())]
    assert kcu.partial_hash_hits_enabled(groups, 16)
    assert not kcu.partial_hash_hits_enabled(groups, 64)


def test_hisparse_pages_need_a_block_outermost_layout() -> None:
    hot = HiSparseHotSpec(block_size=16, page_size=512, blocks_per_request=2)
    groups = [KVCacheGroupSpec(["hot"], hot)]
    tensors = _build_hisparse_kv_cache_tensors(groups, 3, 3 * 1024, KVCacheLayout.BLHNC, 1024)
    assert [(t.layer_stride, t.block_stride, t.size) for t in tensors] == [(512, 1024, 3072)]
    host = _build_hisparse_kv_cache_tensors(
        [KVCacheGroupSpec(["a"], _full())], 3, 3 * 64, KVCacheLayout.LBNHC, 64, host_resident=True
    )
    assert host[0].host_resident
    with pytest.raises(ValueError, match="HiSparse pages need a block-outermost layout"):
        _build_hisparse_kv_cache_tensors(groups, 3, 3 * 1024, KVCacheLayout.LBNHC, 1024)


def test_bounded_replay_is_part_of_the_uniform_type() -> None:
    bounded, cached = _swa_mla(True), _swa_mla(False)
    assert (bounded.prefix_cacheable, bounded.prefix_replay_tokens) == (False, 64)
    assert (cached.prefix_cacheable, cached.prefix_replay_tokens) == (True, 0)
    assert not UniformTypeKVCacheSpecs.is_uniform_type({"a": bounded, "b": cached})


def test_draft_groups_flagged_and_untagged_drafts_warned(caplog) -> None:
    config = VllmConfig(model_config=ModelConfig(max_model_len=64))
    config.speculative_config = SpeculativeConfig(method="eagle", num_speculative_tokens=1)
    specs = {"a": _full(), "draft": _full(is_draft=True)}
    groups = get_global_kv_cache_groups(config, [specs])
    assert [g.is_eagle_group for g in groups] == [True]
    mamba = MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float16,))
    with caplog.at_level(logging.WARNING):
        groups = get_global_kv_cache_groups(config, [{"a": _full(), "m": mamba}])
    assert not any(g.is_eagle_group for g in groups)
    assert "could be identified as the draft model's" in caplog.text


def test_bare_spec_compares_but_has_no_page() -> None:
    assert KVCacheSpec(block_size=1) != KVCacheSpec(block_size=2)
    with pytest.raises(TypeError, match="page_size_bytes: expected a concrete KV cache spec"):
        _ = KVCacheSpec(block_size=1).page_size_bytes


def test_device_config() -> None:
    assert DeviceConfig(device="cpu").device == torch.device("cpu")
    assert DeviceConfig(device=torch.device("cpu")).device_type == "cpu"
    assert DeviceConfig().device_type in ("cpu", "cuda")
    with pytest.raises(TypeError, match="device: expected 'auto'"):
        DeviceConfig(device="")
