"""The v0.33 offloading API as this library adds it: stats payloads, config-info records,
construction of specs from an OffloadingConfig or the v0.22 way, the medium worker, the
policy registry, and the error paths upstream's tests leave open."""

from __future__ import annotations

import time
from unittest.mock import MagicMock

import pytest
import torch
from test_cpu_gpu_handlers import (
    load_spec,
    make_config,
    store_spec,
    swap_blocks,
)

from vllm.config import CacheConfig, VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.v1.kv_offload.base import (
    ConfigInfo,
    LookupResult,
    Medium,
    OffloadingConnectorStats,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
from vllm.v1.kv_offload.cpu.host_register import host_register
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, ChunkStatus
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.file_mapper import canonical_format_id
from vllm.v1.kv_offload.worker.page_views import canonicalize_kv_caches
from vllm.v1.kv_offload.worker.worker import OffloadingWorker as HandlerRouter

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

CTX = ReqContext(req_id="r")


def offloading_config(**extra: object) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer",), 0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": 4 * 4096, **extra},
        engine_id="engine",
        model=OffloadingModelConfig("m", "float16", 64),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )


def engine_config(**extra: object) -> VllmConfig:
    return VllmConfig(
        cache_config=CacheConfig(block_size=16),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=dict(extra),
        ),
    )


def test_stats_payload_sums_counters_keeps_last_gauge_and_merges() -> None:
    stats = OffloadingConnectorStats()
    assert stats.is_empty()
    stats.increase_counter("c", 2)
    stats.increase_counter("c", 3)
    stats.increase_counter("c", 1, labelvalues=("x",))
    stats.set_gauge("g", 0.5)
    stats.set_gauge("g", 0.25)
    stats.observe_histogram("h", 4)
    other = OffloadingConnectorStats()
    other.increase_counter("c", 10)
    other.set_gauge("g", 1.0)
    other.observe_histogram("h", 6)
    other.set_info([{"cpu_num_chunks": 3}])
    assert stats.aggregate(other) is stats
    assert stats.reduce() == {
        "c": 15,
        "c:('x',)": 1,
        "g": 1.0,
        "h_count": 2,
        "h_sum": 10,
    }
    assert stats.data["info"] == [{"cpu_num_chunks": 3}]
    with pytest.raises(ValueError, match="g: expected a gauge metric, got a counter"):
        stats.increase_counter("g")


def test_config_info_publishes_none_as_text() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Info(ConfigInfo):
        size: int
        tokens: int | None

    assert Info.config_info_keys() == ("size", "tokens")
    assert Info(3, None).as_config_info() == {"size": 3, "tokens": "None"}


def test_v022_names_and_event_medium_stay_usable() -> None:
    assert BlockStatus is ChunkStatus and ChunkStatus(5).block_id == 5
    assert Medium.CPU == "CPU"  # v0.22 events carried the medium's name
    event = OffloadingEvent(keys=[], medium=Medium.CPU, removed=False)
    assert not event.metadata_only and event.ownership is None


