"""OffloadingSpec block-size alignment and the CPU spec's block budget."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from vllm.config.cache import CacheConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.spec import OffloadingSpec

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


class _Spec(OffloadingSpec):
    def get_handlers(self, kv_caches, kv_cache_config=None) -> Iterator:  # type: ignore[override]
        yield from ()


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
        f"gpu_block_size={gpu_block_size} not divisible by hash_block_size={hash_block_size}. "
        "Hybrid models (e.g. Mamba+Attention) need --enable-prefix-caching to align block sizes."
    )


@pytest.mark.parametrize(
    ("group_block_sizes", "block_size", "cp_size", "bad", "hash_block_size"),
    [
        ((24,), 16, 1, 24, 16),
        ((16,), 16, 2, 16, 32),
        # Mamba without prefix caching: its block size is max_model_len.
        ((16, 4099), 16, 1, 4099, 16),
    ],
)
def test_alignment_check_message(
    group_block_sizes: tuple[int, ...],
    block_size: int,
    cp_size: int,
    bad: int,
    hash_block_size: int,
) -> None:
    groups = [attn(group_block_sizes[0])] + [mamba(b) for b in group_block_sizes[1:]]
    config = config_of(*groups, shared=False)
    with pytest.raises(ValueError, match=re.escape(alignment_message(bad, hash_block_size))):
        _Spec(config, block_size, cp_size=cp_size)


def test_hash_block_size_and_aligned_hybrid() -> None:
    config = config_of(attn(64), mamba(64, padded=attn(64).page_size_bytes))
    spec = _Spec(config, block_size=16, cp_size=2)
    assert spec.hash_block_size == 32
    assert spec.gpu_block_size == (64, 64)
    assert spec.offloaded_block_size == 64
    assert spec.block_size_factor == 1
    spec = _Spec.from_cache_config(CacheConfig(block_size=32), config)
    assert spec.hash_block_size == 32


def test_offloaded_block_size_options() -> None:
    config = config_of(attn(16))
    assert _Spec(config, 16, {"block_size": 64}).block_size_factor == 4
    assert _Spec(config, 16, {"block_size_factor": 3}).offloaded_block_size == 48
    assert _Spec(config, 16, {"block_size": 32, "block_size_factor": 2}).block_size_factor == 2
    with pytest.raises(ValueError, match="disagrees with block_size_factor=4"):
        _Spec(config, 16, {"block_size": 32, "block_size_factor": 4})
    with pytest.raises(ValueError, match=r"\(40 tokens\) must be a multiple of every GPU block"):
        _Spec(config, 16, {"block_size": 40})
    with pytest.raises(ValueError, match="block_size_factor'\\]: expected a positive int"):
        _Spec(config, 16, {"block_size_factor": 0})
    # Mixed GPU block sizes: an offloaded block mirrors one GPU block id (factor 1).
    mixed = config_of(attn(16), attn(32, head_size=32), shared=False)
    spec = _Spec(mixed, 16)
    assert spec.gpu_block_size == (16, 32)
    assert spec.offloaded_block_size == 32 and spec.block_size_factor == 1
    assert _Spec(mixed, 16, {"block_size_factor": 1}).block_size_factor == 1
    assert _Spec(mixed, 16, {"block_size": 32}).block_size_factor == 1
    for extra in ({"block_size": 64}, {"block_size_factor": 2}):
        with pytest.raises(ValueError, match=r"block_size_factor > 1, which is only supported"):
            _Spec(mixed, 16, extra)


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
    spec = CPUOffloadingSpec(config, 16, {"block_size": 32, "cpu_bytes_to_use": 10 * per_block - 1})
    assert spec.bytes_per_offloaded_block == per_block
    assert spec.num_blocks == 9
    assert CPUOffloadingSpec(config, 16, {"num_cpu_blocks": 3}).num_blocks == 3
    # Shared buffers (Mamba + attention, padded pages) count once.
    hybrid = config_of(attn(16), mamba(16, padded=attn(16).page_size_bytes))
    assert CPUOffloadingSpec(hybrid, 16, {"cpu_bytes_to_use": 8192 * 5}).num_blocks == 5
    with pytest.raises(ValueError, match="hold no offloaded block of 49152 bytes"):
        CPUOffloadingSpec(config, 16, {"block_size": 32, "cpu_bytes_to_use": 1000})
    with pytest.raises(ValueError, match="exactly one of 'cpu_bytes_to_use'"):
        CPUOffloadingSpec(config, 16, {})
    with pytest.raises(ValueError, match=r"num_cpu_blocks'\]: expected a positive int"):
        CPUOffloadingSpec(config, 16, {"num_cpu_blocks": 0})
