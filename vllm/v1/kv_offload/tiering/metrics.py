"""What the tiering manager measures (upstream v0.33's ``kv_offload.tiering.metrics``).

:class:`TieringMetricsTracker` turns the manager's lookups and job lifecycle into an
:class:`OffloadingConnectorStats` payload, every series labelled by tier (``"0:primary"``,
then ``"<index + 1>:<type>"`` per secondary tier):

- lookups: queries and hits per tier, the time a lookup call took, and for a lookup that
  answered ``RETRY`` first, the time until it resolved; counted once per key and tier for a
  request, and only until the request is allocated (later lookups of it are re-checks);
- jobs: bytes and transfer time of finished promotions (reads) and cascades (writes),
  failures, promotion latency (creation to report) by outcome, and gauges of jobs in flight
  and of the share of primary chunks they hold;
- back-pressure: each detector's latency EMA and the stores / blocks it dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
from vllm.v1.kv_offload.metrics import (
    OffloadingConnectorStats,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)
from vllm.v1.kv_offload.tiering.base import (
    TIER_LABEL,
    JobResult,
    TieringOffloadingMetrics,
    TransferJob,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

TierLabel = tuple[str]
PRIMARY_TIER_LABEL: TierLabel = ("0:primary",)

_M = TieringOffloadingMetrics

_LOOKUP_SYNC_BUCKETS_S = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0)
_LOOKUP_ASYNC_BUCKETS_S = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
_PROMOTION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def tiering_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """What the tiering manager reports, by metric name (all labelled by tier but the
    promotion allocation failures; the promotion latency also by ``result``)."""
    tier = (TIER_LABEL,)

    def counter(doc: str, labels: tuple[str, ...] = tier) -> OffloadingCounterMetadata:
        return OffloadingCounterMetadata(documentation=doc, labelnames=labels)

    def gauge(doc: str) -> OffloadingGaugeMetadata:
        return OffloadingGaugeMetadata(documentation=doc, labelnames=tier)

    return {
        _M.LOOKUP_SYNC_DELAY: OffloadingHistogramMetadata(
            documentation="Seconds one chunk lookup in a tier blocked, for lookups that "
            "resolved to a hit or a miss.",
            labelnames=tier,
            buckets=_LOOKUP_SYNC_BUCKETS_S,
        ),
        _M.LOOKUP_ASYNC_DELAY: OffloadingHistogramMetadata(
            documentation="Seconds from a tier's first retry answer for a chunk until its "
            "lookup resolved to a hit or a miss.",
            labelnames=tier,
            buckets=_LOOKUP_ASYNC_BUCKETS_S,
        ),
        _M.READ_BYTES: counter("Bytes promoted from a tier into the primary tier."),
        _M.READ_TIME: counter("Seconds a tier spent moving promoted bytes."),
        _M.WRITE_BYTES: counter("Bytes cascaded from the primary tier into a tier."),
        _M.WRITE_TIME: counter("Seconds a tier spent moving cascaded bytes."),
        _M.PROMOTION_JOB_FAILURES: counter("Promotion jobs of a tier that failed."),
        _M.CASCADE_JOB_FAILURES: counter("Cascade jobs of a tier that failed."),
        _M.CHUNK_QUERIES: counter("Chunk lookups resolved by a tier, before allocation."),
        _M.CHUNK_HITS: counter("Chunk lookups a tier resolved as hits, before allocation."),
        _M.PROMOTION_ALLOCATION_FAILURES: counter(
            "Secondary-tier hits not promoted: the primary tier had no free chunk.", ()
        ),
        _M.PRIMARY_WRITE_USAGE_PERC: gauge(
            "Fraction of primary chunks reserved by a tier's promotions in flight."
        ),
        _M.PRIMARY_READ_USAGE_PERC: gauge(
            "Fraction of primary chunks pinned by a tier's cascades in flight."
        ),
        _M.ACTIVE_PROMOTION_JOBS: gauge("Promotion jobs of a tier in flight."),
        _M.ACTIVE_CASCADE_JOBS: gauge("Cascade jobs of a tier in flight."),
        _M.PROMOTION_LATENCY: OffloadingHistogramMetadata(
            documentation="Seconds from a promotion job's creation until its tier reported "
            "it (queueing included), by result (success / failure).",
            labelnames=(TIER_LABEL, "result"),
            buckets=_PROMOTION_BUCKETS_S,
        ),
        _M.BACKPRESSURE_STORE_LATENCY_EMA: gauge(
            "A tier's moving average of store latency, seconds per MiB."
        ),
        _M.BACKPRESSURE_STORES_DROPPED: counter("Cascades dropped by a tier's back-pressure."),
        _M.BACKPRESSURE_BLOCKS_DROPPED: counter(
            "Chunks of the cascades dropped by a tier's back-pressure."
        ),
    }


class _JobMetadataLike(Protocol):
    @property
    def transfer_job(self) -> TransferJob: ...

    @property
    def tier_idx(self) -> int: ...


@dataclass(slots=True)
class _RequestMetricsState:
    """Per tier, the keys a request's lookups resolved (value None) or saw ``RETRY`` for
    (value: when the first lookup started); None once the request was allocated."""

    observed_lookups: dict[TierLabel, dict[OffloadKey, float | None]] | None = field(
        default_factory=dict
    )


@dataclass
class _TierState:
    """One secondary tier's jobs in flight, and the primary chunks they hold."""

    active_promotion_count: int = 0
    active_cascade_count: int = 0
    primary_write_chunk_count: int = 0
    primary_read_chunk_count: int = 0

    def add(self, job: TransferJob, sign: int) -> None:
        chunks = sign * len(job.chunk_ids)
        if job.is_promotion:
            self.active_promotion_count += sign
            self.primary_write_chunk_count += chunks
        else:
            self.active_cascade_count += sign
            self.primary_read_chunk_count += chunks
        if (
            min(self.active_promotion_count, self.active_cascade_count) < 0
            or min(self.primary_write_chunk_count, self.primary_read_chunk_count) < 0
        ):
            raise RuntimeError(f"job {job.job_id} finished more often than it was registered")

    def is_idle(self) -> bool:
        return not (
            self.active_promotion_count
            or self.active_cascade_count
            or self.primary_write_chunk_count
            or self.primary_read_chunk_count
        )


