"""CPUOffloadingManager and its LRU / ARC eviction policies, as the offloading scheduler
calls them."""

from __future__ import annotations

import numpy as np
import pytest

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

CTX = ReqContext(req_id="r")


def keys(*ids: int, group: int = 0) -> list[OffloadKey]:
    return [make_offload_key(i.to_bytes(8, "big"), group) for i in ids]


def store(manager: CPUOffloadingManager, *ids: int) -> list[int]:
    out = manager.prepare_store(keys(*ids), CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    return out.store_spec.block_ids.tolist()


def test_unknown_policy_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cache_policy"):
        CPUOffloadingManager(num_blocks=2, cache_policy="fifo")  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_slots_fresh_then_reused_and_groups_are_distinct_keys(policy: str) -> None:
    manager = CPUOffloadingManager(num_blocks=3, cache_policy=policy)  # type: ignore[arg-type]
    assert store(manager, 1, 2) == [0, 1]
    # The same hash in another group is another block.
    out = manager.prepare_store(keys(1, group=1), CTX)
    assert out is not None and out.keys_to_store == keys(1, group=1)
    assert out.store_spec.block_ids.tolist() == [2]  # type: ignore[attr-defined]
    manager.complete_store(out.keys_to_store, CTX, success=False)
    assert manager.lookup(keys(1, group=1)[0], CTX) is LookupResult.MISS
    # The failed store's slot is free again.
    assert store(manager, 3) == [2]


def test_in_flight_store_is_pending_and_loads_pin_blocks() -> None:
    manager = CPUOffloadingManager(num_blocks=2, enable_events=True)
    out = manager.prepare_store(keys(1, 2), CTX)
    assert out is not None
    assert manager.lookup(keys(1)[0], CTX) is LookupResult.HIT_PENDING
    with pytest.raises(ValueError, match="store has not completed"):
        manager.prepare_load(keys(1), CTX)
    manager.complete_store(keys(1, 2), CTX)
    spec = manager.prepare_load(keys(2, 1), CTX)
    assert np.array_equal(spec.block_ids, [1, 0])  # type: ignore[attr-defined]
    # Both blocks are being read: nothing can be evicted for a new one.
    assert manager.prepare_store(keys(3), CTX) is None
    manager.complete_load(keys(1, 2), CTX)
    with pytest.raises(ValueError, match="complete_load without prepare_load"):
        manager.complete_load(keys(1), CTX)
    out = manager.prepare_store(keys(3), CTX)
    assert out is not None and out.evicted_keys == keys(1)
    events = list(manager.take_events())
    assert [(e.removed, e.keys) for e in events] == [(False, keys(1, 2)), (True, keys(1))]
    assert list(manager.take_events()) == []
    with pytest.raises(KeyError):
        manager.prepare_load(keys(9), CTX)


def test_reset_cache_forgets_everything() -> None:
    manager = CPUOffloadingManager(num_blocks=2)
    store(manager, 1, 2)
    manager.reset_cache()
    assert manager.lookup(keys(1)[0], CTX) is LookupResult.MISS
    assert store(manager, 3, 4) == [0, 1]


def test_lru_touch_order_first_key_most_recent() -> None:
    policy = LRUCachePolicy(cache_capacity=3)
    for i, key in enumerate(keys(1, 2, 3)):
        block = BlockStatus(i)
        block.ref_cnt = 0
        policy.insert(key, block)
    policy.touch(keys(1, 2))
    evicted = policy.evict(2, protected=set())
    assert evicted is not None and [k for k, _ in evicted] == keys(3, 2)
    assert policy.evict(2, protected=set()) is None  # atomic: nothing changed
    assert policy.get(keys(1)[0]) is not None


def test_arc_ghost_lists_bounded_and_failed_evict_changes_nothing() -> None:
    policy = ARCCachePolicy(cache_capacity=1)
    for i, key in enumerate(keys(1, 2)):
        block = BlockStatus(i)
        block.ref_cnt = 0
        policy.insert(key, block)
    assert policy.evict(3, protected=set()) is None
    assert len(policy.t1) == 2 and not policy.b1
    evicted = policy.evict(2, protected=set())
    assert evicted is not None and [k for k, _ in evicted] == keys(1, 2)
    assert list(policy.b1) == keys(2)  # trimmed to cache_capacity
    policy.touch(keys(2))
    assert policy.target_t1_size == 1.0


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_duplicate_keys_in_one_store_take_one_slot(policy: str) -> None:
    """A key offered twice in one call is stored once (order kept); repeated, the tier keeps
    its whole capacity instead of leaking a slot per duplicate."""
    manager = CPUOffloadingManager(num_blocks=2, cache_policy=policy)  # type: ignore[arg-type]
    out = manager.prepare_store(keys(1, 2, 1), CTX)
    assert out is not None and out.keys_to_store == keys(1, 2)
    assert out.store_spec.block_ids.tolist() == [0, 1]  # type: ignore[attr-defined]
    manager.complete_store(keys(1, 2, 1), CTX)
    for i in range(3, 13):
        out = manager.prepare_store(keys(i, i), CTX)
        assert out is not None and out.keys_to_store == keys(i)
        manager.complete_store(out.keys_to_store, CTX)
    # Both slots are still usable: two new keys fit at once, evicting the last two stored.
    assert sorted(store(manager, 20, 21)) == [0, 1]
    assert [manager.lookup(k, CTX) for k in keys(20, 21)] == [LookupResult.HIT] * 2
