"""Upstream v0.33's ``block_stride_alignment`` (bytes the spacing of a layer's blocks must be a
multiple of, or whole kernel blocks via ``MultipleOf``): checked at construction, kept by
merges, honoured by the strided planner under both layout families and by the worker."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vllm.config import ModelConfig, VllmConfig
from vllm.v1.attention.backends import ReferenceAttentionBackend
from vllm.v1.attention.backends.abstract import MultipleOf
from vllm.v1.core import kv_cache_planning
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheLayout,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_spec_base import KVCacheSpecMergeError
from vllm.v1.kv_cache_views import kv_cache_bytes_per_block
from vllm.v1.worker.gpu.attn_utils import init_layer_kv_caches

MEMORY = 1 << 20


def _spec(**kw) -> FullAttentionSpec:
    args = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    return FullAttentionSpec(**{**args, **kw})


def _config(layout: str) -> VllmConfig:
    config = VllmConfig(model_config=ModelConfig(max_model_len=256))
    config.cache_config.kv_cache_layout = layout
    return config


@pytest.mark.parametrize("bad", [0, -512, True, MultipleOf(0), "512"])
def test_alignment_must_be_positive(bad: object) -> None:
    with pytest.raises(ValueError, match="block_stride_alignment: .*must be positive"):
        _spec(block_stride_alignment=bad)


def test_merge_keeps_the_alignment_and_refuses_another() -> None:
    aligned = _spec(block_stride_alignment=512)
    assert FullAttentionSpec.merge([aligned, aligned]).block_stride_alignment == 512
    with pytest.raises(KVCacheSpecMergeError):
        FullAttentionSpec.merge([aligned, _spec()])


def test_kernel_block_alignment_is_one_kernel_page() -> None:
    page = _spec().page_size_bytes
    assert _spec().get_block_stride_alignment() == 1
    assert _spec(block_stride_alignment=640).get_block_stride_alignment() == 640
    assert _spec(block_stride_alignment=MultipleOf(16)).get_block_stride_alignment() == 1
    assert _spec(block_stride_alignment=MultipleOf(8)).get_block_stride_alignment() == page // 2


def test_block_outermost_block_rounds_up_to_every_alignment() -> None:
    page = _spec().page_size_bytes  # 16 x 2 x 2 x 64 x 4 = 16384
    groups = [KVCacheGroupSpec(["a"], _spec(block_stride_alignment=3 * 4096))]
    assert kv_cache_bytes_per_block(groups, KVCacheLayout.BLHNC) == 3 * 4096 * 2
    assert kv_cache_bytes_per_block([KVCacheGroupSpec(["a"], _spec())]) == page


def test_layer_outermost_pads_only_the_unaligned_page() -> None:
    plain = _spec()
    aligned = replace(_spec(head_size=32), block_stride_alignment=12288)  # page 8192 -> 12288
    specs = {"plain": plain, "aligned": aligned}
    groups = [
        KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs))
    ]
    config = _config("LBNHC")
    kv = kv_cache_planning.get_kv_cache_config_from_groups(config, groups, MEMORY)
    assert kv.num_blocks == MEMORY // (plain.page_size_bytes + 12288)
    plain_tensor, aligned_tensor = kv.kv_cache_tensors
    assert (plain_tensor.block_stride, aligned_tensor.block_stride) == (
        plain.page_size_bytes,
        12288,
    )
    assert aligned_tensor.offset == plain.page_size_bytes * kv.num_blocks
    views = init_layer_kv_caches(kv, [ReferenceAttentionBackend], "cpu", model_dtype=torch.float32)
    assert views["aligned"].stride(0) * 4 == 12288
    assert views["aligned"].data_ptr() - views["plain"].data_ptr() == aligned_tensor.offset


def test_head_outermost_layout_cannot_pad_pages() -> None:
    aligned = _spec(block_stride_alignment=3 * 4096)
    groups = [KVCacheGroupSpec(["a"], aligned)]
    with pytest.raises(ValueError, match="kv_cache_layout: LHBNC cannot pad the pages of 'a'"):
        kv_cache_planning.get_kv_cache_config_from_groups(_config("LHBNC"), groups, MEMORY)
