"""The device prefix cache drives the offload tier through the block hasher's hashes: a page
evicted from the BlockPool is found in the CPU tier by its block hash and loaded back byte-exact,
for every cache format."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import pytest
import torch
from test_mooncake_tier import FakeClient, FakeStore
from tiering_test_utils import FORMATS, stub_spec, wait_until, worker_pages

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_events import BlockRemoved
from vllm.kv_quant.formats import lookup
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    ReqContext,
    get_offload_block_hash,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import CpuGpuOffloadingHandlers
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.prefix_offload import PrefixCacheOffloader, request_offload_keys
from vllm.v1.kv_offload.tiering.mooncake import manager as mooncake_tier
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.kv_offload.worker.page_views import canonicalize_kv_caches
from vllm.v1.kv_offload.worker.worker import OffloadingWorker
from vllm.v1.request import Request

try:
    from vllm import _custom_ops as ops
except ImportError:  # pragma: no cover - the extension is built in CI
    pytest.skip("vllm._custom_ops (the compiled extension) is not built", allow_module_level=True)

CTX_B = ReqContext(req_id="b")
BS = 16  # tokens per block, the pages' block size
NUM_BLOCKS = 6  # device pages (worker_pages makes six), block 0 is the pool's null block


def _request(tokens: list[int], rid: str) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256_cbor),
    )


class Engine:
    """A device pool over real pages of one format, a CPU tier and the worker that copies."""

    def __init__(self, cache_dtype: str, secondary_tiers: list[dict] | None = None) -> None:
        fmt = lookup(cache_dtype)
        assert fmt.storage_dtype is not None
        spec = FullAttentionSpec(
            block_size=BS,
            num_kv_heads=2,
            head_size=64,
            dtype=fmt.storage_dtype,
            kv_quant_mode=fmt.quant_mode,
        )
        names = ["layers.0.attn", "layers.1.attn"]
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[
                KVCacheTensor(size=NUM_BLOCKS * spec.page_size_bytes, shared_by=[n]) for n in names
            ],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        )
        pages, _ = worker_pages(cache_dtype, seed=3)
        raw = [p.reshape(-1).view(torch.int8).clone() for p in pages]
        self.pages = [r.view(torch.uint8).view(NUM_BLOCKS, -1) for r in raw]
        canonical = canonicalize_kv_caches(dict(zip(names, raw, strict=True)), config)
        manager: OffloadingManager
        if secondary_tiers is None:
            manager = CPUOffloadingManager(4)
            handlers = CpuGpuOffloadingHandlers(
                canonical, block_size_factor=1, num_cpu_blocks=4, swap_blocks=ops.swap_blocks
            )
        else:
            spec_name = {"spec_name": "TieringOffloadingSpec", "num_cpu_blocks": 4}
            transfer = KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={**spec_name, "secondary_tiers": secondary_tiers},
            )
            vllm_config = dataclasses.replace(
                stub_spec(dict.fromkeys(names, spec), cache_dtype).vllm_config,
                kv_transfer_config=transfer,
                instance_id=f"test_{uuid.uuid4().hex}",
            )
            tiering = OffloadingSpecFactory.create_spec(vllm_config, config)
            assert isinstance(tiering, TieringOffloadingSpec)
            tiering.swap_blocks = ops.swap_blocks
            manager = tiering.get_manager()
            handlers = tiering.create_handlers(canonical)
        self.manager, self.handlers = manager, handlers
        self.worker = OffloadingWorker()
        self.worker.register_handler(
            GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu_handler
        )
        self.worker.register_handler(
            CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu_handler
        )
        self.pool = BlockPool(NUM_BLOCKS, True, BS, enable_kv_cache_events=True)
        self.offloader = PrefixCacheOffloader(self.pool, manager, BS)
        self.jobs = 0

    def run(self, spec) -> None:
        self.jobs += 1
        assert self.worker.transfer_async(self.jobs, spec)
        self.worker.wait({self.jobs})
        assert [r.success for r in self.worker.get_finished()] == [True]

    def page_bytes(self, block_id: int) -> list[bytes]:
        return [p[block_id].numpy().tobytes() for p in self.pages]

    def store_prefix(self, request: Request, num_blocks: int) -> list[list[bytes]]:
        """Cache the request's first blocks on the device, store them in the tier; the bytes
        the pages held."""
        blocks = self.pool.get_new_blocks(num_blocks)
        written = [self.page_bytes(b.block_id) for b in blocks]
        self.pool.cache_full_blocks(request, blocks, 0, num_blocks, BS, 0)
        store = self.offloader.plan_store(request, blocks, 0, num_blocks)
        assert store is not None and store.keys == request_offload_keys(request, 0)[:num_blocks]
        self.run(store.spec)
        self.offloader.complete_store(request, store)
        self.pool.free_blocks(reversed(blocks))
        return written

    def close(self) -> None:
        self.worker.shutdown()
        self.handlers.shutdown()
        self.manager.shutdown()


@pytest.fixture(autouse=True)
def _seed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    init_none_hash(sha256_cbor)
    yield


@pytest.mark.parametrize("cache_dtype", FORMATS)
def test_evicted_pages_come_back_by_hash_byte_exact(cache_dtype: str) -> None:
    e = Engine(cache_dtype)
    tokens = list(range(2 * BS + 5))  # two full blocks
    a = _request(tokens, "a")
    blocks = e.pool.get_new_blocks(2)
    written = [e.page_bytes(b.block_id) for b in blocks]  # what the model wrote there
    e.pool.cache_full_blocks(a, blocks, 0, 2, BS, 0)
    store = e.offloader.plan_store(a, blocks, 0, 2)
    assert store is not None and store.keys == request_offload_keys(a, 0)
    e.run(store.spec)
    e.offloader.complete_store(a, store)
    assert e.offloader.plan_store(a, blocks, 0, 2) is None  # the tier has them already

    # Other requests take every page: a's pages are evicted and overwritten.
    e.pool.free_blocks(reversed(blocks))
    others = e.pool.get_new_blocks(NUM_BLOCKS - 1)
    for p in e.pages:
        p[1:].fill_(0xA5)
    assert all(e.pool.get_cached_block(h, [0]) is None for h in a.block_hashes)
    removed = [ev for ev in e.pool.take_events() if isinstance(ev, BlockRemoved)]
    assert [ev.block_hashes[0] for ev in removed] == a.block_hashes[::-1]
    e.pool.free_blocks(others)

    # Same prompt, new request: the device misses, the tier hits by the same hashes.
    b = _request(tokens, "b")
    assert [get_offload_block_hash(k) for k in request_offload_keys(b, 0)] == a.block_hashes
    load = e.offloader.plan_load(b, num_computed_blocks=0)
    assert load is not None and len(load.blocks) == 2 and all(x.ref_cnt == 1 for x in load.blocks)
    e.run(load.spec)
    e.offloader.complete_load(b, load)
    assert [e.page_bytes(x.block_id) for x in load.blocks] == written
    # Loaded pages are device prefix hits again.
    assert [e.pool.get_cached_block(h, [0]) for h in b.block_hashes] == [[x] for x in load.blocks]
    e.worker.shutdown()


def test_load_stops_at_the_first_block_the_tier_lacks_and_at_free_blocks() -> None:
    e = Engine("bfloat16")
    a = _request(list(range(3 * BS)), "a")
    blocks = e.pool.get_new_blocks(3)
    e.pool.cache_full_blocks(a, blocks, 0, 3, BS, 0)
    # Only the first two blocks reach the tier.
    store = e.offloader.plan_store(a, blocks[:2] + [e.pool.null_block], 0, 3)
    assert store is not None and store.keys == request_offload_keys(a, 0)[:2]
    e.run(store.spec)
    e.offloader.complete_store(a, store)
    b = _request(list(range(3 * BS)), "b")
    # Block 0 is a device hit; the tier serves block 1 only (block 2 was never stored).
    e.offloader.touch(b, 1)
    load = e.offloader.plan_load(b, num_computed_blocks=1)
    assert (
        load is not None
        and load.start == 1
        and load.keys == [make_offload_key(b.block_hashes[1], 0)]
    )
    assert load.dst.block_indices == [1]  # type: ignore[attr-defined]
    e.offloader.complete_load(b, load, success=False)
    assert e.pool.get_num_free_blocks() == 2  # the failed load's block went back
    e.pool.get_new_blocks(2)
    assert e.offloader.plan_load(b, num_computed_blocks=0) is None  # no free device block
    e.worker.shutdown()


def test_argument_errors() -> None:
    pool = BlockPool(4, True, BS)
    with pytest.raises(ValueError, match="block_size: expected the pool's hash block size 16"):
        PrefixCacheOffloader(pool, CPUOffloadingManager(2), 32)
    a = _request(list(range(BS)), "a")
    with pytest.raises(ValueError, match="hash_block_size_factor: expected a positive int"):
        request_offload_keys(a, 0, 0)
    offloader = PrefixCacheOffloader(pool, CPUOffloadingManager(2), BS)
    with pytest.raises(ValueError, match="num_full_blocks: expected at most 1 hashed"):
        offloader.plan_store(a, pool.get_new_blocks(2), 0, 2)


def test_keys_of_larger_offloaded_blocks_are_their_last_hash() -> None:
    a = _request(list(range(5 * BS)), "a")
    keys = request_offload_keys(a, 2, hash_block_size_factor=2)
    assert keys == [make_offload_key(a.block_hashes[i], 2) for i in (1, 3)]
    assert request_offload_keys(a, 2, 2, start=1) == keys[1:]


MOONCAKE = [{"type": "mooncake", "mooncake": {"master_server_address": "127.0.0.1:1"}}]


@pytest.mark.parametrize("cache_dtype", FORMATS)
def test_another_instance_finds_the_prefix_in_mooncake_by_hash(
    cache_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FakeStore()
    monkeypatch.setattr(FakeClient, "store", store)
    monkeypatch.setattr(mooncake_tier, "MooncakeStoreClient", FakeClient)
    tokens = list(range(2 * BS + 3))
    writer = Engine(cache_dtype, MOONCAKE)
    reader = Engine(cache_dtype, MOONCAKE)
    try:
        written = writer.store_prefix(_request(tokens, "a"), 2)

        def cascaded() -> bool:
            list(writer.manager.take_events())  # an engine step: collect the tier's jobs
            return len(store.objects) == 2

        wait_until(cascaded)
        for p in reader.pages:
            p.fill_(0x5A)  # the reader's device pages hold something else
        b = _request(tokens, "b")
        # Not in the reader's CPU tier: the first ask starts the promotions from Mooncake.
        assert reader.offloader.plan_load(b, 0) is None

        def promoted() -> bool:
            list(reader.manager.take_events())
            return all(
                reader.manager.lookup(k, CTX_B) is LookupResult.HIT
                for k in request_offload_keys(b, 0)
            )

        wait_until(promoted)
        load = reader.offloader.plan_load(b, 0)
        assert load is not None and len(load.blocks) == 2
        reader.run(load.spec)
        reader.offloader.complete_load(b, load)
        assert [reader.page_bytes(x.block_id) for x in load.blocks] == written
        assert reader.pool.get_cached_block(b.block_hashes[1], [0]) == [load.blocks[1]]
    finally:
        writer.close()
        reader.close()
