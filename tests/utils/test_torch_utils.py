import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.kv_quant import dequantize_fp8
from vllm.utils.torch_utils import (
    MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP,
    STR_DTYPE_TO_TORCH_DTYPE,
    _nvfp4_split_data_scale,
    create_kv_caches_with_random,
    create_kv_caches_with_random_flash,
    get_dtype_size,
    get_kv_cache_torch_dtype,
    is_quantized_kv_cache,
    kv_cache_dtype_str_to_dtype,
    nvfp4_kv_cache_full_dim,
    nvfp4_kv_cache_split_views,
    set_random_seed,
)


def test_dtype_maps() -> None:
    assert STR_DTYPE_TO_TORCH_DTYPE["bfloat16"] is torch.bfloat16
    assert STR_DTYPE_TO_TORCH_DTYPE["half"] is torch.float16
    assert STR_DTYPE_TO_TORCH_DTYPE["float"] is torch.float32
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4"):
        assert STR_DTYPE_TO_TORCH_DTYPE[name] is torch.uint8
    assert MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP == {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}
    assert get_dtype_size(torch.bfloat16) == 2
    assert get_dtype_size(torch.uint8) == 1
    assert get_dtype_size(torch.float32) == 4


@pytest.mark.parametrize(
    ("name", "quantized"),
    [("auto", False), ("bfloat16", False), ("fp8", True), ("fp8_e5m2", True), ("nvfp4", True)],
)
def test_is_quantized_kv_cache(name: str, quantized: bool) -> None:
    assert is_quantized_kv_cache(name) is quantized


def test_kv_cache_dtype_str_to_dtype() -> None:
    assert kv_cache_dtype_str_to_dtype("auto", torch.float16) is torch.float16
    assert kv_cache_dtype_str_to_dtype("auto", "bfloat16") is torch.bfloat16
    assert kv_cache_dtype_str_to_dtype("nvfp4", torch.bfloat16) is torch.uint8
    assert kv_cache_dtype_str_to_dtype("float32", torch.bfloat16) is torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype: unknown KV-cache dtype 'int4'"):
        kv_cache_dtype_str_to_dtype("int4", torch.bfloat16)
    with pytest.raises(ValueError, match="model_dtype"):
        kv_cache_dtype_str_to_dtype("auto", "bf17")


@pytest.mark.parametrize(("head_size", "full_dim"), [(16, 9), (64, 36), (128, 72), (256, 144)])
def test_full_dim(head_size: int, full_dim: int) -> None:
    assert nvfp4_kv_cache_full_dim(head_size) == full_dim


@pytest.mark.parametrize("head_size", [0, 8, 46, 100, -16])
def test_full_dim_rejects_bad_head_size(head_size: int) -> None:
    with pytest.raises(ValueError, match=f"head_size: .*multiple of 16, got {head_size}"):
        nvfp4_kv_cache_full_dim(head_size)


def _cache(num_blocks: int, block_size: int, num_heads: int, head_size: int, hnd: bool):
    """A FlashInfer-shaped (B, 2, N, H, F) NVFP4 cache, physically NHD or HND."""
    full_dim = nvfp4_kv_cache_full_dim(head_size)
    if hnd:
        raw = torch.zeros(num_blocks, 2, num_heads, block_size, full_dim, dtype=torch.uint8)
        return raw.permute(0, 1, 3, 2, 4)
    return torch.zeros(num_blocks, 2, block_size, num_heads, full_dim, dtype=torch.uint8)


def test_split_views_worked_example_nhd() -> None:
    cache = _cache(4, 16, 8, 128, hnd=False)
    (k_data, v_data), (k_scale, v_scale) = nvfp4_kv_cache_split_views(cache)
    assert k_data.shape == (4, 16, 8, 64) and k_scale.shape == (4, 16, 8, 8)
    assert k_data.stride() == (18432, 512, 64, 1)
    assert k_scale.stride() == (18432, 64, 8, 1)
    assert k_data.storage_offset() == 0
    assert k_scale.storage_offset() == 8192
    assert v_data.storage_offset() == 9216
    assert v_scale.storage_offset() == 9216 + 8192
    assert k_scale.dtype == torch.float8_e4m3fn and k_data.dtype == torch.uint8


