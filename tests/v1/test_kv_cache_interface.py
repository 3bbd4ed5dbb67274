import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_cache_test_utils import dsv4_spec

from vllm.config import ModelConfig, SchedulerConfig, VllmConfig
from vllm.kv_quant.formats import KVCacheFormat, registered_format, storage_dtypes
from vllm.utils.torch_utils import nvfp4_kv_cache_full_dim
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_quant_mode,
)

QUANT_DTYPES = {
    "bfloat16": (KVQuantMode.NONE, torch.bfloat16),
    "float32": (KVQuantMode.NONE, torch.float32),
    "fp8": (KVQuantMode.FP8_PER_TENSOR, torch.uint8),
    "nvfp4": (KVQuantMode.NVFP4, torch.uint8),
}


def _config(max_model_len: int, max_num_batched_tokens: int | None = None) -> VllmConfig:
    """A config for requests of ``max_model_len`` tokens, ``max_num_batched_tokens`` per step
    (default: a whole request)."""
    batched = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
    return VllmConfig(
        model_config=ModelConfig(max_model_len=max_model_len),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=batched),
    )


def _spec(cls, cache_dtype: str = "bfloat16", **kwargs):
    mode, dtype = QUANT_DTYPES[cache_dtype]
    fields = dict(block_size=16, num_kv_heads=8, head_size=128, dtype=dtype, kv_quant_mode=mode)
    fields.update(kwargs)
    if cls is SlidingWindowSpec:
        fields.setdefault("sliding_window", 128)
    return cls(**fields)


