"""allocate_slots' v0.33 gates: the admission watermark (waiting / preempted requests leave a
share of the pool free while others are scheduled) and steps that only adopt computed tokens."""

from __future__ import annotations

import pytest

from tests.v1.core.block_manager_test_utils import config_of, full, make_request
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import RequestStatus

BLOCK = 4


def make_manager(watermark: float) -> KVCacheManager:
    # 11 pages, the null page included: 10 usable.
    return KVCacheManager(
        config_of(11, full(BLOCK)), max_model_len=256, hash_block_size=BLOCK, watermark=watermark
    )


def test_watermark_gates_only_admissions_alongside_scheduled_requests() -> None:
    manager = make_manager(0.5)  # int(0.5 * 11) = 5 pages kept free
    assert manager.watermark_blocks == 5
    request = make_request("r", list(range(6 * BLOCK)), BLOCK)
    assert request.status == RequestStatus.WAITING
    assert manager.allocate_slots(request, 6 * BLOCK) is None
    # Alone in the step, the same admission may use the whole pool.
    assert manager.allocate_slots(request, 6 * BLOCK, has_scheduled_reqs=False) is not None
    manager.free(request)
    request.status = RequestStatus.RUNNING
    assert manager.allocate_slots(request, 6 * BLOCK) is not None


@pytest.mark.parametrize("watermark", [-0.1, True, "0.1"])
def test_bad_watermark_is_refused(watermark: object) -> None:
    with pytest.raises(ValueError, match="watermark: expected a fraction of the pool >= 0"):
        make_manager(watermark)  # type: ignore[arg-type]


def test_a_step_may_only_adopt_prefix_hits() -> None:
    manager = make_manager(0.0)
    producer = make_request("p", list(range(3 * BLOCK)), BLOCK)
    assert manager.allocate_slots(producer, 3 * BLOCK) is not None
    manager.free(producer)
    consumer = make_request("c", list(range(3 * BLOCK)) + [99], BLOCK)
    blocks, num_hit, _ = manager.get_computed_blocks(consumer)
    assert num_hit == 3 * BLOCK
    assert manager.allocate_slots(consumer, 0, num_hit, blocks) is not None
    assert manager.get_block_ids("c") == blocks.get_block_ids()
    with pytest.raises(ValueError, match="num_new_tokens: expected > 0 when there are no"):
        manager.allocate_slots(consumer, 0)
