"""copy_kv_cache_blocks_inplace: the block manager's copy-on-write copies run on every cache,
kernel blocks folded into scheduler blocks, shared views once, bad ids refused first."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace


def _cache(num_kernel_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # An NVFP4-style page of raw bytes: [kernel blocks, K/V, tokens, heads, bytes].
    return torch.randint(0, 256, (num_kernel_blocks, 2, 4, 2, 9), generator=gen).to(torch.uint8)


def test_copies_whole_pages_of_every_cache() -> None:
    num_blocks = 4
    plain, split = _cache(num_blocks, 1), _cache(2 * num_blocks, 2)  # split: 2 kernel blocks
    before = [plain.clone(), split.clone()]
    copies = [KVCacheBlockCopy(0, 3), KVCacheBlockCopy(2, 1)]
    copy_kv_cache_blocks_inplace([plain, split], num_blocks, copies)
    for cache, old in zip([plain, split], before, strict=True):
        per = cache.shape[0] // num_blocks
        expected = old.unflatten(0, (num_blocks, per)).clone()
        expected[3], expected[1] = expected[0].clone(), expected[2].clone()
        assert torch.equal(cache.unflatten(0, (num_blocks, per)), expected)


def test_shared_view_is_copied_once() -> None:
    """A chain 0 -> 1 -> 2 reads the old pages; running it twice on a view two layers share
    would carry page 0 into page 2."""
    cache = _cache(3, 3)
    old = cache.clone()
    copy_kv_cache_blocks_inplace(
        [cache, cache], 3, [KVCacheBlockCopy(0, 1), KVCacheBlockCopy(1, 2)]
    )
    assert torch.equal(cache[1], old[0]) and torch.equal(cache[2], old[1])


@pytest.mark.parametrize(
    "copies,num_blocks,message",
    [
        (
            [KVCacheBlockCopy(0, 4)],
            4,
            r"copies\[0\]: expected two different .* 0 -> 4",
        ),
        ([KVCacheBlockCopy(1, 1)], 4, r"got 1 -> 1"),
        ([KVCacheBlockCopy(-1, 2)], 4, r"got -1 -> 2"),
        ([KVCacheBlockCopy(0, 1)], 3, r"kv_caches\[0\]: expected a first dimension .*num_blocks=3"),
        ([KVCacheBlockCopy(0, 1)], 0, r"num_blocks"),
    ],
)
def test_bad_copies_write_nothing(copies, num_blocks: int, message: str) -> None:
    cache = _cache(4, 4)
    before = cache.clone()
    with pytest.raises(ValueError, match=message):
        copy_kv_cache_blocks_inplace([cache], num_blocks, copies)
    assert torch.equal(cache, before)


def test_no_copies_is_a_no_op() -> None:
    copy_kv_cache_blocks_inplace([torch.empty(0)], 0, [])