def test_quant_mode() -> None:
    assert get_kv_quant_mode("nvfp4") is KVQuantMode.NVFP4
    assert get_kv_quant_mode("fp8") is KVQuantMode.FP8_PER_TENSOR
    assert get_kv_quant_mode("fp8_e5m2") is KVQuantMode.FP8_PER_TENSOR
    for name in ("auto", "bfloat16", "float16", "float32", "float"):
        assert get_kv_quant_mode(name) is KVQuantMode.NONE
    # upstream v0.33.0's values (v0.22.0 had NVFP4 = 4; INT4_PER_TOKEN_HEAD took 4 since)
    assert KVQuantMode.NVFP4 == 5 and KVQuantMode.FP8_PER_TENSOR == 1
    assert KVQuantMode.INT4_PER_TOKEN_HEAD == 4 and KVQuantMode.OCTAVE_K3V3_COMPACT == 14
    assert KVQuantMode.CUSTOM not in (KVQuantMode.OCTAVE_K3V4,) and not KVQuantMode.CUSTOM.is_octave
    assert KVQuantMode.NVFP4.is_nvfp4 and KVQuantMode.NVFP4.is_quantized
    assert KVQuantMode.FP8_PER_TENSOR.is_fp8 and not KVQuantMode.NONE.is_quantized
    # "half" is a torch dtype name, not a cache dtype (docs/design.md §3)
    for name in ("int8", "half"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype: unknown KV-cache dtype '{name}'"):
            get_kv_quant_mode(name)


@pytest.mark.parametrize("cls", [FullAttentionSpec, SlidingWindowSpec])
@pytest.mark.parametrize(
    ("cache_dtype", "page"), [("bfloat16", 65_536), ("fp8", 32_768), ("nvfp4", 18_432)]
)
def test_worked_page_sizes(cls, cache_dtype: str, page: int) -> None:
    """docs/design.md §4: N=16, H=8, D=128; FP8 needs no branch, NVFP4 holds for both spec
    classes."""
    spec = _spec(cls, cache_dtype)
    assert spec.real_page_size_bytes == page
    assert spec.page_size_bytes == page
    assert spec.storage_block_size == 16


def test_nvfp4_is_3_56x_smaller_than_bf16() -> None:
    ratio = (
        _spec(FullAttentionSpec).page_size_bytes / _spec(FullAttentionSpec, "nvfp4").page_size_bytes
    )
    assert round(ratio, 2) == 3.56


@pytest.mark.parametrize("cls", [FullAttentionSpec, SlidingWindowSpec])
def test_nvfp4_with_distinct_v_head_size(cls) -> None:
    spec = _spec(cls, "nvfp4", head_size=192, head_size_v=128)
    assert spec.page_size_bytes == 16 * 8 * (nvfp4_kv_cache_full_dim(192) + 72)
    bf16 = _spec(cls, head_size=192, head_size_v=128)
    assert bf16.page_size_bytes == 16 * 8 * (192 + 128) * 2


def test_padded_page() -> None:
    spec = _spec(FullAttentionSpec, page_size_padded=70_000)
    assert spec.page_size_bytes == 70_000 and spec.real_page_size_bytes == 65_536
    with pytest.raises(ValueError, match="page_size_padded: .*65536 bytes, got 1000"):
        _spec(FullAttentionSpec, page_size_padded=1000)


@pytest.mark.parametrize("cls", [FullAttentionSpec, SlidingWindowSpec])
@pytest.mark.parametrize(("field", "value"), [("head_size", 72), ("head_size_v", 40)])
def test_nvfp4_head_size_must_be_multiple_of_16(cls, field: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"{field}: NVFP4 KV cache needs a multiple of 16"):
        _spec(cls, "nvfp4", **{field: value})


def test_quantized_spec_needs_byte_storage() -> None:
    with pytest.raises(ValueError, match="dtype: NVFP4 caches are stored as 1-byte"):
        _spec(FullAttentionSpec, "nvfp4", dtype=torch.bfloat16)


@pytest.mark.parametrize("field", ["block_size", "num_kv_heads", "head_size"])
def test_positive_fields(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}: expected a positive int"):
        _spec(FullAttentionSpec, **{field: 0})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dtype="bf17"), r"dtype: expected a torch.dtype, got 'bf17' \(str\)"),
        (dict(dtype=None), r"dtype: expected a torch.dtype, got None \(NoneType\)"),
        (
            dict(dtype=torch.int32),
            re.escape(
                "dtype: expected a KV-cache storage dtype "
                f"({', '.join(map(str, storage_dtypes()))}), got torch.int32"
            ),
        ),
        (dict(dtype=torch.float64), r"dtype: expected a KV-cache storage dtype .*torch.float64"),
        (dict(kv_quant_mode=1), r"kv_quant_mode: expected a KVQuantMode, got 1 \(int\)"),
    ],
    ids=["str", "none", "int32", "float64", "int_mode"],
)
@pytest.mark.parametrize("cls", [FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec])
def test_dtype_is_a_kv_cache_storage_dtype(cls, kwargs: dict, message: str) -> None:
    """Checked at construction: a string naming no torch dtype used to fail later with a
    TypeError from torch, and an int32 spec allocated an int32 cache."""
    with pytest.raises(ValueError, match=message):
        _spec(cls, **kwargs)


@pytest.mark.parametrize("cls", [FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec])
def test_dtype_name_is_taken_as_its_torch_dtype(cls) -> None:
    """Upstream v0.33's tests build specs with ``dtype="float16"``."""
    spec = _spec(cls, dtype="float16")
    assert spec.dtype is torch.float16 and spec == _spec(cls, dtype=torch.float16)


def test_storage_dtypes_come_from_the_registry() -> None:
    """A format registered with a new storage dtype makes specs of that dtype valid."""
    with pytest.raises(ValueError, match="dtype: expected a KV-cache storage dtype"):
        _spec(FullAttentionSpec, dtype=torch.int16)
    int16 = KVCacheFormat(
        name="int16_toy",
        accepted_names=("int16_toy",),
        storage_dtype=torch.int16,
        quant_mode=KVQuantMode.NONE,
        label="i16",
    )
    with registered_format(int16):
        spec = _spec(FullAttentionSpec, dtype=torch.int16)
        assert spec.kv_cache_format is int16
        assert torch.int16 in storage_dtypes()
    assert torch.int16 not in storage_dtypes()


