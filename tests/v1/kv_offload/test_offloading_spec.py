"""OffloadingSpec block-size alignment and the CPU spec's block budget."""

from __future__ import annotations

import re

import pytest
import torch
from tiering_test_utils import StubSpec as _Spec

from vllm.config import CacheConfig, ParallelConfig, VllmConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


def vllm_config(
    extra: dict | None = None, block_size: int = 16, dcp: int = 1, world: int = 1, **cache
) -> VllmConfig:
    """An engine config as upstream's builds it for an offloading connector."""
    return VllmConfig(
        cache_config=CacheConfig(block_size=block_size, **cache),
        parallel_config=ParallelConfig(
            decode_context_parallel_size=dcp, tensor_parallel_size=world
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=dict(extra or {}),
        ),
    )


def attn(block_size: int = 16, head_size: int = 64) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=head_size, dtype=torch.bfloat16
    )


def mamba(block_size: int, padded: int | None = None) -> MambaSpec:
    return MambaSpec(
        block_size=block_size,
        shapes=((3, 64), (4, 16, 8)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=padded,
    )


def config_of(*groups: KVCacheSpec, num_blocks: int = 8, shared: bool = True) -> KVCacheConfig:
    """One layer per group; with ``shared`` all layers share one buffer (equal pages needed)."""
    names = [f"layers.{i}" for i in range(len(groups))]
    pages = [g.page_size_bytes for g in groups]
    if shared:
        tensors = [KVCacheTensor(size=num_blocks * max(pages), shared_by=names)]
    else:
        tensors = [
            KVCacheTensor(size=num_blocks * p, shared_by=[n])
            for n, p in zip(names, pages, strict=True)
        ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec([n], g) for n, g in zip(names, groups, strict=True)],
    )


def alignment_message(gpu_block_size: int, hash_block_size: int) -> str:
    return (
        f"tokens_per_block={gpu_block_size} not divisible by tokens_per_hash={hash_block_size}. "
        "Hybrid models (e.g. Mamba+Attention) need --enable-prefix-caching to align block sizes."
    )


@pytest.mark.parametrize(
    ("groups", "dcp", "bad", "hash_block_size"),
    [
        ((attn(24),), 1, 24, 16),
        # A Mamba group whose block size is not the engine's (no prefix caching: it is
        # max_model_len): requests are hashed per lcm of the group block sizes.
        ((attn(16), mamba(4099)), 1, 16, 16 * 4099),
    ],
)
def test_alignment_check_message(
    groups: tuple[KVCacheSpec, ...], dcp: int, bad: int, hash_block_size: int
) -> None:
    config = config_of(*groups, shared=False)
    with pytest.raises(ValueError, match=re.escape(alignment_message(bad, hash_block_size))):
        _Spec(vllm_config(dcp=dcp), config)


def test_block_sizes_with_context_parallelism_and_hybrid_groups() -> None:
    single = config_of(attn(16))
    spec = _Spec(vllm_config(dcp=2), single)
    assert spec.gpu_block_size == (32,) and spec.hash_block_size == 32
    config = config_of(attn(64), mamba(64, padded=attn(64).page_size_bytes))
    spec = _Spec(vllm_config(block_size=64), config)
    assert spec.hash_block_size == 64
    assert spec.gpu_block_size == (64, 64)
    assert spec.offloaded_block_size == 64 and spec.block_size_factor == 1
    assert spec.extra_config == {}
    with pytest.raises(ValueError, match="kv_transfer_config"):
        _Spec(VllmConfig(), config)


