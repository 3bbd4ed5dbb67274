"""The HiSparse connector's scheduler side: one step out and back with a real KV cache
manager, and the error paths upstream's tests do not pin."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.v1.core.block_manager_test_utils import make_request
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
    HiSparseConnector,
    HiSparseConnectorScheduler,
    HiSparseConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.stats import HiSparseKVConnectorStats
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
)

BLOCK = 16


def _manager() -> KVCacheManager:
    source = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        hisparse_host_num_blocks=16,
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["s"], source, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True
            ),
            KVCacheGroupSpec(["r"], HiSparseResidentSpec(block_size=BLOCK, page_size=64)),
            KVCacheGroupSpec(
                ["h"], HiSparseHotSpec(block_size=BLOCK, page_size=64, blocks_per_request=2)
            ),
        ],
    )
    return KVCacheManager(config, max_model_len=128, hash_block_size=BLOCK)


def test_worker_reports_add_up() -> None:
    first = HiSparseConnectorWorkerMetadata({1: 1}, {1: 1}, (7,))
    second = HiSparseConnectorWorkerMetadata({1: 1, 2: 1}, {}, (7, 8))
    total = first.aggregate(second)
    assert total.enqueued_transfer_counts == {1: 2, 2: 1}
    assert total.completed_transfer_counts == {1: 1}
    assert sorted(total.completed_host_copy_dst_ids) == [7, 8]
    with pytest.raises(TypeError, match="other: expected HiSparseConnectorWorkerMetadata"):
        first.aggregate(object())  # type: ignore[arg-type]


def test_scheduler_needs_one_coordinator() -> None:
    scheduler = HiSparseConnectorScheduler(async_speculative=False)
    assert scheduler.get_kv_connector_stats() is None
    with pytest.raises(ValueError, match="coordinator: expected bind_coordinator first"):
        scheduler.build_connector_meta(SimpleNamespace())
    scheduler.bind_coordinator(get_hisparse_coordinator(_manager()))
    with pytest.raises(ValueError, match="coordinator: expected one binding"):
        scheduler.bind_coordinator(get_hisparse_coordinator(_manager()))
    with pytest.raises(ValueError, match="draft_kv_lookahead: expected >= 0"):
        HiSparseConnectorScheduler(async_speculative=False, draft_kv_lookahead=-1)
    with pytest.raises(TypeError, match="draft_kv_lookahead: expected an int"):
        HiSparseConnectorScheduler(async_speculative=False, draft_kv_lookahead=True)


def test_connector_is_scheduler_side_only() -> None:
    config = SimpleNamespace(
        speculative_config=None, scheduler_config=SimpleNamespace(async_scheduling=True)
    )
    kv_cache_config = _manager().kv_cache_config
    with pytest.raises(ValueError, match="role: expected the scheduler role"):
        HiSparseConnector(config, "worker", kv_cache_config)
    connector = HiSparseConnector(config, SimpleNamespace(name="SCHEDULER"), kv_cache_config)
    assert connector.connector_scheduler is not None
    assert not connector.connector_scheduler.async_speculative  # no drafter
    with pytest.raises(ValueError, match="hisparse_host_num_blocks: expected a HiSparse host"):
        HiSparseConnector(
            config,
            "scheduler",
            KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[]),
        )


def test_one_step_out_and_back() -> None:
    manager = _manager()
    connector = HiSparseConnector(
        SimpleNamespace(
            speculative_config=None, scheduler_config=SimpleNamespace(async_scheduling=False)
        ),
        "scheduler",
        manager.kv_cache_config,
    )
    connector.bind_kv_cache_manager(manager)
    coordinator = get_hisparse_coordinator(manager)
    request = make_request("r", list(range(3 * BLOCK)), BLOCK)
    blocks = manager.allocate_slots(request, 3 * BLOCK)
    assert blocks is not None
    connector.update_state_after_alloc(request, blocks, 0)
    output = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id="r", num_computed_tokens=0, block_ids=blocks.get_block_ids())
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[]),
        num_scheduled_tokens={"r": 3 * BLOCK},
    )
    meta = connector.build_connector_meta(output)
    assert output.has_sync_kv_loads
    assert meta.source_block_ids == tuple(blocks.get_block_ids()[0])
    assert meta.command is not None and len(meta.command.page_transfers) == 3
    assert sum(m.num_rows for m in meta.row_mirrors["r"]) == 3 * BLOCK
    assert meta.all_context_pages_resident
    assert meta.residency_updates["r"].pages == [0, 1, 2]
    assert connector.has_pending_push_work()
    counts = {t.transfer_id: 1 for t in meta.command.page_transfers}
    connector.update_connector_output(
        SimpleNamespace(
            finished_recving=None,
            failed_recving=None,
            kv_connector_worker_meta=HiSparseConnectorWorkerMetadata(counts, counts),
        )
    )
    assert not coordinator.pending_spills and not connector.has_pending_push_work()
    assert coordinator.request_states["r"].ready_prefix_pages == 3
    stats = connector.get_kv_connector_stats()
    assert stats is not None and stats.data["pending_page_transfers"] == [0]
    with pytest.raises(TypeError, match="kv_connector_worker_meta: expected"):
        connector.update_connector_output(
            SimpleNamespace(finished_recving=None, failed_recving=None, kv_connector_worker_meta=1)
        )
    assert connector.request_finished_all_groups(request, ()) == (False, None)


def test_stats_refuse_unknown_metrics() -> None:
    stats = HiSparseKVConnectorStats()
    with pytest.raises(ValueError, match="other.data: expected keys among"):
        stats.aggregate(HiSparseKVConnectorStats(data={"bogus": [1]}))
