"""The multi-tier offloading manager (upstream v0.22's ``kv_offload.tiering.manager``).

- Stores: the GPU stores into the CPU primary tier; once that store completes, every secondary
  tier is sent a copy of the new rows (a cascade). Primary rows being copied are read-pinned
  (like a GPU load) until the tier reports the job, so they are not evicted meanwhile.
- Loads: a key missing from the primary tier but held by a secondary tier gets a primary row
  at once (so later lookups see it in flight) and is promoted by one batched job per (tier,
  request), submitted at the end of the engine step (:meth:`take_events`); ``lookup`` answers
  None (ask again) until the promotion completes, False if the primary tier has no room.
- Finished secondary jobs are collected at most once per engine step, before the first
  lookup, load or store of the step needs them, and again at its end.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobId, JobMetadata, SecondaryTierManager

logger = logging.getLogger(__name__)


@dataclass
class PendingPromotion:
    """Keys of one request waiting to be promoted from one tier, and their primary rows."""

    req_context: ReqContext
    keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)


class CPUPrimaryTierOffloadingManager(CPUOffloadingManager):
    """The CPU manager as the primary tier, its rows in a shared offload region.

    ``prepare_read`` / ``complete_read`` pin rows a secondary tier copies from (a cascade) and
    ``prepare_write`` / ``complete_write`` reserve and publish rows a tier copies into (a
    promotion): the same operations as the GPU-facing load and store, named from the
    secondary tier's side.
    """

    def __init__(
        self,
        num_chunks: int,
        mmap_region: SharedOffloadRegion,
        cache_policy: str = "lru",
        enable_events: bool = False,
        info: CPUOffloadingInfo | None = None,
    ):
        super().__init__(
            num_chunks=num_chunks, cache_policy=cache_policy, enable_events=enable_events, info=info
        )
        self._mmap_region = mmap_region
        self.prepare_read = self.prepare_load
        self.complete_read = self.complete_load
        self.prepare_write = self.prepare_store
        self.complete_write = self.complete_store
        self._kv_memoryview: memoryview = mmap_region.create_kv_memoryview()

    def get_kv_memoryview(self) -> memoryview:
        """The primary rows: a ``[num_blocks, row bytes]`` memoryview of the shared region,
        row ``b`` being offloaded block ``b``."""
        return self._kv_memoryview

    def is_ready(self, key: OffloadKey) -> bool:
        """Whether ``key`` is held and its store has completed (counts no lookup)."""
        block = self._policy.get(key)
        return block is not None and block.is_ready

    def shutdown(self) -> None:
        super().shutdown()
        self._kv_memoryview.release()
        self._mmap_region.cleanup()


class TieringOffloadingManager(OffloadingManager):
    """A CPU primary tier (the only one the GPU reaches) and zero or more secondary tiers."""

    def __init__(
        self,
        primary_tier: CPUPrimaryTierOffloadingManager,
        secondary_tiers: list[SecondaryTierManager] | None = None,
        enable_events: bool = False,
    ):
        self.primary_tier: CPUPrimaryTierOffloadingManager = primary_tier
        self.secondary_tiers: list[SecondaryTierManager] = list(secondary_tiers or [])
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._job_id_counter: int = 0
        self._transfer_jobs: dict[JobId, JobMetadata] = {}
        # tier -> request id -> promotions queued during this step's lookups
        self._pending_load_submissions: dict[SecondaryTierManager, dict[str, PendingPromotion]]
        self._pending_load_submissions = {}
        self._processed_jobs_this_step: bool = False

    def _next_job_id(self) -> JobId:
        job_id = self._job_id_counter
        self._job_id_counter += 1
        return job_id

    def _maybe_process_finished_jobs(self) -> None:
        if not self._processed_jobs_this_step:
            self._processed_jobs_this_step = True
            self._process_finished_jobs()

    def _process_finished_jobs(self) -> None:
        for tier in self.secondary_tiers:
            for result in tier.get_finished():
                job = self._transfer_jobs.pop(result.job_id, None)
                if job is None:
                    raise RuntimeError(
                        f"tier {tier.tier_type!r} reported job {result.job_id}, which is not "
                        "in flight"
                    )
                if job.is_promotion:
                    self.primary_tier.complete_write(job.keys, job.req_context, result.success)
                else:
                    self.primary_tier.complete_read(job.keys, job.req_context)

    def _submit(
        self,
        tier: SecondaryTierManager,
        keys: Collection[OffloadKey],
        block_ids: np.ndarray,
        is_promotion: bool,
        req_context: ReqContext,
    ) -> None:
        job = JobMetadata(self._next_job_id(), keys, block_ids, is_promotion, req_context)
        self._transfer_jobs[job.job_id] = job
        if is_promotion:
            tier.submit_load(job)
        else:
            tier.submit_store(job)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """The primary tier's answer when it holds ``key``; else a secondary tier's hit starts
        a promotion (``HIT_PENDING`` until it lands, ``MISS`` without a free primary row);
        ``RETRY`` while a secondary tier cannot answer yet."""
        self._maybe_process_finished_jobs()
        hit = self.primary_tier.lookup(key, req_context)
        if hit is not LookupResult.MISS:
            return hit
        busy = False
        for tier in self.secondary_tiers:
            found = tier.lookup(key, req_context)
            if found is True:
                if self._initiate_promotion(tier, key, req_context):
                    return LookupResult.HIT_PENDING
                return LookupResult.MISS
            busy = busy or found is None
        return LookupResult.RETRY if busy else LookupResult.MISS

    def _initiate_promotion(
        self, tier: SecondaryTierManager, key: OffloadKey, req_context: ReqContext
    ) -> bool:
        """Reserve a primary row for ``key`` and queue its promotion; False if no room."""
        reserved = self.primary_tier.prepare_write([key], req_context)
        if reserved is None:
            return False
        spec = reserved.store_spec
        assert isinstance(spec, CPULoadStoreSpec)
        by_request = self._pending_load_submissions.setdefault(tier, {})
        pending = by_request.get(req_context.req_id)
        if pending is None:
            pending = by_request[req_context.req_id] = PendingPromotion(req_context)
        pending.keys.extend(reserved.keys_to_store)
        pending.block_ids.extend(int(b) for b in spec.block_ids)
        return True

    def _flush_pending_promotions(self) -> None:
        for tier, by_request in self._pending_load_submissions.items():
            for pending in by_request.values():
                rows = np.array(pending.block_ids, dtype=np.int64)
                self._submit(tier, pending.keys, rows, True, pending.req_context)
        self._pending_load_submissions.clear()

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        self._maybe_process_finished_jobs()
        return self.primary_tier.prepare_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.primary_tier.touch(keys, req_context)
        for tier in self.secondary_tiers:
            tier.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.primary_tier.complete_load(keys, req_context)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        # Finished cascades unpin rows first, so eviction may reuse them.
        self._maybe_process_finished_jobs()
        return self.primary_tier.prepare_store(keys, req_context)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.primary_tier.complete_store(keys, req_context, success)
        if not success or not self.secondary_tiers:
            return
        stored = [key for key in keys if self.primary_tier.is_ready(key)]
        if not stored:
            return
        for tier in self.secondary_tiers:
            rows = self.primary_tier.prepare_read(stored, req_context)
            self._submit(tier, stored, rows.block_ids, False, req_context)

    def take_events(self) -> Iterator[OffloadingEvent]:
        # The end of an engine step: collect, submit the step's promotions, reset the gate.
        self._maybe_process_finished_jobs()
        self._flush_pending_promotions()
        self._processed_jobs_this_step = False
        if self.events is not None:
            events, self.events = self.events, []
            yield from events
        yield from self.primary_tier.take_events()

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """One series per tier, told apart by a ``tier`` label (``"<index>:<type>"``); the
        primary tier's is its CPU facts."""
        return [{"tier": "0:primary", **series} for series in self.primary_tier.config_info()]

    def shutdown(self) -> None:
        for tier in self.secondary_tiers:
            tier.shutdown()
        self.primary_tier.shutdown()


__all__ = [
    "CPUPrimaryTierOffloadingManager",
    "PendingPromotion",
    "TieringOffloadingManager",
]
