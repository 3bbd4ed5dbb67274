import inspect
import logging
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm.utils.torch_utils as torch_utils
from vllm.config.model import ModelConfig
from vllm.kv_quant import dequantize_fp8
from vllm.utils.torch_utils import (
    MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP,
    STR_DTYPE_TO_TORCH_DTYPE,
    TORCH_DTYPE_TO_NUMPY_DTYPE,
    canonicalize_singleton_dim_strides,
    common_broadcastable_dtype,
    create_kv_caches_with_random,
    create_kv_caches_with_random_flash,
    get_dtype_size,
    get_kv_cache_quant_algo_string,
    get_kv_cache_torch_dtype,
    is_lossless_cast,
    is_meta_module,
    is_non_overlapping_and_dense,
    is_quantized_kv_cache,
    is_strictly_contiguous,
    kv_cache_dtype_str_to_dtype,
    make_ndarray_with_pad,
    make_tensor_with_pad,
    nvfp4_kv_cache_full_dim,
    nvfp4_kv_cache_split_views,
    nvfp4_split_data_scale,
    resolve_kv_cache_dtype_string,
    set_default_torch_dtype,
    set_random_seed,
)


def test_dtype_maps() -> None:
    for torch_dtype, np_dtype in TORCH_DTYPE_TO_NUMPY_DTYPE.items():
        assert torch.from_numpy(np.zeros(1, dtype=np_dtype)).dtype == torch_dtype
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
    with pytest.raises(ValueError, match="model_config: kv_cache_dtype='auto' needs .* 'bf17'"):
        kv_cache_dtype_str_to_dtype("auto", "bf17")


def test_kv_cache_dtype_str_to_dtype_takes_upstreams_model_config() -> None:
    """Upstream passes its ``ModelConfig`` (``dtype`` read) or, in tests, None (float16)."""
    assert kv_cache_dtype_str_to_dtype("auto", None) is torch.float16
    assert kv_cache_dtype_str_to_dtype("fp8", None) is torch.uint8
    assert kv_cache_dtype_str_to_dtype("auto", ModelConfig(dtype="bfloat16")) is torch.bfloat16
    resolved = SimpleNamespace(dtype=torch.float32)  # upstream's, dtype already resolved
    assert kv_cache_dtype_str_to_dtype("auto", resolved) is torch.float32
    with pytest.raises(ValueError, match="model_config: .* got 'auto'"):
        kv_cache_dtype_str_to_dtype("auto", ModelConfig())
    with pytest.raises(ValueError, match="model_config: .* got None"):
        kv_cache_dtype_str_to_dtype("auto", object())
    # get_kv_cache_torch_dtype keeps upstream's stricter rule: "auto" needs a model dtype.
    with pytest.raises(ValueError, match="model_dtype: kv_cache_dtype='auto' needs"):
        get_kv_cache_torch_dtype("auto")


def _modelopt(**fields: Any) -> dict[str, Any]:
    return {"quant_method": "modelopt", **fields}


STATIC_FP8 = {"type": "float", "num_bits": 8, "dynamic": False}


@pytest.mark.parametrize(
    ("quant_cfg", "expected"),
    [
        ({"quant_method": "fp8", "kv_cache_quant_algo": "FP8"}, None),  # not ModelOpt's
        ({"kv_cache_quant_algo": "FP8"}, None),
        (_modelopt(), None),
        (_modelopt(kv_cache_quant_algo=None), None),
        (_modelopt(kv_cache_quant_algo=8), None),  # neither a name nor a scheme
        (_modelopt(kv_cache_quant_algo="FP8"), "fp8_e4m3"),
        (_modelopt(kv_cache_quant_algo="nvfp4"), "nvfp4"),
        ({"quant_method": "modelopt_fp4", "kv_cache_quant_algo": "NVFP4"}, "nvfp4"),
        (_modelopt(quantization={"kv_cache_quant_algo": "FP8"}), "fp8_e4m3"),
        (_modelopt(kv_cache_scheme=STATIC_FP8), "fp8_e4m3"),
        (_modelopt(kv_cache_scheme={"type": "float", "num_bits": 4}), "nvfp4"),
        # Precedence: nested scheme, top scheme, nested algo, top algo.
        (
            _modelopt(quantization={"kv_cache_quant_algo": "FP8"}, kv_cache_quant_algo="NVFP4"),
            "fp8_e4m3",
        ),
        (
            _modelopt(quantization={"kv_cache_quant_algo": "NVFP4"}, kv_cache_scheme=STATIC_FP8),
            "fp8_e4m3",
        ),
        (_modelopt(quantization={"kv_cache_scheme": STATIC_FP8}, kv_cache_scheme={}), "fp8_e4m3"),
    ],
    ids=str,
)
def test_get_kv_cache_quant_algo_string(quant_cfg: dict[str, Any], expected: str | None) -> None:
    assert get_kv_cache_quant_algo_string(quant_cfg) == expected


