"""Key sink rows live in their page (after its K and V rows), so every page mover moves them:
pages with sinks copied by ``swap_blocks``, offloaded to CPU memory and back, or stored in the
file-system tier and loaded again give bit-identical attention to the pages never moved, for
every format that keeps sinks. (The Mooncake store and P2P transfer move the same page bytes:
tests/distributed/kv_transfer/mooncake, format ``nvfp4_sinks``; prefix caching:
tests/real_kv_samples/test_prefix_sharing.py.)"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_offload.tiering_test_utils import stub_spec
from vllm.kv_quant import KeyRope, KVScaleObserver
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import CpuGpuOffloadingHandlers
from vllm.v1.kv_offload.tiering.base import JobMetadata
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.worker.page_views import build_kv_cache_page_views, canonicalize_kv_caches
from vllm.v1.worker.attention_kv_cache import AttentionKVCache

ops = pytest.importorskip("vllm._custom_ops")

H, HQ, D, BLOCK, PAGES, TOKENS = 2, 4, 64, 16, 8, 40
ROPE = KeyRope.from_base(D, 128)
SRC, DST = [3, 5, 6], [1, 4, 7]
"""The sequence's pages as written, and where the movers put them."""

ENCODINGS = [
    "fp8_e4m3+sink",
    "fp8_e5m2/head+sink",
    "nvfp4+sink2",
    "nvfp4_mse+offset+prerope+sink",
]


def _queries(encoding: str) -> torch.Tensor:
    return torch.randn(TOKENS, HQ, D, generator=torch.Generator().manual_seed(len(encoding)))


def _reference(encoding: str) -> tuple[AttentionKVCache, torch.Tensor]:
    """A calibrated CPU_ATTN cache of random page bytes with the sequence written into pages
    :data:`SRC`, and the attention of :func:`_queries` over them."""
    gen = torch.Generator().manual_seed(len(encoding) + 1)
    k = torch.randn(TOKENS, H, D, generator=gen) * 2 + 3  # a large first key: sinks matter
    v = torch.randn(TOKENS, H, D, generator=gen)
    prerope = "+prerope" in encoding
    cache = AttentionKVCache.create(
        encoding, PAGES, BLOCK, H, D, num_heads=HQ, model_dtype=torch.float32,
        key_rope=ROPE if prerope else None,
    )  # fmt: skip
    positions = torch.arange(TOKENS)
    if cache.encoding.key.offset:
        cache.set_key_offset(ROPE.unrotate(k, positions).mean(0))
    observer = KVScaleObserver(per_head=cache.encoding.per_head_scales)
    observer.observe(cache.stored_key(k, positions if prerope else None), v)
    cache.set_kv_scales(*observer.scales(cache.encoding.format.name))
    _scramble(_pages(cache), list(range(PAGES)), 0)
    meta = cache.metadata([TOKENS], [TOKENS], torch.tensor([SRC]))
    cache.write(k, v, meta.slot_mapping, positions)
    assert cache.key_sinks is not None and cache.key_sinks[SRC[0]].any()
    return cache, cache.attend(_queries(cache.encoding.id), meta)


def _config(cache: AttentionKVCache) -> KVCacheConfig:
    spec = cache.spec
    return KVCacheConfig(
        num_blocks=PAGES,
        kv_cache_tensors=[KVCacheTensor(PAGES * spec.page_size_bytes, ["layer"])],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def _pages(cache: AttentionKVCache) -> torch.Tensor:
    """uint8 ``[B, page bytes]`` over the cache's storage: every byte a page holds."""
    return build_kv_cache_page_views({"layer": cache.kv_cache}, _config(cache))[0].pages


def _scramble(pages: torch.Tensor, blocks: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for b in blocks:
        pages[b] = torch.randint(0, 256, pages[b].shape, dtype=torch.uint8, generator=gen)


def _attend_moved(cache: AttentionKVCache, out: torch.Tensor) -> None:
    """Attention over the moved pages :data:`DST` is the original's, bit for bit; with the
    moved first page's sink rows scrambled it is not (they are read)."""
    meta = cache.metadata([TOKENS], [TOKENS], torch.tensor([DST]))
    q = _queries(cache.encoding.id)
    moved = cache.attend(q, meta)
    first_sinks = cache.key_sinks[DST[0]]  # type: ignore[index]
    first_sinks.copy_(first_sinks ^ 0x11)
    scrambled = cache.attend(q, meta)
    torch.testing.assert_close(moved, out, rtol=0, atol=0)
    assert not torch.equal(scrambled, out)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_swap_blocks_moves_the_sink_rows(encoding: str) -> None:
    cache, out = _reference(encoding)
    pages = _pages(cache)
    _scramble(pages, DST, 1)
    mapping = torch.tensor(list(zip(SRC, DST, strict=True)), dtype=torch.int64)
    ops.swap_blocks(pages, pages, cache.spec.page_size_bytes, mapping)
    _scramble(pages, SRC, 2)
    _attend_moved(cache, out)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_cpu_offload_round_trip_keeps_the_sink_rows(encoding: str) -> None:
    cache, out = _reference(encoding)
    handlers = CpuGpuOffloadingHandlers(
        canonicalize_kv_caches({"layer": cache.kv_cache}, _config(cache)),
        block_size_factor=1,
        num_cpu_blocks=4,
        swap_blocks=ops.swap_blocks,
    )
    store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
    assert store.transfer_async(1, (GPULoadStoreSpec(SRC, [3], [0]), CPULoadStoreSpec([2, 0, 1])))
    _finish(store.get_finished, 1)
    _scramble(_pages(cache), list(range(PAGES)), 3)  # every page, sink rows included
    assert load.transfer_async(2, (CPULoadStoreSpec([2, 0, 1]), GPULoadStoreSpec(DST, [3], [0])))
    _finish(load.get_finished, 2)
    _attend_moved(cache, out)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_the_file_system_tier_keeps_the_sink_rows(encoding: str, tmp_path) -> None:
    """Pages copied into primary rows, stored as block files, loaded into other rows and copied
    into other pages."""
    cache, out = _reference(encoding)
    pages = _pages(cache)
    rows = torch.zeros((6, pages.shape[1]), dtype=torch.uint8)
    spec = stub_spec({"layer": cache.spec}, cache_dtype=cache.encoding.id)
    tier = FileSystemTierManager(spec, memoryview(rows.numpy()), "fs_python", str(tmp_path), 2, 2)
    ctx = ReqContext(req_id="r")
    keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(3)]
    try:
        rows[:3] = pages[SRC]
        tier.submit_store(JobMetadata(1, keys, np.array([0, 1, 2]), False, ctx))
        _finish(tier.get_finished, 1)
        rows.fill_(0)
        tier.submit_load(JobMetadata(2, keys, np.array([5, 3, 4]), True, ctx))
        _finish(tier.get_finished, 2)
    finally:
        tier.shutdown()
    _scramble(pages, list(range(PAGES)), 4)
    pages[DST] = rows[[5, 3, 4]]
    _attend_moved(cache, out)


def _finish(get_finished: Callable[[], Iterable[Any]], job_id: int) -> None:
    """Poll until job ``job_id``, the only one in flight, has finished successfully."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        results = list(get_finished())
        if results:
            assert [(r.job_id, r.success) for r in results] == [(job_id, True)]
            return
        time.sleep(0.002)
    raise TimeoutError(f"job {job_id} did not finish")