def test_split_views_worked_example_hnd() -> None:
    cache = _cache(4, 16, 8, 128, hnd=True)
    (k_data, _), (k_scale, _) = nvfp4_kv_cache_split_views(cache)
    assert k_data.stride() == (18432, 64, 1024, 1)
    assert k_scale.stride() == (18432, 8, 128, 1)
    assert k_scale.storage_offset() == 8192


def test_split_views_share_storage() -> None:
    cache = _cache(2, 16, 2, 32, hnd=False)
    (k_data, _), (_, v_scale) = nvfp4_kv_cache_split_views(cache)
    k_data[1, 3, 1, 5] = 0xAB
    v_scale.view(torch.uint8)[0, 2, 0, 1] = 0x38
    flat = cache.view(-1)
    page = 2 * 16 * 2 * 18
    assert flat[page + (3 * 2 + 1) * 16 + 5] == 0xAB
    assert flat[16 * 2 * 18 + 16 * 2 * 16 + (2 * 2 + 0) * 2 + 1] == 0x38


def test_split_views_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="last dim 70 is not a packed NVFP4 head dim"):
        _nvfp4_split_data_scale(torch.zeros(2, 16, 8, 70, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected dtype torch.uint8"):
        _nvfp4_split_data_scale(torch.zeros(2, 16, 8, 72, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="4-D side .* or a 5-D cache"):
        nvfp4_kv_cache_split_views(torch.zeros(2, 3, 16, 8, 72, dtype=torch.uint8))
    sparse = torch.zeros(2, 16, 16, 72, dtype=torch.uint8)[:, :, ::2]
    with pytest.raises(ValueError, match="one dense region"):
        _nvfp4_split_data_scale(sparse)


def _padded_cache(
    num_blocks: int, block_size: int, num_heads: int, head_size: int, hnd: bool, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B, 2, N, H, F) NVFP4 cache view whose pages are ``pad`` bytes apart beyond the dense
    page, over a raw byte buffer (returned too)."""
    full_dim = nvfp4_kv_cache_full_dim(head_size)
    page = 2 * block_size * num_heads * full_dim + pad
    raw = torch.zeros(num_blocks * page, dtype=torch.uint8)
    if hnd:
        strides = (page, block_size * num_heads * full_dim, full_dim, block_size * full_dim, 1)
    else:
        strides = (page, block_size * num_heads * full_dim, num_heads * full_dim, full_dim, 1)
    shape = (num_blocks, 2, block_size, num_heads, full_dim)
    return raw.as_strided(shape, strides), raw


@settings(max_examples=80, deadline=None)
@given(
    num_blocks=st.integers(1, 3),
    block_size=st.sampled_from([1, 2, 4, 8, 16, 32]),
    num_heads=st.integers(1, 6),
    head_size=st.sampled_from([16, 32, 48, 64, 80, 128, 256]),
    hnd=st.booleans(),
    pad=st.sampled_from([0, 7, 64, 576]),
    one_side=st.booleans(),
)
def test_split_views_tile_every_page(
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    hnd: bool,
    pad: int,
    one_side: bool,
) -> None:
    """Every byte of every page belongs to exactly one view element; padding and bytes outside
    the pages belong to none. Covers 5-D caches and single 4-D sides, NHD and HND, padded pages.
    """
    cache, raw = _padded_cache(num_blocks, block_size, num_heads, head_size, hnd, pad)
    if one_side:
        (data,), (scale,) = nvfp4_kv_cache_split_views(cache[:, 1])
        view_uint8 = [data, scale.view(torch.uint8)]
    else:
        (k_data, v_data), (k_scale, v_scale) = nvfp4_kv_cache_split_views(cache)
        view_uint8 = [k_data, v_data, k_scale.view(torch.uint8), v_scale.view(torch.uint8)]
    counts = torch.zeros(raw.numel(), dtype=torch.int64)
    for view in view_uint8:
        index = torch.zeros(view.shape, dtype=torch.int64)
        for dim, (size, stride) in enumerate(zip(view.shape, view.stride(), strict=True)):
            shape = [1] * view.dim()
            shape[dim] = size
            index = index + (torch.arange(size) * stride).view(shape)
        index = index + view.storage_offset()
        assert index.min() >= 0 and index.max() < raw.numel()
        counts.index_add_(0, index.flatten(), torch.ones(index.numel(), dtype=torch.int64))
    page = raw.numel() // num_blocks
    side_bytes = block_size * num_heads * nvfp4_kv_cache_full_dim(head_size)
    expected = torch.zeros(num_blocks, page, dtype=torch.int64)
    expected[:, (side_bytes if one_side else 0) : 2 * side_bytes] = 1
    assert torch.equal(counts, expected.flatten())


def test_get_kv_cache_torch_dtype_and_set_random_seed() -> None:
    assert get_kv_cache_torch_dtype("auto", "bfloat16") is torch.bfloat16
    assert get_kv_cache_torch_dtype("auto", torch.float16) is torch.float16
    assert get_kv_cache_torch_dtype("fp8_e5m2") is torch.uint8
    assert get_kv_cache_torch_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype: unknown KV-cache dtype 'int3'"):
        get_kv_cache_torch_dtype("int3")
    with pytest.raises(ValueError, match="cache_dtype: expected a kv_cache_dtype string"):
        get_kv_cache_torch_dtype(None)
    set_random_seed(7)
    first = (random.random(), np.random.rand(), torch.rand(1))
    set_random_seed(7)
    assert (random.random(), np.random.rand(), torch.rand(1)) == first


@pytest.mark.parametrize("kind", ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("layout", ["NHD", "HND", "NHC", "HNC"])
def test_create_kv_caches_with_random_flash(kind: str, layout: str) -> None:
    num_blocks, block_size, heads, head_size = 3, 16, 2, 64
    keys, values = create_kv_caches_with_random_flash(
        num_blocks, block_size, 2, heads, head_size, kind, torch.bfloat16, 0, "cpu", layout
    )
    assert len(keys) == len(values) == 2
    last = nvfp4_kv_cache_full_dim(head_size) if kind == "nvfp4" else head_size
    for k, v in zip(keys, values, strict=True):
        assert k.shape == v.shape == (num_blocks, block_size, heads, last)
        assert k.dtype == (torch.uint8 if is_quantized_kv_cache(kind) else torch.bfloat16)
        token_stride, head_stride = (
            (heads * last, last) if layout[0] == "N" else (last, block_size * last)
        )
        assert k.stride() == (2 * block_size * heads * last, token_stride, head_stride, 1)
        assert v.data_ptr() - k.data_ptr() == block_size * heads * last * k.element_size()
        if kind.startswith("fp8"):
            decoded = dequantize_fp8(k, torch.ones(1), kind)
            assert bool(decoded.isfinite().all()) and float(decoded.abs().max()) <= 0.14
        elif kind != "nvfp4":
            assert float(k.float().abs().max()) <= head_size**-0.5
    again, _ = create_kv_caches_with_random_flash(
        num_blocks, block_size, 2, heads, head_size, kind, torch.bfloat16, 0, "cpu", layout
    )
    assert torch.equal(again[0], keys[0])
    with pytest.raises(
        ValueError, match="cache_layout: expected one of NHD, HND, NHC, HNC, got 'N'"
    ):
        create_kv_caches_with_random_flash(1, 16, 1, 2, 64, kind, torch.bfloat16, 0, "cpu", "N")


def test_create_kv_caches_with_random() -> None:
    keys, values = create_kv_caches_with_random(4, 16, 1, 2, 64, "fp8", "half", 0, "cpu")
    assert keys[0].shape == (4, 2, 4, 16, 16) and values[0].shape == (4, 2, 64, 16)
    keys, values = create_kv_caches_with_random(4, 16, 1, 2, 80, "auto", torch.float32, 0, "cpu")
    assert keys[0].shape == (4, 2, 20, 16, 4) and keys[0].dtype == torch.float32
    with pytest.raises(ValueError, match="head_size: an fp8 cache in this layout needs"):
        create_kv_caches_with_random(4, 16, 1, 2, 72, "fp8", "half", 0, "cpu")
    with pytest.raises(ValueError, match="cache_dtype: nvfp4 has no"):
        create_kv_caches_with_random(4, 16, 1, 2, 64, "nvfp4", "half", 0, "cpu")
