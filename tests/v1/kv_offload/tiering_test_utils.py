"""Helpers of the tiering tests: engine configs, shared offload regions, waiting for jobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import torch

from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion


class StubSpec(OffloadingSpec):
    """An offloading spec with no manager or handlers of its own (tiers read its configs)."""

    def get_manager(self):  # type: ignore[override]
        raise NotImplementedError

    def get_handlers(self, kv_caches) -> Iterator:  # type: ignore[override]
        yield from ()


def stub_spec(
    specs: dict[str, FullAttentionSpec] | None = None, cache_dtype: str = "auto"
) -> StubSpec:
    """A spec over one KV-cache group of ``specs`` (default: one bf16 layer), one tensor each."""
    specs = specs or {
        "l0": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    }
    config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[
            KVCacheTensor(size=4 * s.page_size_bytes, shared_by=[n]) for n, s in specs.items()
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(specs), next(iter(specs.values())))],
    )
    vllm_config = VllmConfig(
        model_config=ModelConfig(model="org/model"),
        cache_config=CacheConfig(block_size=16, cache_dtype=cache_dtype),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both"),
    )
    return StubSpec(vllm_config, config)


def region(num_blocks: int, cpu_page_size: int, rank: int | None, workers: int = 1, name=""):
    """A shared offload region (``name`` joins an existing one; empty: a fresh one)."""
    return SharedOffloadRegion(
        instance_id=name or f"test_{uuid.uuid4().hex}",
        total_size_bytes=num_blocks * cpu_page_size * workers,
        num_blocks=num_blocks,
        rank=rank,
        num_workers=workers,
        cpu_page_size=cpu_page_size,
    )


def wait_until(done: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached in time")
        time.sleep(0.005)
