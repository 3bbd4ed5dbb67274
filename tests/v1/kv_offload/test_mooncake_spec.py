"""MooncakeOffloadingSpec and MooncakeLoadStoreSpec: options and validation (no store needed)."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.mooncake import MooncakeOffloadingSpec
from vllm.v1.kv_offload.worker.mooncake_store import MooncakeLoadStoreSpec, block_hash_hex


def kv_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[KVCacheTensor(4 * spec.page_size_bytes, ["a"])],
        kv_cache_groups=[KVCacheGroupSpec(["a"], spec)],
    )


def test_page_format_follows_the_options() -> None:
    extra = {"model": "m", "kv_cache_dtype": "auto", "block_size_factor": 2, "tp_rank": 1}
    spec = MooncakeOffloadingSpec(kv_config(), 16, extra)
    page_format = spec.page_format()
    assert page_format.block_size_factor == 2 and page_format.tp_rank == 1
    assert page_format.block_bytes == 2 * 16 * 2 * 128 * 2
    other = MooncakeOffloadingSpec(kv_config(), 16, {**extra, "model": "n"}).page_format()
    assert other.fingerprint != page_format.fingerprint


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, r"extra_config\['model'\]: expected the model name"),
        ({"model": "m", "mooncake": {"protocol": "udp"}}, "protocol: expected one of"),
        ({"model": "m", "mooncake": {"master": "x"}}, "mooncake config: unknown keys"),
    ],
)
def test_bad_options_are_clear_errors(extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        MooncakeOffloadingSpec(kv_config(), 16, extra)


def test_lookup_needs_registered_caches() -> None:
    spec = MooncakeOffloadingSpec(kv_config(), 16, {"model": "m"})
    assert spec.handlers is None
    with pytest.raises(RuntimeError, match="register the KV cache first"):
        spec.lookup([b"\x01"])


def test_block_hashes() -> None:
    spec = MooncakeLoadStoreSpec([b"\x00\xff", 255])
    assert spec.medium() == "MOONCAKE"
    assert spec.hash_hex == ("00ff", "ff")
    assert block_hash_hex(-3) == "-3"
    with pytest.raises(ValueError, match="expected non-empty bytes"):
        MooncakeLoadStoreSpec([b""])
    with pytest.raises(ValueError, match="expected bytes or int hashes, got str"):
        MooncakeLoadStoreSpec(["ab"])  # type: ignore[list-item]
