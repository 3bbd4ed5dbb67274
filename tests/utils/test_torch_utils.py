import random
import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm.utils.torch_utils as torch_utils
from vllm.kv_quant import dequantize_fp8
from vllm.utils.torch_utils import (
    MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP,
    STR_DTYPE_TO_TORCH_DTYPE,
    canonicalize_singleton_dim_strides,
    common_broadcastable_dtype,
    create_kv_caches_with_random,
    create_kv_caches_with_random_flash,
    current_stream,
    get_dtype_size,
    get_kv_cache_torch_dtype,
    is_lossless_cast,
    is_quantized_kv_cache,
    kv_cache_dtype_str_to_dtype,
    nvfp4_kv_cache_full_dim,
    nvfp4_kv_cache_split_views,
    nvfp4_split_data_scale,
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
        nvfp4_split_data_scale(torch.zeros(2, 16, 8, 70, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected dtype torch.uint8"):
        nvfp4_split_data_scale(torch.zeros(2, 16, 8, 72, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="4-D side .* or a 5-D cache"):
        nvfp4_kv_cache_split_views(torch.zeros(2, 3, 16, 8, 72, dtype=torch.uint8))
    sparse = torch.zeros(2, 16, 16, 72, dtype=torch.uint8)[:, :, ::2]
    with pytest.raises(ValueError, match="one dense region"):
        nvfp4_split_data_scale(sparse)


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


# ------------------------------------------------------------------ generic torch helpers


@pytest.mark.parametrize(
    ("src", "tgt", "lossless"),
    [
        (torch.float32, torch.float32, True),
        (torch.bool, torch.uint8, True),
        (torch.bool, torch.complex64, True),
        (torch.uint8, torch.bool, False),
        (torch.uint8, torch.int16, True),
        (torch.uint8, torch.int8, False),
        (torch.int32, torch.int64, True),
        (torch.int64, torch.int32, False),
        (torch.int64, torch.bfloat16, True),  # upstream's rule: a later family always is
        (torch.float16, torch.int64, False),
        (torch.float16, torch.float64, True),
        (torch.bfloat16, torch.float16, False),  # range
        (torch.float16, torch.bfloat16, False),  # resolution
        (torch.float8_e4m3fn, torch.float16, True),
        (torch.float64, torch.float32, False),
        (torch.float64, torch.complex64, True),
        (torch.complex64, torch.complex128, True),
        (torch.complex128, torch.complex64, False),
        (torch.complex64, torch.float64, False),
    ],
    ids=str,
)
def test_is_lossless_cast(src: torch.dtype, tgt: torch.dtype, lossless: bool) -> None:
    assert is_lossless_cast(src, tgt) is lossless


def test_is_lossless_cast_matches_integer_round_trips() -> None:
    ints = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
    for src in ints:
        info = torch.iinfo(src)
        extremes = torch.tensor([info.min, info.max], dtype=src)
        for tgt in ints:
            survives = torch.equal(extremes.to(tgt).to(src), extremes) and bool(
                (extremes.to(tgt).to(torch.int64) == extremes.to(torch.int64)).all()
            )
            assert is_lossless_cast(src, tgt) is survives, (src, tgt)


@pytest.mark.parametrize(
    ("dtypes", "common"),
    [
        ([torch.int8], torch.int8),
        ([torch.uint8, torch.int8], torch.uint8),  # neither covers the other: the first
        ([torch.int8, torch.uint8, torch.int16], torch.int16),
        ([torch.float16, torch.bfloat16], torch.float16),
        ([torch.bfloat16, torch.float16, torch.float32], torch.float32),
        ([torch.bool, torch.float16, torch.int64], torch.float16),
        ((torch.float32, torch.complex64), torch.complex64),
    ],
    ids=str,
)
def test_common_broadcastable_dtype(dtypes: Any, common: torch.dtype) -> None:
    assert common_broadcastable_dtype(dtypes) == common


def test_common_broadcastable_dtype_needs_a_dtype() -> None:
    with pytest.raises(ValueError, match="dtypes: expected at least one dtype, got none"):
        common_broadcastable_dtype([])


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    junk=st.lists(st.integers(0, 7), min_size=5, max_size=5),
    offset=st.integers(0, 3),
)
def test_canonicalize_singleton_dim_strides(shape: list[int], junk: list[int], offset: int) -> None:
    """Size-1 dims get the span of the dims inside them, whatever stride they had; other
    strides, the storage, the offset and every element stay."""
    base = torch.arange(offset + int(np.prod(shape)), dtype=torch.float32)[offset:].reshape(shape)
    strides = [junk[d] if n == 1 else base.stride(d) for d, n in enumerate(shape)]
    t = base.as_strided(shape, strides)
    fixed = canonicalize_singleton_dim_strides(t)
    span = 1
    for d in reversed(range(len(shape))):
        assert fixed.stride(d) == (span if shape[d] == 1 else t.stride(d))
        span = fixed.stride(d) * shape[d]
    assert fixed.data_ptr() == t.data_ptr() and fixed.storage_offset() == t.storage_offset()
    assert torch.equal(fixed, t)
    assert (fixed is t) == (fixed.stride() == t.stride())


def test_canonicalize_keeps_outer_strides_and_returns_canonical_tensors() -> None:
    """One KV head per rank after a permute: the head dim's stride 1 becomes N * D, and a
    non-canonical page stride (a slice of a larger buffer) is kept."""
    pages = torch.zeros(10, 2, 1, 16, 64, dtype=torch.bfloat16)[::2]
    degenerate = pages.as_strided(pages.shape, (pages.stride(0), 1024, 1, 64, 1))
    fixed = canonicalize_singleton_dim_strides(degenerate)
    assert fixed.stride() == (2 * 2048, 1024, 1024, 64, 1)
    canonical = torch.zeros(3, 1, 5)
    assert canonicalize_singleton_dim_strides(canonical) is canonical
    scalar = torch.tensor(1.0)
    assert canonicalize_singleton_dim_strides(scalar) is scalar


def _in_new_thread(fn: Any) -> Any:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join(timeout=10)
    return result[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU platform's placeholder")
def test_current_stream_on_cpu_is_a_per_thread_placeholder() -> None:
    stream = current_stream()
    assert current_stream() is stream
    assert stream.synchronize() is None
    assert _in_new_thread(current_stream) is not stream


def test_set_stream_records_the_stream_per_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.set_stream (patched at import, as upstream does) records the stream that
    current_stream returns, in the calling thread only; None stays a no-op."""
    calls: list[object] = []
    monkeypatch.setattr(torch_utils, "_torch_set_stream", calls.append)
    stream = object()

    def set_and_read() -> tuple[object, object]:
        torch.cuda.set_stream(stream)  # type: ignore[arg-type]
        first = current_stream()
        torch.cuda.set_stream(None)  # type: ignore[arg-type]
        return first, current_stream()

    assert _in_new_thread(set_and_read) == (stream, stream)
    assert calls == [stream, None]
    assert current_stream() is not stream
    assert torch.cuda.set_stream._torch_set_stream is not torch.cuda.set_stream  # type: ignore


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_current_stream_on_cuda_is_dedicated_and_follows_the_context() -> None:
    def check() -> None:
        stream = current_stream()
        assert stream.cuda_stream != 0  # not the default stream: CUDA graphs can capture
        assert current_stream() is stream and torch.cuda.current_stream() == stream
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            assert current_stream() == other
        assert current_stream() == stream

    _in_new_thread(check)
