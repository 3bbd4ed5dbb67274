"""The worker honours upstream v0.33's strided ``KVCacheTensor`` (layer ``l``'s page of block
``b`` at ``offset + l * layer_stride + b * block_stride`` in one backing shared by every device
tensor; host-resident tensors in a host backing): ``init_layer_kv_caches`` (backend-shaped
views) and ``allocate_kv_cache`` (upstream's ``[B, H, N, C]`` views), with the checks before
allocating."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.attention.backends import ReferenceAttentionBackend
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.worker.gpu.attn_utils import _reshape_kv_cache, init_layer_kv_caches
from vllm.v1.worker.gpu.kv_cache_buffers import _allocate_kv_cache, allocate_tensor_backings
from vllm.v1.worker.utils import allocate_kv_cache

SPEC = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)
PAGE = SPEC.page_size_bytes  # 4 tokens x 2 (K, V) x 2 heads x 8 x 4 bytes = 512
NUM_BLOCKS = 3


def _config(tensors: list[KVCacheTensor], groups: list[list[str]], **kw) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(names, SPEC) for names in groups],
        **kw,
    )


def _block_outer_config(offset: int = 0) -> KVCacheConfig:
    # Two layers side by side in each block of 2 pages (+ offset slack at the end).
    block = 2 * PAGE + offset
    tensor = KVCacheTensor(
        size=block * NUM_BLOCKS,
        layers=["a", "b"],
        layer_stride=PAGE,
        block_stride=block,
        offset=offset,
    )
    return _config([tensor], [["a", "b"]])


@pytest.mark.parametrize("offset", [0, 256])
def test_layers_share_one_tensor_at_layer_and_block_stride(offset: int) -> None:
    config = _block_outer_config(offset)
    raw = _allocate_kv_cache(config, "cpu")
    assert raw["a"].untyped_storage().data_ptr() == raw["b"].untyped_storage().data_ptr()
    views = _reshape_kv_cache(config, raw, [ReferenceAttentionBackend])
    base = raw["a"].untyped_storage().data_ptr()
    for position, name in enumerate(("a", "b")):
        view = views[name]
        assert isinstance(view, torch.Tensor)
        assert tuple(view.shape) == (NUM_BLOCKS, 2, 4, 2, 8)
        for block in range(NUM_BLOCKS):
            expected = offset + position * PAGE + block * (2 * PAGE + offset)
            assert view[block].data_ptr() - base == expected


def test_pages_of_neighbouring_layers_stay_apart() -> None:
    config = _block_outer_config()
    views = init_layer_kv_caches(
        config, [ReferenceAttentionBackend], "cpu", model_dtype=torch.float32
    )
    views["a"].fill_(1.0)
    views["b"].fill_(2.0)
    assert bool((views["a"] == 1.0).all()) and bool((views["b"] == 2.0).all())


def test_groups_overlay_one_backing() -> None:
    size = PAGE * NUM_BLOCKS
    tensors = [
        KVCacheTensor(size=size, layers=[name], layer_stride=0, block_stride=PAGE)
        for name in ("g0", "g1")
    ]
    config = _config(tensors, [["g0"], ["g1"]])
    views = init_layer_kv_caches(config, [ReferenceAttentionBackend] * 2, "cpu")
    assert views["g0"].data_ptr() == views["g1"].data_ptr()  # block ids are one group's at a time


def test_host_resident_tensor_takes_the_host_pool() -> None:
    host_blocks = 5
    device = KVCacheTensor(size=PAGE * NUM_BLOCKS, layers=["d"], block_stride=PAGE)
    host = KVCacheTensor(
        size=PAGE * host_blocks, layers=["h"], block_stride=PAGE, host_resident=True
    )
    config = _config([device, host], [["d"], ["h"]], hisparse_host_num_blocks=host_blocks)
    config.kv_cache_groups[1].host_resident = True
    backings = allocate_tensor_backings(config, "meta")
    assert backings[0].device.type == "meta" and backings[1].numel() == PAGE * host_blocks
    views = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    assert views["h"].shape[0] == host_blocks and views["d"].shape[0] == NUM_BLOCKS
    assert views["h"].device.type == "cpu"


def test_allocate_kv_cache_views_follow_the_layout() -> None:
    config = _block_outer_config()
    views = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.BLHNC)
    head_bytes = 4 * 2 * 8 * 4  # N x C: 4 tokens x (K, V) x 8 x 4 bytes per head
    assert tuple(views["a"].shape) == (NUM_BLOCKS, 2, 4, 2 * 8 * 4 // 4)
    base = views["a"].data_ptr()
    assert views["b"].data_ptr() - base == PAGE
    assert views["a"][1].data_ptr() - base == 2 * PAGE
    assert views["a"][0, 1].data_ptr() - base == head_bytes


def test_v022_aliasing_tensor_still_shared_whole() -> None:
    tensor = KVCacheTensor(size=PAGE * NUM_BLOCKS, shared_by=["x", "y"])
    config = _config([tensor], [["x"], ["y"]])
    views = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    assert views["x"].data_ptr() == views["y"].data_ptr()
    assert views["x"].shape[0] == NUM_BLOCKS


def test_mamba_layer_uses_the_block_stride() -> None:
    spec = MambaSpec(block_size=4, shapes=((2, 4),), dtypes=(torch.float32,))
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=2 * page * NUM_BLOCKS, layers=["m"], block_stride=2 * page, offset=page
    )
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(["m"], spec)],
    )
    raw = _allocate_kv_cache(config, "cpu")
    (state,) = _reshape_kv_cache(config, raw, {})["m"]
    assert state.stride(0) * 4 == 2 * page
    assert state[2].data_ptr() - raw["m"].data_ptr() == 4 * page


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (
            KVCacheTensor(
                size=PAGE * NUM_BLOCKS, layers=["a", "b"], layer_stride=8, block_stride=2 * PAGE
            ),
            r"kv_cache_tensors\[0\].layer_stride: expected at least the 512-byte page",
        ),
        (
            KVCacheTensor(
                size=PAGE * NUM_BLOCKS, layers=["a", "b"], layer_stride=PAGE, block_stride=PAGE
            ),
            r"kv_cache_tensors\[0\]: expected layer 'b'.s 3 pages .* inside the 1536-byte backing",
        ),
        (
            KVCacheTensor(
                size=4 * PAGE * NUM_BLOCKS,
                layers=["a", "b"],
                layer_stride=PAGE,
                block_stride=PAGE // 2,
            ),
            r"kv_cache_tensors\[0\].block_stride: expected at least the 512-byte page",
        ),
        (
            KVCacheTensor(
                size=2 * PAGE * NUM_BLOCKS, layers=["a", "b"], layer_stride=PAGE, block_stride=0
            ),
            r"kv_cache_tensors\[0\].block_stride: expected a positive int",
        ),
        (
            KVCacheTensor(
                size=2 * PAGE * NUM_BLOCKS,
                layers=["a", "b"],
                layer_stride=PAGE,
                block_stride=2 * PAGE,
                offset=-1,
            ),
            r"kv_cache_tensors\[0\].offset: expected a non-negative int",
        ),
    ],
)
def test_bad_strides_are_refused_before_allocation(tensor: KVCacheTensor, match: str) -> None:
    config = _config([tensor], [["a", "b"]])
    with pytest.raises(ValueError, match=match):
        allocate_tensor_backings(config, "meta")


def test_device_tensors_must_share_one_backing_size() -> None:
    tensors = [
        KVCacheTensor(size=PAGE * NUM_BLOCKS, layers=["a"], block_stride=PAGE),
        KVCacheTensor(size=2 * PAGE * NUM_BLOCKS, layers=["b"], block_stride=PAGE),
    ]
    with pytest.raises(ValueError, match=r"strided device tensors to share one backing size"):
        _allocate_kv_cache(_config(tensors, [["a"], ["b"]]), "meta")


def test_spaced_pages_cannot_be_split_into_kernel_blocks() -> None:
    config = _block_outer_config()
    with pytest.raises(ValueError, match="cannot be split into 2 kernel blocks"):
        init_layer_kv_caches(config, [ReferenceAttentionBackend], "cpu", kernel_block_sizes=[2])
