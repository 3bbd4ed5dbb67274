"""A platform's own ``--kv-cache-dtype`` (upstream v0.33's ``register_kv_cache_dtype`` and
``KVCacheDTypeHandler``): registered once, it is a format of the registry, so the config, the
live dtype tables, the quant-mode helpers, the specs and the planner take it; the compiled op
does not."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from kv_cache_test_utils import LLAMA_LIKE

from vllm.config.cache import (
    KV_CACHE_DTYPES,
    CacheConfig,
    KVCacheDTypeHandler,
    get_kv_cache_dtype_handler,
    is_known_kv_cache_dtype,
    register_kv_cache_dtype,
    unregister_kv_cache_dtype,
)
from vllm.kv_quant.formats import CacheKind, find_format, kernel_cache_kind
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.core.model_specs import get_kv_cache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVQuantMode,
    get_kv_quant_mode,
    is_quantized_kv_cache,
    kv_cache_uses_per_token_head_scales,
)


class CustomInt8:
    """A backend that dispatches its own kernels."""

    name = "plat-c8"

    def torch_dtype(self) -> torch.dtype:
        return torch.int8

    def quant_mode(self) -> KVQuantMode:
        return KVQuantMode.CUSTOM


class ReusesInt8PerTokenHead:
    """A backend that reuses the generic int8 per-token-head path."""

    name = "plat-ith"

    def torch_dtype(self) -> torch.dtype:
        return torch.int8

    def quant_mode(self) -> KVQuantMode:
        return KVQuantMode.INT8_PER_TOKEN_HEAD


@pytest.fixture
def registered() -> Iterator[None]:
    register_kv_cache_dtype("plat-c8")(CustomInt8)
    register_kv_cache_dtype("plat-ith")(ReusesInt8PerTokenHead)
    yield
    for name in ("plat-c8", "plat-ith"):
        if get_kv_cache_dtype_handler(name) is not None:
            unregister_kv_cache_dtype(name)
    assert find_format("plat-c8") is None and "plat-c8" not in KV_CACHE_DTYPES


@pytest.mark.usefixtures("registered")
def test_a_registered_dtype_is_known_everywhere() -> None:
    assert "plat-c8" in KV_CACHE_DTYPES and is_known_kv_cache_dtype("plat-c8")
    assert not is_known_kv_cache_dtype("definitely-not-a-dtype")
    assert STR_DTYPE_TO_TORCH_DTYPE["plat-c8"] is torch.int8
    assert isinstance(get_kv_cache_dtype_handler("plat-c8"), KVCacheDTypeHandler)
    assert get_kv_cache_dtype_handler("fp8") is None  # built-ins have no handler
    assert get_kv_quant_mode("plat-c8") is KVQuantMode.CUSTOM
    assert is_quantized_kv_cache("plat-c8") and not kv_cache_uses_per_token_head_scales("plat-c8")
    assert kv_cache_uses_per_token_head_scales("plat-ith")
    assert CacheConfig(cache_dtype="plat-c8").cache_dtype == "plat-c8"  # type: ignore[arg-type]


@pytest.mark.usefixtures("registered")
def test_a_generic_mode_keeps_that_modes_pages_and_a_custom_one_plain_rows() -> None:
    ith = get_kv_cache_specs(LLAMA_LIKE, "plat-ith", 16)
    int8 = get_kv_cache_specs(LLAMA_LIKE, "int8_per_token_head", 16)
    assert [s.page_size_bytes for s in ith.values()] == [s.page_size_bytes for s in int8.values()]
    assert find_format("plat-ith").cache_kind is CacheKind.INT8_PER_TOKEN_HEAD  # type: ignore[union-attr]
    custom = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.int8,
        kv_quant_mode=KVQuantMode.CUSTOM,
    )  # fmt: skip
    assert custom.kv_cache_format.name == "plat-c8"
    assert custom.page_size_bytes == 16 * 8 * 2 * 128
    for name in ("plat-c8", "plat-ith"):  # the op parses its own names: no kernel
        with pytest.raises(ValueError, match=f"format '{name}' has no kernel support"):
            kernel_cache_kind(name)


@pytest.mark.usefixtures("registered")
def test_registering_again_warns_and_replaces(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        register_kv_cache_dtype("plat-c8")(ReusesInt8PerTokenHead)
    assert "The kv-cache-dtype 'plat-c8' already exists" in caplog.text
    assert get_kv_quant_mode("plat-c8") is KVQuantMode.INT8_PER_TOKEN_HEAD


def test_errors() -> None:
    with pytest.raises(ValueError, match="fp8: expected a new kv_cache_dtype name, got a built-in"):
        register_kv_cache_dtype("fp8")(CustomInt8)
    assert get_kv_quant_mode("fp8") is KVQuantMode.FP8_PER_TENSOR

    class NotAHandler:
        pass

    with pytest.raises(ValueError, match="x: expected a handler with name, torch_dtype"):
        register_kv_cache_dtype("x")(NotAHandler)
    with pytest.raises(ValueError, match="name: expected a dtype registered by a handler"):
        unregister_kv_cache_dtype("fp8")
    with pytest.raises(ValueError, match="cache_dtype: Invalid kv_cache_dtype: 'not-a-dtype'"):
        CacheConfig(cache_dtype="not-a-dtype")  # type: ignore[arg-type]
    assert find_format("x") is None
