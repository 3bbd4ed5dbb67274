"""v0.22 callers and tiers against the v0.33 tiering core: a tier with v0.22's contract
(``get_finished``, a True / False / None ``lookup``, no ``on_new_request`` / ``drain_jobs``),
``JobMetadata`` / ``block_ids``, and a caller that ends steps with ``take_events`` only; plus the
cache-hit source a promotion keeps."""

from __future__ import annotations

from unittest.mock import MagicMock

import numpy as np
import torch

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import (
    JobMetadata,
    JobResult,
    SecondaryTierManager,
    TransferJob,
    as_lookup_result,
)
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)
from vllm.v1.kv_offload.tiering.metrics import TieringMetricsTracker
from vllm.v1.metrics.cache_hit_source import CacheHitSource

CTX = ReqContext(req_id="r")
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def key(i: int):
    return make_offload_key(i.to_bytes(4, "big"), 0)


def primary(rows: int = 2) -> CPUPrimaryTierOffloadingManager:
    region = MagicMock()
    region.create_kv_memoryview.return_value = memoryview(
        torch.zeros((rows, 8), dtype=torch.int8).numpy()
    )
    return CPUPrimaryTierOffloadingManager(num_chunks=rows, mmap_region=region)


class V022Tier(SecondaryTierManager):
    """A tier as v0.22 wrote them."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.held: set = set()
        self.done: list[JobResult] = []
        self.jobs: list[JobMetadata] = []

    def lookup(self, key, req_context):  # type: ignore[override]
        return key in self.held

    def submit_store(self, job_metadata: JobMetadata) -> None:
        self.jobs.append(job_metadata)
        self.held.update(job_metadata.keys)
        self.done.append(JobResult(job_metadata.job_id, True))

    def submit_load(self, job_metadata: JobMetadata) -> None:
        self.jobs.append(job_metadata)
        self.done.append(JobResult(job_metadata.job_id, True))

    def get_finished(self):  # type: ignore[override]
        done, self.done = self.done, []
        return done


def test_a_v022_tier_cascades_and_promotes_with_take_events_as_the_step_end() -> None:
    prim = primary()
    tier = V022Tier(MagicMock(), prim.get_kv_memoryview(), "old")
    manager = TieringOffloadingManager(prim, [tier])
    assert tier.on_new_request(CTX).policy.value == "chunk_level"
    tier.drain_jobs()  # nothing pending: returns at once
    out = manager.prepare_store([key(1), key(2)], CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)
    (job,) = tier.jobs
    assert list(job.block_ids) == list(job.chunk_ids) == [0, 1]
    list(manager.take_events())  # v0.22's step end (this step's store polled already)
    assert manager._transfer_jobs
    list(manager.take_events())  # the next step end collects the cascade
    assert not manager._transfer_jobs
    # Two new keys evict 1 and 2 from the primary tier; the tier still has them.
    out = manager.prepare_store([key(3), key(4)], CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)
    list(manager.take_events())
    list(manager.take_events())
    assert manager.lookup(key(1), CTX) is LookupResult.HIT_PENDING
    list(manager.take_events())  # submits the promotion
    assert tier.jobs[-1].is_promotion
    list(manager.take_events())  # collects it
    assert manager.lookup(key(1), CTX) is LookupResult.HIT
    assert manager.get_load_source(key(1), CTX) is CacheHitSource.EXTERNAL_UNSPECIFIED
    manager.shutdown()


def test_take_events_only_drains_events_once_steps_end_with_on_schedule_end() -> None:
    prim = primary()
    tier = ExampleSecondaryTierManager(MagicMock(), prim.get_kv_memoryview(), "example")
    manager = TieringOffloadingManager(prim, [tier])
    manager.on_schedule_end(END)
    tier.chunks[key(1)] = True
    assert manager.lookup(key(1), CTX) is LookupResult.HIT_PENDING
    list(manager.take_events())
    assert manager._pending_load_submissions  # not submitted: that is on_schedule_end's job
    manager.on_schedule_end(END)
    assert not manager._pending_load_submissions
    manager.on_schedule_end(END)
    assert manager.lookup(key(1), CTX) is LookupResult.HIT
    # The hit came from the example tier (host memory), not from the primary tier.
    assert manager.get_load_source(key(1), CTX) is CacheHitSource.HOST
    assert manager.get_load_source(key(9), CTX) is CacheHitSource.HOST  # primary's answer
    manager.shutdown()


def test_v022_aliases() -> None:
    assert JobMetadata is TransferJob
    job = TransferJob(1, [key(1)], np.array([3]), False, CTX)
    assert job.block_ids is job.chunk_ids
    assert [as_lookup_result(v) for v in (True, False, None, LookupResult.HIT_PENDING)] == [
        LookupResult.HIT,
        LookupResult.MISS,
        LookupResult.RETRY,
        LookupResult.HIT_PENDING,
    ]
    tier = ExampleSecondaryTierManager(MagicMock(), primary().get_kv_memoryview(), "example")
    tier.submit_store(job)
    assert [r.job_id for r in tier.get_finished()] == [1]  # v0.22's name, any tier


def test_tracker_without_tiers_or_observations_reports_nothing() -> None:
    tracker = TieringMetricsTracker([], num_primary_chunks=0, primary_chunk_size=8)
    assert tracker.take_stats() is None
    tracker.on_promotion_allocation_failure()
    stats = tracker.take_stats()
    assert stats is not None and stats.reduce() == {
        "vllm:kv_offload_tiering_promotion_allocation_failures": 1
    }
    tracker.assert_idle()
