"""HiSparse block-manager behaviour upstream's tests do not pin: the registry's error paths,
the coordinator's config checks, the resident manager's residency overrides and the shared
event queue of the host pool."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from tests.v1.core.block_manager_test_utils import make_request
from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    HiSparseHotManager,
    HiSparseResidentManager,
    HiSparseSourceManager,
    manager_class_of,
)
from vllm.v1.hisparse.block_pool import SharedEventQueueBlockPool
from vllm.v1.hisparse.coordinator import HiSparseCoordinator, get_hisparse_coordinator
from vllm.v1.hisparse.types import SparseKVOffloadCommand
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_spec_registry import (
    _REGISTRY_KVCACHESPEC_LIST,
    KVCacheSpecRegistry,
    register_kv_cache_spec,
)

BLOCK = 16


@pytest.fixture(autouse=True)
def _restore_registry():
    KVCacheSpecRegistry._ensure_registered()
    saved = dict(_REGISTRY_KVCACHESPEC_LIST)
    yield
    _REGISTRY_KVCACHESPEC_LIST.clear()
    _REGISTRY_KVCACHESPEC_LIST.update(saved)


@dataclass(frozen=True, kw_only=True)
class _Orphan(KVCacheSpec):
    @property
    def page_size_bytes(self) -> int:
        return 1

    def max_memory_usage_bytes(self, vllm_config: object) -> int:
        return 0


def _source() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)


def _config(*, host_blocks: int | None = 16, source_first: bool = True) -> KVCacheConfig:
    source = KVCacheGroupSpec(
        ["source"], _source(), role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True
    )
    resident = KVCacheGroupSpec(["resident"], HiSparseResidentSpec(block_size=BLOCK, page_size=64))
    hot = KVCacheGroupSpec(
        ["hot"], HiSparseHotSpec(block_size=BLOCK, page_size=64, blocks_per_request=2)
    )
    groups = [source, resident, hot] if source_first else [resident, source, hot]
    return KVCacheConfig(
        num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups,
        hisparse_host_num_blocks=host_blocks,
    )  # fmt: skip


def _manager(config: KVCacheConfig, **kw: object) -> KVCacheManager:
    return KVCacheManager(config, max_model_len=128, hash_block_size=BLOCK, **kw)  # type: ignore[arg-type]


def test_registry_rejects_bad_registrations() -> None:
    with pytest.raises(AssertionError, match="manager_class is required"):
        KVCacheSpecRegistry.register(_Orphan)
    with pytest.raises(AssertionError, match="must inherit from its declared"):
        KVCacheSpecRegistry.register(_Orphan, FullAttentionManager, FullAttentionSpec)
    with pytest.raises(AssertionError, match="Conflicting registration"):
        KVCacheSpecRegistry.register(MLAAttentionSpec, HiSparseHotManager)
    with pytest.raises(AssertionError, match="Conflicting manager registration"):
        KVCacheSpecRegistry.register_role_manager(
            KVCacheGroupRole.HISPARSE_SOURCE, FullAttentionManager
        )
    # The same registration again is fine.
    KVCacheSpecRegistry.register(
        MLAAttentionSpec, FullAttentionManager, uniform_type_base_spec=FullAttentionSpec
    )


def test_unregistered_spec_has_no_manager() -> None:
    spec = _Orphan(block_size=4)
    with pytest.raises(ValueError, match="Unsupported KV cache spec type for layer l0"):
        KVCacheSpecRegistry.check_kv_cache_spec_registry({"l0": spec})
    with pytest.raises(ValueError, match="expected one of .*HiSparseHotSpec.* got _Orphan"):
        manager_class_of(spec)
    register_kv_cache_spec(FullAttentionManager)(_Orphan)
    assert manager_class_of(spec) is FullAttentionManager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(spec) is _Orphan


def test_role_picks_the_source_manager() -> None:
    assert manager_class_of(_source(), KVCacheGroupRole.HISPARSE_SOURCE) is HiSparseSourceManager
    assert manager_class_of(_source(), KVCacheGroupRole.HISPARSE_INDEXER) is FullAttentionManager
    spec = HiSparseResidentSpec(block_size=BLOCK, page_size=64)
    assert manager_class_of(spec) is HiSparseResidentManager


def test_coordinator_config_checks() -> None:
    with pytest.raises(ValueError, match="hisparse_host_num_blocks: expected host pages"):
        get_hisparse_coordinator(_manager(_config(host_blocks=None)))
    with pytest.raises(ValueError, match="expected the HiSparse source group before"):
        get_hisparse_coordinator(_manager(_config(source_first=False)))
    m = _manager(_config())
    with pytest.raises(ValueError, match="managers: expected one per KV cache group"):
        HiSparseCoordinator(
            m.kv_cache_config, m.coordinator.single_type_managers[:1], 128,
            num_reprefillable_tokens=0,
        )  # fmt: skip
    wrong = replace(
        m.kv_cache_config,
        kv_cache_groups=[
            *m.kv_cache_config.kv_cache_groups[:2],
            KVCacheGroupSpec(["x"], HiSparseResidentSpec(block_size=BLOCK, page_size=64)),
        ],
    )
    with pytest.raises(TypeError, match=r"managers\[2\]: expected a HiSparseResidentManager"):
        HiSparseCoordinator(
            wrong, m.coordinator.single_type_managers, 128, num_reprefillable_tokens=0
        )


def test_unbound_manager_names_the_missing_coordinator() -> None:
    m = _manager(_config())  # no get_hisparse_coordinator: nothing is bound
    request = make_request("r", list(range(2 * BLOCK)), BLOCK)
    with pytest.raises(ValueError, match="coordinator: expected a HiSparseCoordinator"):
        m.allocate_slots(request, 2 * BLOCK)


def test_coordinator_is_built_once_and_binds_a_host_pool() -> None:
    m = _manager(_config(), enable_kv_cache_events=True, enable_caching=True)
    coordinator = get_hisparse_coordinator(m)
    assert get_hisparse_coordinator(m) is coordinator
    host = coordinator.get_host_block_pool()
    assert isinstance(host, SharedEventQueueBlockPool)
    assert host.num_gpu_blocks == 16 and host.medium == MEDIUM_CPU
    assert coordinator.max_spill_pages == 128 // BLOCK
    # Hot pages of one request vs a tenth of the pool: the larger.
    assert coordinator.transition_watermark == max(2, 32 // 10)
    # The host pool's events land, in order, in the device pool's queue.
    request = make_request("r", list(range(2 * BLOCK + 1)), BLOCK)
    assert m.allocate_slots(request, 2 * BLOCK + 1)
    coordinator.advance_scheduled([("r", 2 * BLOCK + 1)])
    command = coordinator.build_offload_command()
    assert isinstance(command, SparseKVOffloadCommand) and len(command.page_transfers) == 2
    counts = {t.transfer_id: 1 for t in command.page_transfers}
    coordinator.update_spills(counts, counts)
    m.cache_blocks(request, 2 * BLOCK)
    stored = [e for e in m.block_pool.take_events() if isinstance(e, BlockStored)]
    assert stored and all(e.medium == MEDIUM_CPU for e in stored)


def test_shared_event_queue_refuses_a_foreign_queue() -> None:
    owner = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=BLOCK)
    pool = SharedEventQueueBlockPool(
        num_gpu_blocks=4, enable_caching=True, hash_block_size=BLOCK, event_owner=owner
    )
    assert pool.kv_event_queue is owner.kv_event_queue
    with pytest.raises(ValueError, match="events: expected an empty queue"):
        pool.kv_event_queue = [object()]  # type: ignore[list-item]


def test_resident_overrides_leave_the_block_table_append_only() -> None:
    m = _manager(_config())
    coordinator = get_hisparse_coordinator(m)
    resident = coordinator.resident_managers[0]
    request = make_request("r", list(range(3 * BLOCK)), BLOCK)
    assert m.allocate_slots(request, 3 * BLOCK)
    table = list(resident.req_to_blocks["r"])
    dropped = resident.drop_resident_page("r", 0)
    assert dropped is table[0]
    assert resident.get_resident_page("r", 0) is None
    assert resident.drop_resident_page("r", 0) is None
    assert resident.req_to_blocks["r"] == table
    assert [b.is_null for b in resident.get_residency_row("r")] == [True, False, False]
    assert resident.get_residency_row("r", 1) == table[1:]
    # Only a host-only page in range can adopt a copy.
    assert not resident.adopt_resident_page("r", 1, dropped)
    assert not resident.adopt_resident_page("r", 9, dropped)
    assert not resident.adopt_resident_page("other", 0, dropped)
    assert resident.adopt_resident_page("r", 0, dropped)
    assert resident.get_resident_page("r", 0) is dropped
    with pytest.raises(ValueError, match="num_external_computed_tokens: expected > 0"):
        resident.allocate_external_computed_blocks("r", 0, 0)


def test_hot_buffer_only_when_host_reads_are_needed() -> None:
    m = _manager(_config())
    coordinator = get_hisparse_coordinator(m)
    hot = coordinator.hot_managers[0]
    assert hot.get_num_blocks_to_allocate("r", BLOCK, [], 0, 0, BLOCK) == 0
    # An import, or a new request resuming a host prefix, needs the whole buffer.
    assert hot.get_num_blocks_to_allocate("r", BLOCK, [], BLOCK, 0, BLOCK) == 2
    assert hot.get_num_blocks_to_allocate("r", BLOCK, [], BLOCK, BLOCK, BLOCK) == 2
    request = make_request("r", list(range(BLOCK)), BLOCK)
    assert m.allocate_slots(request, BLOCK)
    assert not hot.has_hot("r") and hot.get_num_required_blocks("r") == 2
    hot.require_hot("r")
    assert hot.get_num_blocks_to_allocate("r", BLOCK, [], 0, 0, BLOCK) == 2
    assert len(hot.allocate_new_blocks("r", BLOCK, BLOCK)) == 2
    assert hot.has_hot("r") and hot.allocate_new_blocks("r", BLOCK, BLOCK) == []
    m.free(request)
    assert "r" not in hot.hot_required