@pytest.mark.parametrize(
    "algo",
    ["int8", {"type": "float", "num_bits": 8, "dynamic": True}, {"type": "int", "num_bits": 4}],
    ids=str,
)
def test_unknown_modelopt_kv_algo_falls_back_to_auto(
    algo: Any, caplog: pytest.LogCaptureFixture
) -> None:
    key = "kv_cache_scheme" if isinstance(algo, dict) else "kv_cache_quant_algo"
    with caplog.at_level(logging.WARNING, logger=torch_utils.__name__):
        assert get_kv_cache_quant_algo_string(_modelopt(**{key: algo})) == "auto"
    assert f"Unknown kv_cache_quant_algo {algo!r}" in caplog.text
    with pytest.raises(ValueError, match="quant_cfg: expected a quantization_config mapping"):
        get_kv_cache_quant_algo_string([("quant_method", "modelopt")])  # type: ignore[arg-type]


def test_resolve_kv_cache_dtype_string() -> None:
    def model(quant_cfg: Any) -> SimpleNamespace:
        return SimpleNamespace(hf_config=SimpleNamespace(quantization_config=quant_cfg))

    fp8_checkpoint = model(_modelopt(kv_cache_quant_algo="FP8"))
    assert resolve_kv_cache_dtype_string("auto", fp8_checkpoint) == "fp8_e4m3"
    assert resolve_kv_cache_dtype_string("bfloat16", fp8_checkpoint) == "bfloat16"  # user's
    assert resolve_kv_cache_dtype_string("auto", model(_modelopt())) == "auto"
    assert resolve_kv_cache_dtype_string("auto", model(None)) == "auto"
    assert resolve_kv_cache_dtype_string("auto", ModelConfig()) == "auto"  # no hf_config
    assert resolve_kv_cache_dtype_string("auto", None) == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype: expected a str, got None"):
        resolve_kv_cache_dtype_string(None, fp8_checkpoint)  # type: ignore[arg-type]


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


def _draws(*seed_args: Any) -> tuple[float, list[int], list[float]]:
    set_random_seed(*seed_args)
    return random.random(), np.random.randint(2**31, size=3).tolist(), torch.rand(3).tolist()


def test_set_random_seed_per_data_parallel_index() -> None:
    """Index 0 seeds with the seed itself; other indices with the value upstream derives from
    (seed, index) by SeedSequence, so that each DP engine's stream matches upstream's."""
    assert _draws(42, 0) == _draws(42) == _draws(42, 0)
    derived = int(np.random.SeedSequence((42, 3)).generate_state(1)[0])
    assert _draws(42, 3) == _draws(derived)
    assert len({str(_draws(42, index)) for index in range(5)}) == 5
    assert _draws(7, 1) != _draws(8, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1,), "seed: expected None or an int in \\[0, 2\\*\\*32 - 1\\], got -1"),
        ((2**32,), "seed: expected None or an int"),
        ((True,), "seed: expected None or an int"),
        (("7",), "seed: expected None or an int"),
        ((7, -1), "data_parallel_index: expected a non-negative int, got -1"),
        ((None, 1.0), "data_parallel_index: expected a non-negative int, got 1.0"),
    ],
    ids=str,
)
def test_set_random_seed_rejects_bad_input_before_seeding(args: Any, message: str) -> None:
    state = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    with pytest.raises(ValueError, match=message):
        set_random_seed(*args)
    assert random.getstate() == state[0]
    assert (np.random.get_state()[1] == state[1]).all()
    assert torch.equal(torch.get_rng_state(), state[2])


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
    # A size-1 dim's stride: is_contiguous() ignores it, is_strictly_contiguous() does not.
    assert t.is_contiguous() and is_non_overlapping_and_dense(t)
    assert is_strictly_contiguous(fixed) and is_strictly_contiguous(t) == (fixed is t)


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