def test_policy_registry_rejects_a_class_that_is_no_policy() -> None:
    with pytest.raises(TypeError, match="expected a CachePolicy subclass"):
        CachePolicyFactory.get_cache_policy_cls("ReqContext", "vllm.v1.kv_offload.base")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, TypeError, "expected exactly one of num_chunks / num_blocks"),
        ({"num_chunks": 2, "num_blocks": 2}, TypeError, "expected exactly one"),
        ({"num_chunks": -1}, ValueError, "num_chunks: expected an int >= 0, got -1"),
        ({"num_chunks": 2, "max_tracker_size": 0}, ValueError, "max_tracker_size: expected"),
        ({"num_chunks": 2, "cache_policy": "mru"}, ValueError, "Unknown cache policy: 'mru'"),
    ],
)
def test_manager_rejects_bad_arguments(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        CPUOffloadingManager(**kwargs)


def test_manager_v022_size_name_and_access_after_finish() -> None:
    manager = CPUOffloadingManager(num_blocks=2)
    key = make_offload_key(b"k", 0)
    ctx = ReqContext(req_id="done")
    out = manager.prepare_store([key], ctx)
    assert out is not None and out.store_spec.block_ids.tolist() == [0]  # type: ignore[attr-defined]
    manager.complete_store([key], ctx)
    manager.on_request_finished(ctx)
    with pytest.raises(RuntimeError, match="request 'done': accessed after it finished"):
        manager.prepare_store([make_offload_key(b"new", 0)], ctx)
    assert manager.lookup(key, CTX) is LookupResult.HIT


def test_spec_construction_checks_its_arguments() -> None:
    config = offloading_config()
    with pytest.raises(TypeError, match="kv_cache_config: expected None with an OffloadingConfig"):
        CPUOffloadingSpec(config, make_config())
    with pytest.raises(TypeError, match="kv_cache_config: expected a KVCacheConfig"):
        CPUOffloadingSpec(engine_config(num_cpu_blocks=2))


def test_v022_construction_derives_the_offloading_config() -> None:
    kv_cache_config = make_config()
    spec = OffloadingSpecFactory.create_spec(
        engine_config(num_cpu_blocks=3, blocks_per_chunk=2), kv_cache_config
    )
    assert isinstance(spec, CPUOffloadingSpec)
    config = spec.config
    page = kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    assert config.worker_kv_bytes_per_block == 2 * page  # two layers, one tensor each
    assert config.model.name == "unknown" and config.model.max_model_len == 0
    assert config.groups[0].layer_names == ("layers.0.attn", "layers.1.attn")
    assert spec.block_size_factor == spec.blocks_per_chunk == 2
    assert spec.gpu_block_size == spec.tokens_per_block == (16,)
    assert spec.num_blocks == spec.num_chunks == 3
    assert spec.vllm_config is not None and spec.kv_cache_config is kv_cache_config
    (info,) = spec.get_manager().config_info()
    assert info["cpu_num_chunks"] == 3 and info["cpu_kv_cache_size_tokens"] == "None"


def test_a_spec_needs_a_worker_and_a_manager() -> None:
    class ManagerOnly(OffloadingSpec):
        def get_manager(self) -> OffloadingManager:
            raise AssertionError("not called")

    with pytest.raises(TypeError, match="get_worker"):
        ManagerOnly(offloading_config())  # type: ignore[abstract]


def wait_all(worker: CPUOffloadingWorker | HandlerRouter, n: int) -> list:
    results: list = []
    deadline = time.monotonic() + 10
    while len(results) < n and time.monotonic() < deadline:
        results += worker.get_finished()
        time.sleep(0.001)
    return results


def test_cpu_worker_stores_and_loads_through_submit_calls() -> None:
    config = make_config()
    raw = [torch.randint(-128, 127, (t.size,), dtype=torch.int8) for t in config.kv_cache_tensors]
    kv = canonicalize_kv_caches(
        {t.shared_by[0]: r for t, r in zip(config.kv_cache_tensors, raw, strict=True)}, config
    )
    expected = [r.clone() for r in raw]
    worker = CPUOffloadingWorker(kv, 1, 4, swap_blocks=swap_blocks)
    try:
        assert worker.submit_store(1, *store_spec([2, 5], [0, 3]))
        assert [r.success for r in wait_all(worker, 1)] == [True]
        for r in raw:
            r.zero_()
        assert worker.submit_load(2, *load_spec([3, 0], [1, 2]), expedited=True)
        worker.wait({2})
        assert [r.job_id for r in wait_all(worker, 1)] == [2]
        page = config.kv_cache_tensors[0].size // config.num_blocks
        for got, want in zip(raw, expected, strict=True):
            assert torch.equal(got[page : 2 * page], want[5 * page : 6 * page])
            assert torch.equal(got[2 * page : 3 * page], want[2 * page : 3 * page])
    finally:
        worker.shutdown()
    # The canonical host layout needs every data reference's canonical mapping.
    with pytest.raises(ValueError, match="ref: expected a CanonicalKVCacheRef with a mapping"):
        CPUOffloadingWorker(kv, 1, 4, canonical_layout=True)


def test_v022_router_is_a_medium_worker() -> None:
    handler = MagicMock()
    handler.transfer_async.return_value = True
    router = HandlerRouter()
    src, dst = store_spec([0], [1])
    router.register_handler(type(src), type(dst), handler)
    router.register_handler(type(dst), type(src), handler)
    assert router.submit_store(7, src, dst)
    assert router.submit_load(8, dst, src, expedited=True)
    assert [c.args[0] for c in handler.transfer_async.call_args_list] == [7, 8]


def test_no_host_registration_without_cuda() -> None:
    buffer = torch.zeros(4096, dtype=torch.uint8)
    if torch.cuda.is_available():
        pytest.skip("registration succeeds on a CUDA machine")
    assert host_register(buffer.data_ptr(), 4096) is False
    assert host_register(0, 4096) is False


@pytest.mark.parametrize(
    ("layout", "expected"), [("LBNHC", "v1-nhd"), ("LBHNC", "v1-hnd"), ("NHD", "v1-nhd")]
)
def test_canonical_format_id(layout: str, expected: str) -> None:
    assert canonical_format_id(layout) == expected


def test_canonical_format_id_needs_a_layout() -> None:
    with pytest.raises(ValueError, match="kv_cache_layout: expected a layout name, got ''"):
        canonical_format_id("")
