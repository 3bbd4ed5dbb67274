"""TieringOffloadingManager with the in-memory example tier: cascades pin primary chunks until
the tier reports them, promotions are batched per (tier, request) at the end of a step
(``on_schedule_end``), and failures leave the primary tier consistent."""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import pytest
import torch
from tiering_test_utils import region, stub_spec

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

A, B = ReqContext(req_id="a"), ReqContext(req_id="b")
ROW = mmap.PAGESIZE  # primary rows are whole pages


def keys(*ids: int) -> list[OffloadKey]:
    return [make_offload_key(i.to_bytes(8, "big"), 0) for i in ids]


class DeferredTier(ExampleSecondaryTierManager):
    """The example tier, but jobs are reported only when ``release`` is called."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.jobs: list[TransferJob] = []
        self.held: list[JobResult] = []

    def submit_store(self, job_metadata: TransferJob) -> None:
        self.jobs.append(job_metadata)
        super().submit_store(job_metadata)
        self.held += super().get_finished_jobs()

    def submit_load(self, job_metadata: TransferJob) -> None:
        self.jobs.append(job_metadata)
        super().submit_load(job_metadata)
        self.held += super().get_finished_jobs()

    def release(self) -> None:
        self.completed_jobs, self.held = self.held, []


@pytest.fixture
def setup() -> Iterator[list]:
    shared = region(4, ROW, rank=None)
    primary = CPUPrimaryTierOffloadingManager(4, shared, enable_events=True)
    view = primary.get_kv_memoryview()
    rows = torch.frombuffer(view, dtype=torch.int8).view(4, ROW)
    tier = DeferredTier(stub_spec(), view, "example", custom_param=3)
    manager = TieringOffloadingManager(primary, [tier])
    state: list = [manager, tier, rows]
    yield state
    state.clear()  # drop the rows' export of the shared buffer before it is unmapped
    del rows
    manager.shutdown()


def store(manager: TieringOffloadingManager, rows: torch.Tensor, ids: list[int], ctx=A) -> None:
    out = manager.prepare_store(keys(*ids), ctx)
    assert out is not None
    for k, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
        rows[row] = int.from_bytes(k[:8], "big")
    manager.complete_store(out.keys_to_store, ctx)


def end_step(manager: TieringOffloadingManager) -> list:
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    return list(manager.take_events())


def test_cascade_pins_rows_until_the_tier_reports(setup) -> None:
    manager, tier, rows = setup
    store(manager, rows, [1, 2, 3, 4])
    (job,) = tier.jobs
    assert not job.is_promotion and list(job.chunk_ids) == [0, 1, 2, 3]
    assert tier.get_num_chunks() == 4 and tier.data[keys(3)[0]] == bytes([3]) * ROW
    end_step(manager)
    # Pinned by the cascade: nothing can be evicted for a new key.
    assert manager.prepare_store(keys(5), A) is None
    tier.release()
    end_step(manager)
    out = manager.prepare_store(keys(5), A)
    assert out is not None and out.evicted_keys == keys(1)


def test_failed_store_is_not_cascaded(setup) -> None:
    manager, tier, _ = setup
    out = manager.prepare_store(keys(1), A)
    assert out is not None
    manager.complete_store(out.keys_to_store, A, success=False)
    assert tier.jobs == [] and manager.lookup(keys(1)[0], A) is LookupResult.MISS


def test_promotions_batched_per_request_and_bytes_restored(setup) -> None:
    manager, tier, rows = setup
    store(manager, rows, [1, 2, 3, 4])
    tier.release()
    end_step(manager)
    store(manager, rows, [5, 6, 7, 8])  # evicts 1-4 from the primary tier
    tier.release()
    end_step(manager)
    rows.zero_()
    assert manager.lookup(keys(1)[0], A) is LookupResult.HIT_PENDING
    assert manager.lookup(keys(2)[0], A) is LookupResult.HIT_PENDING
    # In flight: not promoted twice.
    assert manager.lookup(keys(1)[0], A) is LookupResult.HIT_PENDING
    assert manager.lookup(keys(3)[0], B) is LookupResult.HIT_PENDING
    assert len(tier.jobs) == 2  # nothing submitted before the end of the step
    end_step(manager)
    promotions = tier.jobs[2:]
    assert [(len(j.keys), j.req_context.req_id, j.is_promotion) for j in promotions] == [
        (2, "a", True),
        (1, "b", True),
    ]
    assert manager.lookup(keys(1)[0], A) is LookupResult.HIT_PENDING  # not yet reported
    tier.release()
    end_step(manager)
    assert [manager.lookup(k, A) for k in keys(1, 2, 3)] == [LookupResult.HIT] * 3
    spec = manager.prepare_load(keys(1, 2, 3), A)
    for i, row in zip([1, 2, 3], spec.block_ids, strict=True):
        assert rows[row].tolist() == [i] * ROW
    manager.complete_load(keys(1, 2, 3), A)


def test_failed_promotion_frees_the_row_and_full_primary_is_a_miss(setup) -> None:
    manager, tier, rows = setup
    tier.chunks[keys(9)[0]] = True  # held without bytes
    tier.chunks[keys(8)[0]] = True
    assert manager.lookup(keys(9)[0], A) is LookupResult.HIT_PENDING
    end_step(manager)
    del tier.chunks[keys(9)[0]]
    tier.jobs[-1].keys = list(tier.jobs[-1].keys)
    tier.held = [JobResult(tier.jobs[-1].job_id, False)]
    tier.release()
    end_step(manager)
    assert manager.lookup(keys(9)[0], A) is LookupResult.MISS
    # Four stores pinned by their cascade fill the primary tier: a promotion finds no room.
    store(manager, rows, [1, 2, 3, 4])
    end_step(manager)
    assert manager.lookup(keys(8)[0], A) is LookupResult.MISS


def test_touch_events_and_unknown_jobs(setup) -> None:
    manager, tier, rows = setup
    touched: list = []
    tier.touch = lambda k, ctx: touched.append(list(k))  # type: ignore[method-assign]
    manager.touch(keys(1), A)
    assert touched == [keys(1)]
    store(manager, rows, [1])
    events = end_step(manager)
    assert [(e.keys, e.removed) for e in events] == [(keys(1), False)]
    tier.completed_jobs.append(JobResult(999, True))
    with pytest.raises(RuntimeError, match="job 999"):
        end_step(manager)


def test_without_secondary_tiers() -> None:
    shared = region(2, ROW, rank=None)
    manager = TieringOffloadingManager(CPUPrimaryTierOffloadingManager(2, shared))
    out = manager.prepare_store(keys(1, 2), A)
    assert out is not None
    manager.complete_store(out.keys_to_store, A)
    assert manager.lookup(keys(2)[0], A) is LookupResult.HIT
    assert manager.lookup(keys(3)[0], A) is LookupResult.MISS
    end_step(manager)
    manager.shutdown()


def test_secondary_tier_factory() -> None:
    view = memoryview(torch.zeros((2, 8), dtype=torch.int8).numpy())
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "example", "custom_param": 7}, view, stub_spec()
    )
    assert isinstance(tier, ExampleSecondaryTierManager)
    assert (tier.tier_type, tier.config_info()) == ("example", {"example_info": 7})
    with pytest.raises(ValueError, match="must include 'type'"):
        SecondaryTierFactory.create_secondary_tier({}, view, stub_spec())
    with pytest.raises(ValueError, match="Unknown secondary tier type: 'tape'"):
        SecondaryTierFactory.create_secondary_tier({"type": "tape"}, view, stub_spec())
    with pytest.raises(ValueError, match="'example' is already registered"):
        SecondaryTierFactory.register_tier("example", "x", "y")
