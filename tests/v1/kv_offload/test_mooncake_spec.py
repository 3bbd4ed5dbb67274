"""MooncakeOffloadingSpec and MooncakeLoadStoreSpec: options and validation (no store needed)."""

from __future__ import annotations

import pytest
import torch

from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
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


def mooncake_spec(extra: dict) -> MooncakeOffloadingSpec:
    transfer = KVTransferConfig(kv_connector_extra_config=extra)
    return MooncakeOffloadingSpec(VllmConfig(kv_transfer_config=transfer), kv_config())


def test_page_format_follows_the_options() -> None:
    extra = {"model": "m", "kv_cache_dtype": "auto", "block_size_factor": 2, "tp_rank": 1}
    spec = mooncake_spec(extra)
    page_format = spec.page_format()
    assert page_format.block_size_factor == 2 and page_format.tp_rank == 1
    assert page_format.block_bytes == 2 * 16 * 2 * 128 * 2
    other = mooncake_spec({**extra, "model": "n"}).page_format()
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
        mooncake_spec(extra)


def test_lookup_needs_registered_caches() -> None:
    spec = mooncake_spec({"model": "m"})
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
