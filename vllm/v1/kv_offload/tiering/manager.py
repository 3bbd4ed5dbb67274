"""The multi-tier offloading manager (upstream v0.33's ``kv_offload.tiering.manager``).

- Stores: the GPU stores into the CPU primary tier; when that store completes, each
  secondary tier is sent a copy of the new chunks (a cascade), unless its back-pressure
  detector drops it. Cascaded chunks stay pinned in the primary tier until the tier reports
  the job. A tier that wants a request's every chunk (``REQUEST_LEVEL``) also gets chunks
  the primary tier held already.
- Loads: a key missing from the primary tier but held by a secondary tier gets a primary
  chunk at once (later lookups see it in flight, ``HIT_PENDING``) and is promoted by one
  batched job per (tier, request), submitted at the end of the step (:meth:`on_schedule_end`).
- Finished jobs are collected at most once per step before a lookup needs them, always
  before a store (eviction must see every unpinned chunk), and at the end of the step.
- Tiers are told a request finished only once no completion of it can cascade any more.
- Tiers that serve peers (``tolerates_off_thread_polling``) are also serviced between steps
  by a tier-poll thread; :attr:`lock` keeps it and the scheduler apart.

A caller that never calls :meth:`on_schedule_end` (v0.22's contract) gets v0.22's
:meth:`take_events`, which then ends the step itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterator, Sequence

import numpy as np

from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.tiering.base import (
    TIER_LABEL,
    JobId,
    JobResult,
    SecondaryTierManager,
    TransferJob,
    as_lookup_result,
)
from vllm.v1.kv_offload.tiering.jobs import (
    JobMetadata,
    PendingPromotion,
    RequestState,
    SecondaryTierFacingParent,
)
from vllm.v1.kv_offload.tiering.metrics import TieringMetricsTracker
from vllm.v1.kv_offload.tiering.primary import CPUPrimaryTierOffloadingManager
from vllm.v1.kv_offload.tiering.request_lifecycle import RequestLifecycleMixin
from vllm.v1.metrics.cache_hit_source import CacheHitSource

logger = logging.getLogger(__name__)

# Pause between tier-poll rounds (seconds): how long a peer's request may wait unserved.
DEFAULT_TIER_POLL_INTERVAL_S = 0.001
# A round waits this long for the lock, so the thread notices a stop request.
_TIER_POLL_LOCK_TIMEOUT_S = 1.0
# Warn when the lock was unavailable this long (the engine then serves peers per step).
_TIER_POLL_STALL_WARN_S = 30.0
# Stop the thread after rounds failed for this long (time, not rounds: a burst of failures
# at a 1 ms interval must not end it); per-step servicing carries on.
_TIER_POLL_GIVE_UP_AFTER_S = 30.0
# At most one logged traceback per this many seconds of failing rounds.
_TIER_POLL_ERROR_LOG_INTERVAL_S = 1.0
# How long shutdown waits for the thread to finish its round.
_TIER_POLL_JOIN_TIMEOUT_S = 5.0


class TieringOffloadingManager(RequestLifecycleMixin, OffloadingManager):
    """A CPU primary tier (the only one the GPU reaches) and zero or more secondary tiers.

    ``tier_poll_interval_s``: pause between tier-poll rounds (seconds); 0 or less disables
    the thread, leaving every tier serviced once per step.
    """

    def __init__(
        self,
        primary_tier: CPUPrimaryTierOffloadingManager,
        secondary_tiers: list[SecondaryTierManager] | None = None,
        tier_poll_interval_s: float = DEFAULT_TIER_POLL_INTERVAL_S,
    ):
        if isinstance(tier_poll_interval_s, bool) or not isinstance(
            tier_poll_interval_s, (int, float)
        ):
            raise TypeError(
                f"tier_poll_interval_s: expected a number of seconds, got {tier_poll_interval_s!r}"
            )
        # Guards the manager and every tier; a real lock because the tier-poll thread
        # enters the manager too.
        self._lock = threading.Lock()
        self.primary_tier: CPUPrimaryTierOffloadingManager = primary_tier
        self.secondary_tiers: list[SecondaryTierManager] = list(secondary_tiers or [])
        self._tier_index = {tier: i for i, tier in enumerate(self.secondary_tiers)}
        self._tier_parents = {
            tier: SecondaryTierFacingParent(self, i) for i, tier in enumerate(self.secondary_tiers)
        }
        self._job_id_counter = 0
        self._jobs: dict[JobId, JobMetadata] = {}
        # tier index -> request id -> promotions queued during this step's lookups
        self._pending_load_submissions: dict[int, dict[str, PendingPromotion]] = {}
        self._processed_jobs_this_step = False
        self._req_state: dict[str, RequestState] = {}
        # Where each promoted key came from, so a disk or peer hit is not reported as a host
        # hit once its chunk is in the primary tier.
        self._request_load_sources: dict[str, dict[OffloadKey, CacheHitSource]] = {}
        # Set by reset_cache until on_reset_flushed: a late worker write may still land in a
        # freed primary chunk, so no promotion may fill one meanwhile.
        self._promotions_held = False
        self._steps_ended_by_caller = False
        self._metrics = TieringMetricsTracker(
            tier_types=[tier.tier_type for tier in self.secondary_tiers],
            num_primary_chunks=primary_tier._num_chunks,
            primary_chunk_size=primary_tier.get_kv_memoryview().strides[0],
        )
        self._polled_tiers = [t for t in self.secondary_tiers if t.tolerates_off_thread_polling]
        self._tier_poll_interval_s = float(tier_poll_interval_s)
        self._tier_poll_stop = threading.Event()
        self._tier_poll_thread: threading.Thread | None = None
        if self._polled_tiers and self._tier_poll_interval_s > 0:
            self._tier_poll_thread = threading.Thread(
                target=self._tier_poll_loop, name="vllm_offload_tier_poll", daemon=True
            )
            self._tier_poll_thread.start()

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    @property
    def _transfer_jobs(self) -> dict[JobId, JobMetadata]:
        """v0.22's name of the jobs in flight."""
        return self._jobs

    # --- the tier-poll thread -------------------------------------------------------------

    def _tier_poll_loop(self) -> None:
        stalled_since: float | None = None
        failing_since: float | None = None
        last_error_log = 0.0
        while not self._tier_poll_stop.is_set():
            if not self._lock.acquire(timeout=_TIER_POLL_LOCK_TIMEOUT_S):
                now = time.monotonic()
                stalled_since = stalled_since or now
                if now - stalled_since > _TIER_POLL_STALL_WARN_S:
                    logger.warning(
                        "tier-poll thread could not take the manager lock for %.0f s",
                        now - stalled_since,
                    )
                    stalled_since = None
                continue
            stalled_since = None
            try:
                self.poll_tiers()
                failing_since = None
            except Exception:
                now = time.monotonic()
                failing_since = failing_since or now
                if now - last_error_log >= _TIER_POLL_ERROR_LOG_INTERVAL_S:
                    last_error_log = now
                    logger.exception("tier-poll round failed")
            finally:
                self._lock.release()
            if failing_since is not None and (
                time.monotonic() - failing_since >= _TIER_POLL_GIVE_UP_AFTER_S
            ):
                logger.error(
                    "tier-poll thread stops after %.0f s of failing rounds; tiers "
                    "are served per step only",
                    _TIER_POLL_GIVE_UP_AFTER_S,
                )
                return
            # Pause with the lock free: Python locks are unfair, so this is what lets the
            # scheduler in.
            self._tier_poll_stop.wait(self._tier_poll_interval_s)

    def poll_tiers(self) -> None:
        """One tier-poll round (caller holds :attr:`lock`): collect the polled tiers' finished
        jobs and let them serve their peers.

        Promotions a peer's lookup starts wait for the step's end, which batches them. The
        per-step gate is held shut for the round (a parent lookup must not run the step's
        poll over every tier from here) and restored afterwards.
        """
        gate = self._processed_jobs_this_step
        self._processed_jobs_this_step = True
        try:
            self._process_finished_jobs(self._polled_tiers)
            for tier in self._polled_tiers:
                tier.serve_external_requests(self._tier_parents[tier])
        finally:
            self._processed_jobs_this_step = gate

    def _stop_tier_poll_thread(self) -> None:
        self._tier_poll_stop.set()
        thread = self._tier_poll_thread
        if thread is None:
            return
        thread.join(timeout=_TIER_POLL_JOIN_TIMEOUT_S)
        if thread.is_alive():
            logger.error("tier-poll thread did not stop within %.1f s", _TIER_POLL_JOIN_TIMEOUT_S)
        else:
            self._tier_poll_thread = None

    # --- jobs ---------------------------------------------------------------------------

    def _next_job_id(self) -> JobId:
        job_id = self._job_id_counter
        self._job_id_counter += 1
        return job_id

    def _register_job(self, job: TransferJob, tier_idx: int) -> None:
        metadata = JobMetadata(job, tier_idx)
        self._jobs[job.job_id] = metadata
        self._metrics.on_job_registered(metadata)

    def _maybe_process_finished_jobs(self) -> None:
        if not self._processed_jobs_this_step:
            self._processed_jobs_this_step = True
            self._process_finished_jobs()

    def _process_finished_jobs(self, tiers: Sequence[SecondaryTierManager] | None = None) -> None:
        for tier in self.secondary_tiers if tiers is None else tiers:
            tier_idx = self._tier_index[tier]
            for result in tier.get_finished_jobs():
                metadata = self._jobs.pop(result.job_id, None)
                if metadata is None or metadata.tier_idx != tier_idx:
                    raise RuntimeError(
                        f"tier #{tier_idx} ({tier.tier_type}) reported job {result.job_id}, "
                        "which it does not run"
                    )
                self._metrics.on_job_finished(metadata, result)
                job = metadata.transfer_job
                if job.is_promotion:
                    self._complete_promotion(metadata, result)
                else:
                    self.primary_tier.complete_read(job.keys, job.req_context)
                    self._update_backpressure(tier, job, result)

    def _complete_promotion(self, metadata: JobMetadata, result: JobResult) -> None:
        job = metadata.transfer_job
        if result.success:
            landed: Collection[OffloadKey] = job.keys
            failed: Collection[OffloadKey] = ()
        else:
            landed = result.successful_keys or ()
            unknown = set(landed).difference(job.keys)
            if unknown:
                raise RuntimeError(f"promotion {job.job_id} reports keys it never had: {unknown}")
            landed_set = set(landed)
            failed = [key for key in job.keys if key not in landed_set]
        sources = self._request_load_sources.get(job.req_context.req_id)
        if sources is not None:
            tier_source = self.secondary_tiers[metadata.tier_idx].cache_hit_source
            for key in failed:
                if sources.get(key) == tier_source:
                    del sources[key]
        if landed:
            self.primary_tier.complete_write(landed, job.req_context, True)
        if failed:
            self.primary_tier.complete_write(failed, job.req_context, False)

    def _update_backpressure(
        self, tier: SecondaryTierManager, job: TransferJob, result: JobResult
    ) -> None:
        detector = tier.bp_detector
        if detector is None:
            return
        was_pressured = detector.is_under_pressure()
        if result.success:
            num_bytes = result.transfer_bytes
            if num_bytes is None:
                num_bytes = len(job.keys) * tier.block_size_bytes
            detector.update(job.submit_time, num_bytes)
        else:
            detector.on_store_failed()
        pressured = detector.is_under_pressure()
        if pressured != was_pressured:
            logger.info(
                "tier #%d (%s): back-pressure %s (%s)",
                self._tier_index[tier],
                tier.tier_type,
                "on" if pressured else "off",
                detector.stats,
            )

    def create_store_job(
        self, keys: Collection[OffloadKey], req_context: ReqContext, tier_idx: int = 0
    ) -> TransferJob:
        """Pin ``keys`` in the primary tier and register a cascade job for tier ``tier_idx``
        (the caller submits it; the tier reports it)."""
        spec = self.primary_tier.prepare_read(keys, req_context)
        job = TransferJob(self._next_job_id(), keys, spec.chunk_ids, False, req_context)
        self._register_job(job, tier_idx)
        return job

    # --- lookups and loads ----------------------------------------------------------------

    def lookup(
        self, key: OffloadKey, req_context: ReqContext, *, exclude_tier_idx: int | None = None
    ) -> LookupResult:
        """The primary tier's ``HIT`` / ``HIT_PENDING``; else a secondary tier's hit starts a
        promotion (``HIT_PENDING``; ``MISS`` without a free primary chunk); ``RETRY`` while a
        tier cannot answer yet; ``MISS`` while promotions are held after a reset.
        ``exclude_tier_idx`` skips that tier (the one asking, for a peer)."""
        self._maybe_process_finished_jobs()
        started = time.monotonic()
        found = self.primary_tier.lookup(key, req_context)
        self._metrics.on_lookup(
            req_context, key, self._metrics.primary_tier_label, found, time.monotonic() - started
        )
        if found is not LookupResult.MISS:
            return found
        if self._promotions_held:
            return LookupResult.MISS
        retry = False
        for tier_idx, tier in enumerate(self.secondary_tiers):
            if tier_idx == exclude_tier_idx or not req_context.load_tier_filter.allows(
                tier.medium, tier.locality
            ):
                continue
            started = time.monotonic()
            found = as_lookup_result(tier.lookup(key, req_context))
            self._metrics.on_lookup(
                req_context,
                key,
                self._metrics.tier_label(tier_idx),
                found,
                time.monotonic() - started,
            )
            if found is LookupResult.HIT:
                if self._initiate_promotion(tier_idx, key, req_context):
                    return LookupResult.HIT_PENDING
                return LookupResult.MISS
            retry = retry or found is LookupResult.RETRY
        return LookupResult.RETRY if retry else LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        sources = self._request_load_sources.get(req_context.req_id)
        if sources is not None and key in sources:
            return sources[key]
        return self.primary_tier.get_load_source(key, req_context)

    def _initiate_promotion(self, tier_idx: int, key: OffloadKey, req_context: ReqContext) -> bool:
        """Reserve a primary chunk for ``key`` now (so later lookups see it in flight) and
        queue its promotion for the end of the step; False if the primary tier is full."""
        reserved = self.primary_tier.prepare_write([key], req_context)
        if reserved is None:
            self._metrics.on_promotion_allocation_failure()
            return False
        spec = reserved.store_spec
        assert isinstance(spec, CPULoadStoreSpec)
        source = self.secondary_tiers[tier_idx].cache_hit_source
        sources = self._request_load_sources.setdefault(req_context.req_id, {})
        sources.update(dict.fromkeys(reserved.keys_to_store, source))
        by_request = self._pending_load_submissions.setdefault(tier_idx, {})
        pending = by_request.setdefault(req_context.req_id, PendingPromotion(req_context))
        pending.keys.extend(reserved.keys_to_store)
        pending.chunk_ids.extend(int(c) for c in spec.chunk_ids)
        return True

    def _flush_pending_promotions(self) -> None:
        for tier_idx, by_request in self._pending_load_submissions.items():
            tier = self.secondary_tiers[tier_idx]
            for pending in by_request.values():
                chunk_ids = np.array(pending.chunk_ids, dtype=np.int64)
                job = TransferJob(
                    self._next_job_id(), pending.keys, chunk_ids, True, pending.req_context
                )
                self._register_job(job, tier_idx)
                tier.submit_load(job)
        self._pending_load_submissions.clear()

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        return self.primary_tier.prepare_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.primary_tier.touch(keys, req_context)
        for tier in self.secondary_tiers:
            tier.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.primary_tier.complete_load(keys, req_context)

    # --- stores and cascades --------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        # Unconditionally: finished jobs unpin chunks, and eviction must see them.
        self._processed_jobs_this_step = True
        self._process_finished_jobs()
        out = self.primary_tier.prepare_store(keys, req_context)
        if out is None:
            return None
        state = self._req_state.get(req_context.req_id)
        if state is None:  # a v0.22 caller: no request lifecycle
            return out
        if out.keys_to_store:
            state.pending_primary_stores += 1
        if state.request_level_tiers:
            storing = set(out.keys_to_store)
            held = [key for key in keys if key not in storing]
            if held:
                self._cascade_existing_chunks_to_request_level_tiers(
                    held, req_context, state.request_level_tiers
                )
        return out

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Publish the stored chunks in the primary tier and cascade them to every tier
        whose back-pressure allows it."""
        self.primary_tier.complete_store(keys, req_context, success)
        if success:
            for tier_idx, tier in enumerate(self.secondary_tiers):
                if self._should_store_to_tier(tier, len(keys)):
                    tier.submit_store(self.create_store_job(keys, req_context, tier_idx))
        state = self._req_state.get(req_context.req_id)
        if state is None:
            return
        if state.pending_primary_stores <= 0:
            raise RuntimeError(
                f"request {req_context.req_id!r}: complete_store without a prepared store"
            )
        state.pending_primary_stores -= 1
        self._maybe_finalize_request(req_context.req_id)

    # --- steps --------------------------------------------------------------------------

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._steps_ended_by_caller = True
        self._end_step(context)

    def _end_step(self, context: ScheduleEndContext) -> None:
        # Also on steps without lookups or stores (a tier may still have work).
        self._maybe_process_finished_jobs()
        for tier in self.secondary_tiers:
            tier.serve_external_requests(self._tier_parents[tier])
        # Reset after serving, so the parent lookups of the serving skip the poll.
        self._processed_jobs_this_step = False
        self._flush_pending_promotions()
        # This step's parked keys cannot have landed yet: they are re-parked for next step.
        self._flush_pending_cascades()
        for tier in self.secondary_tiers:
            tier.on_schedule_end(context)
        for req_id in context.new_req_ids:
            state = self._req_state.get(req_id)
            if state is not None:
                self._metrics.on_request_allocated(state.req_context)

    def has_pending_work(self) -> bool:
        return (
            bool(self._jobs)
            or any(state.pending_cascade_keys for state in self._req_state.values())
            or any(tier.has_pending_work() for tier in self.secondary_tiers)
        )

    def take_events(self) -> Iterator[OffloadingEvent]:
        if not self._steps_ended_by_caller:
            self._end_step(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        yield from self.primary_tier.take_events()
        for tier in self.secondary_tiers:
            yield from tier.take_events()

    # --- reset, stats, shutdown -----------------------------------------------------------

    def reset_cache(self) -> None:
        """Drain every tier's jobs, then reset the primary tier (secondary tiers keep their
        data). Live requests carry on; finished ones are finalized. Promotions are held
        until :meth:`on_reset_flushed`: lookups missing the primary tier answer ``MISS``."""
        for tier in self.secondary_tiers:
            tier.drain_jobs()
        self._process_finished_jobs()
        if self._jobs:
            raise RuntimeError(f"jobs {sorted(self._jobs)} still in flight after the drain")
        # Their primary chunks go with the reset; no tier was handed them yet.
        self._pending_load_submissions.clear()
        self._request_load_sources.clear()
        self._metrics.assert_idle()
        finished = []
        for req_id, state in self._req_state.items():
            state.pending_primary_stores = 0
            state.pending_cascade_keys.clear()
            if state.is_finished:
                self._finalize_request(state)
                finished.append(req_id)
        self.primary_tier.reset_cache()
        for req_id in finished:
            del self._req_state[req_id]
        self._processed_jobs_this_step = False
        for tier in self.secondary_tiers:
            if tier.bp_detector is not None:
                tier.bp_detector.reset()
        self._promotions_held = bool(self.secondary_tiers)

    def on_reset_flushed(self) -> None:
        self._promotions_held = False

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The primary tier's, the manager's and every tier's observations, merged."""
        self._metrics.record_backpressure(self.secondary_tiers)
        parts = [self.primary_tier.get_stats(), self._metrics.take_stats()]
        parts.extend(tier.get_stats() for tier in self.secondary_tiers)
        stats: OffloadingConnectorStats | None = None
        for part in parts:
            if part is None or part.is_empty():
                continue
            if stats is None:
                stats = part
            else:
                stats.aggregate(part)
        return stats

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """One series per tier, the primary tier's first, each with its :data:`TIER_LABEL`
        (the tier's own value for that label, if any, is overridden)."""
        primary = self.primary_tier.config_info()
        if len(primary) != 1:
            raise ValueError(f"primary tier config_info: expected one mapping, got {len(primary)}")
        infos = [{**primary[0], TIER_LABEL: self._metrics.primary_tier_label[0]}]
        for tier_idx, tier in enumerate(self.secondary_tiers):
            infos.append({**tier.config_info(), TIER_LABEL: self._metrics.tier_label(tier_idx)[0]})
        return infos

    def shutdown(self) -> None:
        """Stop the tier-poll thread, shut every tier down, then release the primary tier.

        Call without holding :attr:`lock`. A thread that will not stop is kept out by taking
        the lock for the teardown; if even that fails, ``RuntimeError``. If a tier fails to
        shut down, the primary region is kept (the tier may still use it) and the error
        raised once every tier was tried.
        """
        self._stop_tier_poll_thread()
        if self._tier_poll_thread is None:
            self._shutdown_tiers()
            return
        if not self._lock.acquire(timeout=_TIER_POLL_JOIN_TIMEOUT_S):
            raise RuntimeError(
                "tier-poll thread still runs and the manager lock is taken: shutdown() must be "
                "called without holding manager.lock; secondary tiers were not shut down"
            )
        try:
            self._shutdown_tiers()
        finally:
            self._lock.release()

    def _shutdown_tiers(self) -> None:
        error: Exception | None = None
        for tier_idx, tier in enumerate(self.secondary_tiers):
            try:
                tier.shutdown()
            except Exception as exc:
                error = exc
                logger.exception("tier #%d (%s) failed to shut down", tier_idx, tier.tier_type)
        if error is not None:
            raise error
        self.primary_tier.shutdown()


__all__ = [
    "DEFAULT_TIER_POLL_INTERVAL_S",
    "CPUPrimaryTierOffloadingManager",
    "JobMetadata",
    "PendingPromotion",
    "RequestState",
    "TieringOffloadingManager",
]
