"""A config of 0 pages (a profiling run's) allocates empty views instead of dividing by zero,
with and without kernel blocks."""

import pytest
import torch

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
)
from vllm.v1.worker.utils import allocate_kv_cache


@pytest.mark.parametrize(("num_blocks", "kernel_block_size"), [(0, None), (0, 8), (3, 8)])
def test_views_for_zero_and_some_pages(num_blocks: int, kernel_block_size: int | None) -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(num_blocks * spec.page_size_bytes, ["layer.0"])],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    sizes = [kernel_block_size] if kernel_block_size else None
    cache = allocate_kv_cache(config, "cpu", list(KVCacheLayout)[0], sizes)["layer.0"]
    tokens = kernel_block_size or 16
    assert tuple(cache.shape[:3]) == (num_blocks * 16 // tokens, 2, tokens)