@pytest.mark.parametrize(
    ("shapes", "dtypes", "message"),
    [
        (((-1, 4),), (torch.float32,), r"shapes\[0\]: expected a state shape of positive "
         r"ints, got \(-1, 4\)"),
        (((3, 4), (0, 2)), (torch.float32,) * 2, r"shapes\[1\]: .*got \(0, 2\)"),
        (((3, 4.0),), (torch.float32,), r"shapes\[0\]: .*got \(3, 4.0\)"),
        (((3, 4),), ("float32",), r"dtypes\[0\]: expected a torch.dtype, got 'float32' \(str\)"),
        ((1, 2), (torch.float32,) * 2,
         r"shapes\[0\]: expected a tuple of ints \(a state shape\), got 1 \(int\)"),
        (torch.Size([3, 4]), (torch.float32,) * 2, r"shapes\[0\]: .*got 3 \(int\)"),
        (((3, 4), None), (torch.float32,) * 2, r"shapes\[1\]: .*got None \(NoneType\)"),
        (None, (torch.float32,), r"shapes: expected a tuple of state shapes, got None"),
        (((3, 4),), torch.float32,
         r"dtypes: expected a tuple of torch.dtypes, got torch.float32 \(dtype\)"),
    ],
    ids=["negative", "zero", "float", "str_dtype", "int_shape", "one_size", "none_shape",
         "no_shapes", "bare_dtype"],
)  # fmt: skip
def test_mamba_spec_fields(shapes, dtypes, message: str) -> None:
    """MambaSpec(shapes=((-1, 4),)) used to give page_size_bytes == -8; shapes=(1,) (a shape,
    not a tuple of them) a bare TypeError."""
    with pytest.raises(ValueError, match=message):
        MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes)


def test_mamba_spec_accepts_tuple_list_and_size_shapes() -> None:
    shapes = ((3, 4), [3, 4], torch.Size([3, 4]))
    spec = MambaSpec(block_size=16, shapes=shapes, dtypes=(torch.float32,) * 3)
    assert spec.state_sizes_bytes == (48, 48, 48)
    assert MambaSpec(block_size=16, shapes=[(2,)], dtypes=[torch.float16]).page_size_bytes == 4


def test_mamba_spec_bare_shape_with_one_dtype_is_one_state() -> None:
    """``shapes=(1, 1)`` with one dtype (how upstream's tests build specs) is ``((1, 1),)``."""
    spec = MambaSpec(block_size=16, shapes=(3, 4), dtypes=(torch.float32,))
    assert spec.shapes == ((3, 4),)
    assert spec == MambaSpec(block_size=16, shapes=((3, 4),), dtypes=(torch.float32,))
    assert spec.page_size_bytes == 48


@pytest.mark.parametrize("num_blocks", [-8, -1, True, 2.0, "8"])
def test_kv_cache_config_num_blocks(num_blocks) -> None:
    """Rejected at construction (it used to surface only in init_layer_kv_caches)."""
    with pytest.raises(ValueError, match=r"num_blocks: expected an int >= 0 .*got "):
        KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[])


def test_kv_cache_config_with_no_blocks_is_valid() -> None:
    """Upstream's connector tests build KVCacheConfig(num_blocks=0, [], [])."""
    assert KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[]).num_blocks == 0


def test_sliding_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="sliding_window: expected a positive int"):
        _spec(SlidingWindowSpec, sliding_window=0)


def test_max_memory_usage() -> None:
    full = _spec(FullAttentionSpec)
    assert full.max_memory_usage_bytes(_config(1000)) == 63 * 65_536
    sliding = _spec(SlidingWindowSpec, sliding_window=128)
    # min(127 + 256, 1000) = 383 tokens -> 24 pages + 1.
    assert sliding.max_memory_usage_bytes(_config(1000, 256)) == 25 * 65_536
    assert sliding.max_admission_blocks_per_request(256, 1000) == 25
    assert sliding.max_memory_usage_bytes(_config(100)) == (7 + 1) * 65_536
    chunked = _spec(ChunkedLocalAttentionSpec, attention_chunk_size=64)
    assert chunked.max_memory_usage_bytes(_config(1000, 32)) == 6 * 65_536


