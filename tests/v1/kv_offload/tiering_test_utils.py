"""Helpers of the tiering and offload tests: engine configs, shared offload regions, waiting
for jobs, every cache format's pages."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import torch

from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.kv_quant import per_token_head_write_cache
from vllm.kv_quant.formats import lookup
from vllm.utils.torch_utils import create_kv_caches_with_random_flash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion


class StubSpec(OffloadingSpec):
    """An offloading spec with no manager or worker of its own (tiers read its configs)."""

    def get_manager(self):  # type: ignore[override]
        raise NotImplementedError

    def get_worker(self, kv_caches):  # type: ignore[override]
        raise NotImplementedError


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
    """A shared offload region (``name`` joins an existing one; empty: a fresh one) whose rows
    hold ``workers`` cells of ``cpu_page_size`` bytes, padded to whole pages."""
    page = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
    return SharedOffloadRegion(
        engine_id=name or f"test_{uuid.uuid4().hex}",
        num_chunks=num_blocks,
        rank=rank,
        kv_bytes_per_chunk=-(-cpu_page_size * workers // page) * page,
        cpu_page_size=cpu_page_size,
    )


def wait_until(done: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached in time")
        time.sleep(0.005)


FORMATS = ["bfloat16", "fp8", "nvfp4", "int8_per_token_head", "fp8_per_token_head"]


def layer_caches(cache_dtype: str, seed: int) -> list[torch.Tensor]:
    """Two layers' ``(B, 2, N, H, F)`` caches in ``cache_dtype`` (per-token-head ones written
    by the format's codec, the others by the random-cache helper)."""
    fmt = lookup(cache_dtype)
    if not cache_dtype.endswith("per_token_head"):
        keys, _ = create_kv_caches_with_random_flash(
            6, 16, 2, 2, 64, cache_dtype, "bfloat16", seed=seed, device="cpu"
        )
        return [k._base if k._base is not None else k for k in keys]
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(2):
        assert fmt.storage_dtype is not None
        cache = torch.zeros((6, 2, 16, 2, fmt.last_dim(64)), dtype=fmt.storage_dtype)
        slots = torch.arange(6 * 16)
        for side in range(2):
            x = torch.randn((6 * 16, 2, 64), generator=g).to(torch.bfloat16)
            per_token_head_write_cache(x, cache[:, side], slots, cache_dtype)
        caches.append(cache)
    return caches


def worker_pages(cache_dtype: str, seed: int) -> tuple[list[torch.Tensor], list[int]]:
    """Two layers' caches in ``cache_dtype`` as ``[num_blocks, page bytes]`` uint8 tensors."""
    fmt = lookup(cache_dtype)
    assert fmt.storage_dtype is not None
    spec = FullAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype=fmt.storage_dtype,
        kv_quant_mode=fmt.quant_mode,
    )
    pages = []
    for cache in layer_caches(cache_dtype, seed):
        raw = cache.contiguous().view(torch.uint8).reshape(-1)
        assert raw.numel() == 6 * spec.page_size_bytes
        assert raw.count_nonzero() > raw.numel() // 2
        pages.append(raw.view(6, spec.page_size_bytes))
    return pages, [spec.page_size_bytes] * len(pages)