def test_stride_predicates_on_permuted_sliced_and_expanded_tensors() -> None:
    base = torch.zeros(2, 3, 4)
    cases = [  # tensor, strictly contiguous, non-overlapping and dense
        (base, True, True),
        (base.permute(2, 0, 1), False, True),  # a permutation of a dense tensor
        (base.transpose(0, 1)[:, :1], False, True),
        (base[:, :, ::2], False, False),  # gaps
        (base[:, :2], False, False),
        (torch.zeros(3, 1).expand(3, 4), False, False),  # stride 0: overlapping
        (torch.zeros(()), True, True),
    ]
    for t, strict, dense in cases:
        assert (is_strictly_contiguous(t), is_non_overlapping_and_dense(t)) == (strict, dense)


def test_is_meta_module() -> None:
    assert not is_meta_module(torch.nn.Linear(2, 2))
    assert is_meta_module(torch.nn.Linear(2, 2, device="meta"))
    with_meta_buffer = torch.nn.BatchNorm1d(2)
    with_meta_buffer.register_buffer("extra", torch.empty(1, device="meta"))
    assert is_meta_module(torch.nn.Sequential(torch.nn.ReLU(), with_meta_buffer))


def test_set_default_torch_dtype_restores_and_rejects_non_float_dtypes() -> None:
    before = torch.get_default_dtype()
    with set_default_torch_dtype(torch.float64):
        assert torch.get_default_dtype() == torch.float64 and torch.zeros(1).dtype == torch.float64
    assert torch.get_default_dtype() == before
    with pytest.raises(KeyError), set_default_torch_dtype(torch.float16):
        raise KeyError("inside")
    assert torch.get_default_dtype() == before
    with (
        pytest.raises(ValueError, match="dtype: expected one of .*, got torch.int32"),
        set_default_torch_dtype(torch.int32),
    ):
        pass
    assert torch.get_default_dtype() == before


def test_make_ndarray_and_tensor_with_pad() -> None:
    rows = [[1, 2, 3], [], [4]]
    expected = [[1, 2, 3], [0, 0, 0], [4, 0, 0]]
    padded = make_ndarray_with_pad(rows, 0, np.int32)
    assert padded.dtype == np.int32 and padded.tolist() == expected
    assert make_ndarray_with_pad(rows, -1, np.int64, max_len=4)[1].tolist() == [-1] * 4
    assert make_ndarray_with_pad([], 0, np.int32).shape == (0, 0)
    tensor = make_tensor_with_pad(rows, 0, torch.int64, device="cpu")
    assert tensor.dtype == torch.int64 and tensor.tolist() == expected
    assert make_tensor_with_pad([[0.5]], 1.0, torch.float16, max_len=2).tolist() == [[0.5, 1.0]]
    with pytest.raises(ValueError, match="x: row 0 has 3 items, more than max_len=2"):
        make_ndarray_with_pad(rows, 0, np.int32, max_len=2)
    with pytest.raises(ValueError, match="max_len: expected None or a non-negative int, got -1"):
        make_ndarray_with_pad(rows, 0, np.int32, max_len=-1)
    with pytest.raises(ValueError, match="dtype: expected one of .*, got torch.bfloat16"):
        make_tensor_with_pad(rows, 0, torch.bfloat16)


UPSTREAM_SIGNATURES: dict[str, list[str]] = {
    "async_tensor_h2d": ["data", "device", "dtype", "out"],
    "available_cpu_count": [],
    "get_kv_cache_quant_algo_string": ["quant_cfg"],
    "get_kv_cache_torch_dtype": ["cache_dtype", "model_dtype"],
    "kv_cache_dtype_str_to_dtype": ["kv_cache_dtype", "model_config"],
    "make_ndarray_with_pad": ["x", "pad", "dtype", "max_len"],
    "make_tensor_with_pad": ["x", "pad", "dtype", "max_len", "device", "pin_memory"],
    "resolve_kv_cache_dtype_string": ["kv_cache_dtype", "model_config"],
    "set_default_torch_num_threads": ["num_threads"],
    "set_random_seed": ["seed", "data_parallel_index"],
    "startup_omp_num_threads": ["num_local_procs"],
}
"""Parameter names of upstream v0.33's helpers that callers pass by keyword."""


@pytest.mark.parametrize("name", UPSTREAM_SIGNATURES)
def test_upstream_parameter_names(name: str) -> None:
    function: Callable[..., Any] = getattr(torch_utils, name)
    assert list(inspect.signature(function).parameters) == UPSTREAM_SIGNATURES[name]