@pytest.mark.parametrize(
    ("ratio", "storage", "real", "padded"), [(4, 64, 37_376, 37_440), (128, 2, 1_168, 1_728)]
)
def test_deepseek_v4_compressed_pages(ratio: int, storage: int, real: int, padded: int) -> None:
    spec = dsv4_spec(ratio)
    assert spec.storage_block_size == storage
    assert spec.real_page_size_bytes == real
    assert spec.page_size_bytes == padded


def test_mla_spec_errors() -> None:
    mla = dict(block_size=256, num_kv_heads=1, head_size=576, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_quant_mode: NVFP4 is not a format for MLA"):
        MLAAttentionSpec(**mla, kv_quant_mode=KVQuantMode.NVFP4)
    with pytest.raises(ValueError, match="block_size: must be a multiple of compress_ratio=3"):
        MLAAttentionSpec(**mla, compress_ratio=3)
    # fp8_ds_mla: DeepSeek-V3.2's 656-byte layout for head size 576 (upstream's default),
    # DeepSeek-V4's 584-byte record only with model_version="deepseek_v4"; dtype is not counted.
    v32 = MLAAttentionSpec(**{**mla, "dtype": torch.float32}, cache_dtype_str="fp8_ds_mla")
    assert v32.page_size_bytes == 256 * 656
    v4 = {**mla, "head_size": 512, "cache_dtype_str": "fp8_ds_mla"}
    assert MLAAttentionSpec(**v4, model_version="deepseek_v4").page_size_bytes == 256 * 584
    with pytest.raises(ValueError, match="head_size: .*stores head size 576, got 512.*deepseek_v4"):
        MLAAttentionSpec(**v4)
    with pytest.raises(ValueError, match="head_size: .*DeepSeek-V4.*head size 512, got 576"):
        MLAAttentionSpec(**mla, cache_dtype_str="fp8_ds_mla", model_version="deepseek_v4")
    with pytest.raises(ValueError, match="model_version: expected one of"):
        MLAAttentionSpec(**mla, model_version="deepseek_v5")
    plain = MLAAttentionSpec(**{**mla, "dtype": torch.bfloat16})
    assert plain.page_size_bytes == 256 * 576 * 2
    assert plain.storage_block_size == 256


def test_mamba_spec() -> None:
    # Nemotron-H 56B Mamba-2 layer, bf16 (shared/model_configs derived block).
    spec = MambaSpec(
        block_size=8192,
        shapes=((3, 20480), (256, 64, 256)),
        dtypes=(torch.bfloat16, torch.bfloat16),
    )
    assert spec.state_sizes_bytes == (122_880, 8_388_608)
    assert spec.page_size_bytes == 122_880 + 8_388_608
    assert spec.max_memory_usage_bytes(_config(8192)) == spec.page_size_bytes
    padded = MambaSpec(
        block_size=8192, shapes=((3, 4),), dtypes=(torch.float32,), page_size_padded=64
    )
    assert padded.page_size_bytes == 64
    with pytest.raises(ValueError, match="shapes/dtypes: expected one dtype per state shape"):
        MambaSpec(block_size=16, shapes=((3, 4),), dtypes=())
    with pytest.raises(ValueError, match="page_size_padded"):
        MambaSpec(block_size=16, shapes=((3, 4),), dtypes=(torch.float32,), page_size_padded=8)


def test_merge() -> None:
    a, b = _spec(FullAttentionSpec), _spec(FullAttentionSpec)
    assert FullAttentionSpec.merge([a, b]) == a
    with pytest.raises(ValueError, match="differ in head_size: 128 vs 64"):
        FullAttentionSpec.merge([a, _spec(FullAttentionSpec, head_size=64)])
    with pytest.raises(ValueError, match="cannot merge FullAttentionSpec with SlidingWindowSpec"):
        FullAttentionSpec.merge([a, _spec(SlidingWindowSpec)])
    with pytest.raises(ValueError, match="at least one spec"):
        FullAttentionSpec.merge([])


def test_copy_with_new_block_size() -> None:
    spec = _spec(SlidingWindowSpec, "nvfp4")
    bigger = spec.copy_with_new_block_size(32)
    assert bigger.block_size == 32 and bigger.sliding_window == spec.sliding_window
    assert bigger.page_size_bytes == 2 * spec.page_size_bytes


def test_uniform_type_specs() -> None:
    specs = {
        "layers.0": _spec(FullAttentionSpec, head_size=64),
        "layers.1": _spec(FullAttentionSpec, "fp8", head_size=128),
    }
    group = UniformTypeKVCacheSpecs.from_specs(specs)
    assert group is not None
    assert group.page_size_bytes == 16 * 8 * 128 * 2 + 16 * 8 * 256
    assert group.max_memory_usage_bytes(_config(32)) == 2 * group.page_size_bytes
    assert group.copy_with_new_block_size(32).page_size_bytes == 2 * group.page_size_bytes
    mixed = {**specs, "layers.2": _spec(SlidingWindowSpec)}
    assert UniformTypeKVCacheSpecs.from_specs(mixed) is None
    windows = {"a": _spec(SlidingWindowSpec), "b": _spec(SlidingWindowSpec, sliding_window=64)}
    assert not UniformTypeKVCacheSpecs.is_uniform_type(windows)


def _flashinfer_cache_numel(spec: FullAttentionSpec, num_blocks: int) -> int:
    """Elements of a FlashInfer-shaped (B, 2, N, H, D') cache for K and V of equal head size."""
    last_dim = (
        nvfp4_kv_cache_full_dim(spec.head_size) if spec.kv_quant_mode.is_nvfp4 else spec.head_size
    )
    return math.prod((num_blocks, 2, spec.block_size, spec.num_kv_heads, last_dim))


@settings(max_examples=80, deadline=None)
@given(
    block_size=st.sampled_from([1, 8, 16, 32, 64, 128]),
    num_kv_heads=st.integers(1, 16),
    head_size=st.sampled_from([16, 32, 64, 80, 96, 128, 192, 256]),
    cache_dtype=st.sampled_from(sorted(QUANT_DTYPES)),
    window=st.integers(1, 4096),
)
def test_page_size_matches_flashinfer_cache(
    block_size: int, num_kv_heads: int, head_size: int, cache_dtype: str, window: int
) -> None:
    fields = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size)
    full = _spec(FullAttentionSpec, cache_dtype, **fields)
    sliding = _spec(SlidingWindowSpec, cache_dtype, sliding_window=window, **fields)
    assert full.page_size_bytes == sliding.page_size_bytes
    num_blocks = 3
    cache_bytes = (
        _flashinfer_cache_numel(full, num_blocks)
        * torch.tensor([], dtype=full.dtype).element_size()
    )
    assert cache_bytes == num_blocks * full.page_size_bytes


def test_latent_specs_take_tokens_per_state_as_compress_ratio() -> None:
    """Upstream v0.33 builds compressed latent specs with ``tokens_per_state=r``."""
    import dataclasses

    spec = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=16, dtype=torch.bfloat16, tokens_per_state=4
    )
    assert spec.compress_ratio == 4 and spec.tokens_per_state == 4
    assert spec.storage_block_size == 4
    assert dataclasses.replace(spec, compress_ratio=2).tokens_per_state == 2
    with pytest.raises(ValueError, match="tokens_per_state: expected compress_ratio's value 2"):
        MLAAttentionSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=16,
            dtype=torch.bfloat16,
            compress_ratio=2,
            tokens_per_state=4,
        )
    with pytest.raises(ValueError, match="tokens_per_state: expected a positive int"):
        MLAAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=16, dtype=torch.bfloat16, tokens_per_state=0.5
        )
