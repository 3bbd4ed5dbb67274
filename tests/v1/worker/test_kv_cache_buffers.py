"""The raw KV-cache buffers (``vllm/v1/worker/gpu/kv_cache_buffers.py``): every layer covered
by exactly one ``KVCacheTensor``, and each layer's buffer num_blocks whole pages of its spec,
checked before anything is allocated (``_allocate_kv_cache``, ``init_layer_kv_caches``, and
``_reshape_kv_cache`` for caller-given buffers)."""

from __future__ import annotations

import pytest
import torch
from kv_cache_test_utils import attn_spec, one_group

from vllm.v1.attention.backends import ReferenceAttentionBackend
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, KVQuantMode
from vllm.v1.worker.gpu.attn_utils import _reshape_kv_cache, init_layer_kv_caches
from vllm.v1.worker.gpu.kv_cache_buffers import _allocate_kv_cache


def test_uncovered_layer_is_an_error() -> None:
    spec = attn_spec()
    config = KVCacheConfig(
        num_blocks=1,
        kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes, shared_by=["a"])],
        kv_cache_groups=[KVCacheGroupSpec(["a", "b", "c"], spec)],
    )
    with pytest.raises(ValueError, match=r"no KVCacheTensor covers layer\(s\) b, c"):
        _allocate_kv_cache(config, "meta")


def test_layer_named_by_two_tensors_is_an_error() -> None:
    spec = attn_spec()
    config = KVCacheConfig(
        num_blocks=1,
        kv_cache_tensors=[
            KVCacheTensor(size=spec.page_size_bytes, shared_by=["a"]),
            KVCacheTensor(size=spec.page_size_bytes, shared_by=["a"]),
        ],
        kv_cache_groups=[KVCacheGroupSpec(["a"], spec)],
    )
    with pytest.raises(ValueError, match=r"'a' is named by kv_cache_tensors\[0\] and .*\[1\]"):
        _allocate_kv_cache(config, "meta")


def test_other_config_errors() -> None:
    spec = attn_spec()
    unknown = KVCacheConfig(
        num_blocks=1,
        kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes, shared_by=["a", "ghost"])],
        kv_cache_groups=[KVCacheGroupSpec(["a"], spec)],
    )
    with pytest.raises(ValueError, match=r"name layer\(s\) ghost that are in no KV-cache group"):
        _allocate_kv_cache(unknown, "meta")
    two_groups = KVCacheConfig(
        num_blocks=1,
        kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes, shared_by=["a"])],
        kv_cache_groups=[KVCacheGroupSpec(["a"], spec), KVCacheGroupSpec(["a"], spec)],
    )
    with pytest.raises(ValueError, match="in KV-cache groups 0 and 1"):
        _allocate_kv_cache(two_groups, "meta")
    negative = one_group(spec, -1)
    with pytest.raises(ValueError, match=r"kv_cache_tensors\[0\].size"):
        _allocate_kv_cache(negative, "meta")


def _nvfp4_config(size: int, num_blocks: int = 8) -> KVCacheConfig:
    """One NVFP4 layer ``layer.0`` of 9216-byte pages (N=16, H=8, D=64)."""
    spec = attn_spec(
        num_kv_heads=8, head_size=64, dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4
    )
    assert spec.page_size_bytes == 9216
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=size, shared_by=["layer.0"])],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (8 * 9216 - 3, r"kv_cache_tensors\[0\].size: expected 8 pages x 9216 bytes = 73728 "
         r"bytes for layer 'layer.0', got 73725"),
        (4 * 9216, r"kv_cache_tensors\[0\].size: expected 8 pages x 9216 bytes = 73728 bytes "
         r"for layer 'layer.0', got 36864"),
        (8 * 9216 + 100, r"kv_cache_tensors\[0\].size: expected a whole number of 9216-byte "
         r"pages \(at least 8\) for layer 'layer.0', got 73828 bytes = 8 pages \+ 100 bytes"),
    ],
    ids=["3_bytes_short", "half", "partial_page"],
)  # fmt: skip
def test_tensor_size_mismatch_is_an_error_before_allocation(
    size: int, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor short of num_blocks pages once gave a 7- or 4-page cache for num_blocks=8."""
    config = _nvfp4_config(size)

    def no_allocation(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("allocated before the size check")

    with monkeypatch.context() as patch:
        patch.setattr(torch, "zeros", no_allocation)
        with pytest.raises(ValueError, match=message):
            init_layer_kv_caches(config, [ReferenceAttentionBackend], "cpu", cache_dtype="nvfp4")
        with pytest.raises(ValueError, match=message):
            _allocate_kv_cache(config, "meta")


def test_tensor_with_more_whole_pages_is_allowed() -> None:
    """As upstream: a layer's page count is its buffer's whole pages, at least num_blocks."""
    cache = init_layer_kv_caches(
        _nvfp4_config(10 * 9216), [ReferenceAttentionBackend], "cpu", cache_dtype="nvfp4"
    )
    assert cache["layer.0"].shape[0] == 10
    empty = init_layer_kv_caches(_nvfp4_config(0, 0), [ReferenceAttentionBackend], "cpu")
    assert empty["layer.0"].shape[0] == 0


def test_raw_buffer_short_of_num_blocks_is_an_error() -> None:
    config = _nvfp4_config(8 * 9216)
    raw = {"layer.0": torch.zeros(7 * 9216, dtype=torch.int8, device="meta")}
    with pytest.raises(
        ValueError,
        match=r"kv_cache_raw_tensors\['layer.0'\]: expected 8 pages x 9216 bytes = 73728 bytes "
        r"for layer 'layer.0', got 64512",
    ):
        _reshape_kv_cache(config, raw, [ReferenceAttentionBackend])