def test_offloaded_block_size_options() -> None:
    config = config_of(attn(16))
    assert _Spec(vllm_config({"block_size": 64}), config).block_size_factor == 4
    assert _Spec(vllm_config({"block_size_factor": 3}), config).offloaded_block_size == 48
    spec = _Spec(vllm_config({"blocks_per_chunk": 2}), config)
    assert spec.blocks_per_chunk == 2 and spec.config.cache.blocks_per_chunk == 2
    both = {"block_size": 32, "block_size_factor": 2}
    with pytest.raises(ValueError, match="expected at most one of"):
        _Spec(vllm_config(both), config)
    with pytest.raises(ValueError, match="multiple of the GPU block size 16 tokens, got 40"):
        _Spec(vllm_config({"block_size": 40}), config)
    with pytest.raises(ValueError, match="block_size_factor'\\]: expected a positive int"):
        _Spec(vllm_config({"block_size_factor": 0}), config)
    # Mixed GPU block sizes: a chunk is GPU block ids (factor 1 by default); a chunk size in
    # tokens cannot be asked for, a factor can.
    mixed = config_of(attn(16), attn(32, head_size=32), shared=False)
    spec = _Spec(vllm_config(), mixed)
    assert spec.gpu_block_size == (16, 32) and spec.hash_block_size == 16
    assert spec.offloaded_block_size == 32 and spec.block_size_factor == 1
    assert _Spec(vllm_config({"blocks_per_chunk": 2}), mixed).offloaded_block_size == 64
    with pytest.raises(ValueError, match="one block size for all KV-cache groups"):
        _Spec(vllm_config({"block_size": 32}), mixed)


def test_cpu_spec_num_blocks_from_byte_budget() -> None:
    # UniformTypeKVCacheSpecs: page sizes 8192 and 16384, one buffer each.
    specs: dict[str, KVCacheSpec] = {"a": attn(16, 64), "b": attn(16, 128)}
    group = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=dict(specs))
    config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[
            KVCacheTensor(size=4 * s.page_size_bytes, shared_by=[n]) for n, s in specs.items()
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(specs), group)],
    )
    per_block = 2 * (8192 + 16384)
    budget = {"block_size": 32, "cpu_bytes_to_use": 10 * per_block - 1}
    spec = CPUOffloadingSpec(vllm_config(budget), config)
    assert spec.cpu_page_size_per_worker == per_block
    assert spec.num_blocks == 9
    # The byte budget is the engine's: two workers get half the blocks each.
    assert CPUOffloadingSpec(vllm_config(budget, world=2), config).num_blocks == 4
    assert CPUOffloadingSpec(vllm_config({"num_cpu_blocks": 3}), config).num_blocks == 3
    # Shared buffers (Mamba + attention, padded pages) count once.
    hybrid = config_of(attn(16), mamba(16, padded=attn(16).page_size_bytes))
    assert CPUOffloadingSpec(vllm_config({"cpu_bytes_to_use": 8192 * 5}), hybrid).num_blocks == 5
    # v0.33: a budget below one chunk gives an empty tier, not an error.
    small = CPUOffloadingSpec(vllm_config({"block_size": 32, "cpu_bytes_to_use": 1000}), config)
    assert small.num_chunks == 0 and small.kv_bytes_per_chunk == per_block
    with pytest.raises(ValueError, match="cpu_bytes_to_use must be specified"):
        CPUOffloadingSpec(vllm_config(), config)
    with pytest.raises(ValueError, match="expected one of 'cpu_bytes_to_use' and"):
        CPUOffloadingSpec(vllm_config({"num_cpu_blocks": 3, "cpu_bytes_to_use": 10}), config)
    with pytest.raises(ValueError, match=r"num_cpu_blocks'\]: expected a positive int"):
        CPUOffloadingSpec(vllm_config({"num_cpu_blocks": 0}), config)


def test_cpu_spec_manager_from_options() -> None:
    extra = {"num_cpu_blocks": 4, "eviction_policy": "arc", "store_threshold": 2}
    config = VllmConfig(
        cache_config=CacheConfig(block_size=16),
        kv_transfer_config=KVTransferConfig(kv_connector_extra_config=extra),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True),
    )
    spec = CPUOffloadingSpec(config, config_of(attn(16)))
    manager = spec.get_manager()
    assert manager is spec.get_manager()
    assert isinstance(manager, CPUOffloadingManager)
    assert isinstance(manager._policy, ARCCachePolicy)
    assert manager.events == [] and manager.store_threshold == 2
    default = CPUOffloadingSpec(vllm_config({"num_cpu_blocks": 4}), config_of(attn(16)))
    manager = default.get_manager()
    assert isinstance(manager, CPUOffloadingManager)
    assert manager.events is None and manager.counts is None