class TieringMetricsTracker:
    """Collects the tiering manager's observations between two :meth:`take_stats` calls.

    ``tier_types``: the secondary tiers' types, in order; ``num_primary_chunks`` and
    ``primary_chunk_size`` (bytes): the primary tier's size and chunk size.
    """

    def __init__(
        self, tier_types: list[str], num_primary_chunks: int, primary_chunk_size: int
    ) -> None:
        self._tier_types = list(tier_types)
        self._num_primary_chunks = num_primary_chunks
        self._primary_chunk_size = primary_chunk_size
        self._request_states: dict[str, _RequestMetricsState] = {}
        self._tier_states = [_TierState() for _ in self._tier_types]
        self._stats = OffloadingConnectorStats()

    @cached_property
    def _tier_labels(self) -> list[TierLabel]:
        return [(f"{i + 1}:{tier_type}",) for i, tier_type in enumerate(self._tier_types)]

    def tier_label(self, tier_idx: int) -> TierLabel:
        """The label of secondary tier ``tier_idx``."""
        return self._tier_labels[tier_idx]

    @property
    def primary_tier_label(self) -> TierLabel:
        return PRIMARY_TIER_LABEL

    # --- requests and lookups ---------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> None:
        self._request_states[req_context.req_id] = _RequestMetricsState()

    def on_request_allocated(self, req_context: ReqContext) -> None:
        """The request was scheduled: its later lookups are not counted."""
        state = self._request_states.get(req_context.req_id)
        if state is not None:
            state.observed_lookups = None

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._request_states.pop(req_context.req_id, None)

    def on_lookup(
        self,
        req_context: ReqContext,
        key: OffloadKey,
        tier_label: TierLabel,
        result: LookupResult,
        lookup_duration: float,
    ) -> None:
        """A lookup of ``key`` in tier ``tier_label`` answered ``result`` after
        ``lookup_duration`` seconds."""
        state = self._request_states.setdefault(req_context.req_id, _RequestMetricsState())
        if state.observed_lookups is None:
            return
        observed = state.observed_lookups.setdefault(tier_label, {})
        if result is LookupResult.RETRY:
            observed.setdefault(key, time.monotonic() - lookup_duration)
            return
        if result not in (LookupResult.HIT, LookupResult.MISS):
            return
        if key in observed and observed[key] is None:
            return  # resolved before: a re-check, not a new query
        retry_started = observed.get(key)
        observed[key] = None
        self._stats.increase_counter(_M.CHUNK_QUERIES, labelvalues=tier_label)
        if result is LookupResult.HIT:
            self._stats.increase_counter(_M.CHUNK_HITS, labelvalues=tier_label)
        self._stats.observe_histogram(_M.LOOKUP_SYNC_DELAY, lookup_duration, tier_label)
        if retry_started is not None:
            self._stats.observe_histogram(
                _M.LOOKUP_ASYNC_DELAY, time.monotonic() - retry_started, tier_label
            )

    # --- jobs ---------------------------------------------------------------------------

    def on_job_registered(self, job_metadata: _JobMetadataLike) -> None:
        self._tier_states[job_metadata.tier_idx].add(job_metadata.transfer_job, +1)

    def on_job_finished(self, job_metadata: _JobMetadataLike, result: JobResult) -> None:
        job = job_metadata.transfer_job
        label = self.tier_label(job_metadata.tier_idx)
        self._observe_transfer(job, result, label)
        if job.is_promotion:
            # From creation to report, so it includes the tier's queueing (unlike
            # JobResult.transfer_time); failures are observed too, under their own label.
            outcome = "success" if result.success else "failure"
            self._stats.observe_histogram(
                _M.PROMOTION_LATENCY, time.monotonic() - job.submit_time, (*label, outcome)
            )
        self._tier_states[job_metadata.tier_idx].add(job, -1)

    def _observe_transfer(self, job: TransferJob, result: JobResult, label: TierLabel) -> None:
        num_keys = len(job.keys)
        if not result.success:
            failures = _M.PROMOTION_JOB_FAILURES if job.is_promotion else _M.CASCADE_JOB_FAILURES
            self._stats.increase_counter(failures, labelvalues=label)
            if not (job.is_promotion and result.successful_keys):
                return
            num_keys = len(result.successful_keys)
        bytes_metric, time_metric = (
            (_M.READ_BYTES, _M.READ_TIME) if job.is_promotion else (_M.WRITE_BYTES, _M.WRITE_TIME)
        )
        self._stats.increase_counter(bytes_metric, num_keys * self._primary_chunk_size, label)
        if result.transfer_time is not None:
            self._stats.increase_counter(time_metric, result.transfer_time, label)

    def on_promotion_allocation_failure(self) -> None:
        """A secondary-tier hit found no free primary chunk to be promoted into."""
        self._stats.increase_counter(_M.PROMOTION_ALLOCATION_FAILURES)

    def record_backpressure(self, tiers: list[SecondaryTierManager]) -> None:
        """Sample each tier's detector (its EMA; the drops since the previous call)."""
        for tier_idx, tier in enumerate(tiers):
            detector = tier.bp_detector
            if detector is None:
                continue
            label = self.tier_label(tier_idx)
            ema = detector.stats.get("store_latency_ema")
            if ema is not None:
                self._stats.set_gauge(_M.BACKPRESSURE_STORE_LATENCY_EMA, ema, label)
            stores, blocks = detector.policy.pop_stores_dropped()
            if stores:
                self._stats.increase_counter(_M.BACKPRESSURE_STORES_DROPPED, stores, label)
            if blocks:
                self._stats.increase_counter(_M.BACKPRESSURE_BLOCKS_DROPPED, blocks, label)

    # --- reporting ------------------------------------------------------------------------

    def take_stats(self) -> OffloadingConnectorStats | None:
        """The in-flight gauges plus everything observed since the previous call (None
        when there is nothing, i.e. no secondary tier and no observation)."""
        stats = OffloadingConnectorStats()
        total = self._num_primary_chunks
        for tier_idx, state in enumerate(self._tier_states):
            label = self.tier_label(tier_idx)
            write_share = state.primary_write_chunk_count / total if total > 0 else 0.0
            read_share = state.primary_read_chunk_count / total if total > 0 else 0.0
            stats.set_gauge(_M.PRIMARY_WRITE_USAGE_PERC, write_share, label)
            stats.set_gauge(_M.PRIMARY_READ_USAGE_PERC, read_share, label)
            stats.set_gauge(_M.ACTIVE_PROMOTION_JOBS, state.active_promotion_count, label)
            stats.set_gauge(_M.ACTIVE_CASCADE_JOBS, state.active_cascade_count, label)
        observed, self._stats = self._stats, OffloadingConnectorStats()
        stats.aggregate(observed)
        return None if stats.is_empty() else stats

    def assert_idle(self) -> None:
        """Raise unless no job is in flight (after a drain)."""
        busy = [self.tier_label(i)[0] for i, s in enumerate(self._tier_states) if not s.is_idle()]
        if busy:
            raise RuntimeError(f"tiers {busy} still count jobs in flight")


__all__ = [
    "PRIMARY_TIER_LABEL",
    "TierLabel",
    "TieringMetricsTracker",
    "tiering_metric_definitions",
]
