"""A new format added to the registry only (no kernel yet): every layer above the kernels takes it
from the registry, and exactly one place rejects it, the kernel-support check in front of the
compiled op, with an error naming the format and the missing kernels."""

from collections.abc import Iterator

import pytest
import torch
from kv_cache_test_utils import LLAMA_LIKE

from vllm.config.cache import CacheConfig
from vllm.kv_quant.codecs import codec_for
from vllm.kv_quant.formats import (
    CacheKind,
    KVCacheFormat,
    KVQuantMode,
    find_format,
    kernel_cache_kind,
    registered_format,
)
from vllm.utils.torch_utils import is_quantized_kv_cache, kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backends.abstract import kv_cache_dim
from vllm.v1.attention.backends.reference import ReferenceAttentionImpl
from vllm.v1.core.model_specs import get_kv_cache_specs
from vllm.v1.kv_cache_interface import get_kv_quant_mode

ops = pytest.importorskip("vllm._custom_ops")

TOY = KVCacheFormat(
    name="toy",
    accepted_names=("toy",),
    storage_dtype=torch.uint8,
    quant_mode=KVQuantMode.FP8_PER_TENSOR,
    label="toy",
    fp8_variant="e4m3",
    cache_kind=CacheKind.FP8_E4M3,
    has_kernel=False,
)
"""An FP8-like format (one e4m3 byte per value, per-tensor scale) that no kernel writes."""

NO_KERNEL = (
    r"kv_cache_dtype: format 'toy' has no kernel support \(CPU/CUDA reshape_and_cache_flash\)"
)


@pytest.fixture
def toy() -> Iterator[KVCacheFormat]:
    with registered_format(TOY) as fmt:
        yield fmt
    assert find_format("toy") is None  # the registry is restored


def test_everything_above_the_kernels_takes_it(toy: KVCacheFormat) -> None:
    assert CacheConfig(cache_dtype="toy").cache_dtype == "toy"  # type: ignore[arg-type]
    assert kv_cache_dtype_str_to_dtype("toy", "bfloat16") == torch.uint8
    assert is_quantized_kv_cache("toy")
    assert get_kv_quant_mode("toy") is KVQuantMode.FP8_PER_TENSOR
    assert kv_cache_dim(128, "toy") == 128
    toy_specs = get_kv_cache_specs(LLAMA_LIKE, "toy", 16)
    fp8_specs = get_kv_cache_specs(LLAMA_LIKE, "fp8", 16)
    assert [s.page_size_bytes for s in toy_specs.values()] == [16 * 8 * 256] * 2
    # page-size math comes from the registry's facts; the specs differ in their encodings
    assert [s.page_size_bytes for s in fp8_specs.values()] == [16 * 8 * 256] * 2
    assert [s.encoding.format for s in toy_specs.values()] == [toy, toy]  # type: ignore[attr-defined]


def test_the_kernel_support_check_is_the_one_place_that_rejects_it(toy: KVCacheFormat) -> None:
    key = torch.randn(4, 2, 128, dtype=torch.bfloat16)
    key_cache = torch.zeros(2, 16, 2, 128, dtype=torch.uint8)
    value_cache = key_cache.clone()
    slots = torch.arange(4)
    one = torch.ones((), dtype=torch.float32)
    with pytest.raises(ValueError, match=NO_KERNEL):
        kernel_cache_kind("toy")
    with pytest.raises(ValueError, match=NO_KERNEL):
        ops.reshape_and_cache_flash(key, key, key_cache, value_cache, slots, "toy", one, one)
    with pytest.raises(ValueError, match=NO_KERNEL):  # torch.compile's fake impl: same check
        ops._reshape_and_cache_flash_fake(key, key, key_cache, value_cache, slots, "toy", one, one)
    assert not key_cache.any() and not value_cache.any()  # nothing written


def test_the_reference_backend_writes_it_with_its_codec(toy: KVCacheFormat) -> None:
    """No compiled writer: the reference backend falls back to the format's codec."""
    key = torch.randn(4, 2, 128, dtype=torch.bfloat16)
    key_cache = torch.zeros(2, 16, 2, 128, dtype=torch.uint8)
    value_cache = key_cache.clone()
    slots = torch.arange(4)
    one = torch.ones((), dtype=torch.float32)
    impl = ReferenceAttentionImpl(num_heads=2, head_size=128, kv_cache_dtype="toy")
    impl.do_kv_cache_update(_Scales(one), key, key, (key_cache, value_cache), slots)
    expected = torch.zeros_like(key_cache)
    codec_for(toy).write(key, expected, slots, one, None)
    assert (
        expected.any() and torch.equal(key_cache, expected) and torch.equal(value_cache, expected)
    )


def test_without_the_entry_it_is_unknown() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: unknown KV-cache dtype 'toy'"):
        kernel_cache_kind("toy")


class _Scales:
    def __init__(self, scale: torch.Tensor) -> None:
        self._k_scale = scale
        self._v_scale = scale
