"""The secondary-tier interface (upstream v0.33's ``kv_offload.tiering.base``).

A secondary tier never touches GPU memory: after a GPU -> CPU store completes, the tiering
manager copies the new primary (CPU) rows into each secondary tier (a *cascade*); a key that
only a secondary tier holds is copied into a freshly allocated primary row (a *promotion*)
before the CPU -> GPU load. Rows are addressed through a memoryview of the primary tier's
buffer, row ``b`` being primary chunk ``b``. Every tier method runs under the tiering
manager's lock and must return quickly: copies run elsewhere and are reported by
:meth:`SecondaryTierManager.get_finished_jobs`.

A tier may also serve requests that do not come from this engine (a remote peer asking for
chunks): :meth:`SecondaryTierManager.serve_external_requests` hands it a :class:`ParentManager`
to look chunks up in the other tiers and pin them for reading.

v0.22 names still work: ``JobMetadata`` (:class:`TransferJob`, whose ``chunk_ids`` v0.22
called ``block_ids``), and tiers written against v0.22's contract: finished jobs from
``get_finished`` (bridged when subclassed), ``lookup`` answering True / False / None (read
through :func:`as_lookup_result`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.metrics import OffloadingConnectorStats

JobId = int
"""Identifies one asynchronous transfer between the primary tier and a secondary tier."""

TIER_LABEL = "tier"
"""The label that tells the tiers' metric and config-info series apart (``"<index>:<type>"``,
the primary tier being ``"0:primary"``)."""

_MEDIUM_HIT_SOURCE = {Medium.CPU: CacheHitSource.HOST, Medium.STORAGE: CacheHitSource.DISK}


class TieringOffloadingMetrics:
    """The metric names the tiering manager reports (all labelled by :data:`TIER_LABEL`;
    the promotion latency also by outcome)."""

    LOOKUP_SYNC_DELAY = "vllm:kv_offload_tiering_lookup_sync_delay_seconds"
    LOOKUP_ASYNC_DELAY = "vllm:kv_offload_tiering_lookup_async_delay_seconds"
    READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
    READ_TIME = "vllm:kv_offload_tiering_read_time"
    WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
    WRITE_TIME = "vllm:kv_offload_tiering_write_time"
    PROMOTION_JOB_FAILURES = "vllm:kv_offload_tiering_promotion_job_failures"
    CASCADE_JOB_FAILURES = "vllm:kv_offload_tiering_cascade_job_failures"
    CHUNK_QUERIES = "vllm:kv_offload_tiering_chunk_queries"
    CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"
    PRIMARY_WRITE_USAGE_PERC = "vllm:kv_offload_tiering_primary_write_usage_perc"
    PRIMARY_READ_USAGE_PERC = "vllm:kv_offload_tiering_primary_read_usage_perc"
    PROMOTION_ALLOCATION_FAILURES = "vllm:kv_offload_tiering_promotion_allocation_failures"
    ACTIVE_PROMOTION_JOBS = "vllm:kv_offload_tiering_active_promotion_jobs"
    ACTIVE_CASCADE_JOBS = "vllm:kv_offload_tiering_active_cascade_jobs"
    BACKPRESSURE_STORE_LATENCY_EMA = "vllm:kv_offload_tiering_backpressure_store_latency_ema"
    BACKPRESSURE_STORES_DROPPED = "vllm:kv_offload_tiering_backpressure_stores_dropped"
    BACKPRESSURE_BLOCKS_DROPPED = "vllm:kv_offload_tiering_backpressure_blocks_dropped"
    PROMOTION_LATENCY = "vllm:kv_offload_tiering_promotion_latency_seconds"


@dataclass
class TransferJob:
    """One transfer: ``keys[i]`` moves from / to primary chunk ``chunk_ids[i]``.

    ``is_promotion`` is True for secondary -> primary, False for primary -> secondary;
    ``submit_time`` is when the job was created (``time.monotonic()`` seconds).
    """

    job_id: JobId
    keys: Collection[OffloadKey]
    chunk_ids: np.ndarray
    is_promotion: bool
    req_context: ReqContext
    submit_time: float = field(default_factory=time.monotonic)

    @property
    def block_ids(self) -> np.ndarray:
        """v0.22's name of :attr:`chunk_ids`."""
        return self.chunk_ids


JobMetadata = TransferJob
"""v0.22's name of :class:`TransferJob`."""


@dataclass
class JobResult:
    """A finished transfer.

    ``success`` is False if any key failed. For a promotion that partly failed,
    ``successful_keys`` (a subset of the job's keys) names those that landed; None means
    every key shares ``success``. ``transfer_time`` (seconds spent moving data) and
    ``transfer_bytes`` are optional measurements.
    """

    job_id: JobId
    success: bool
    successful_keys: Collection[OffloadKey] | None = None
    transfer_time: float | None = None
    transfer_bytes: int | None = None


class ParentManager(ABC):
    """The tiering manager as a tier serving an external request sees it (the other tiers
    and the primary tier; the calling tier itself is left out of fan-outs).

    Per external request, in order: :meth:`on_new_request`; then :meth:`lookup` per chunk
    and :meth:`create_store_job` for those to send (interleaved as needed); finally
    :meth:`on_request_finished`, also when nothing was found, so lookup state is released.
    """

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Start tracking ``req_context``'s request."""

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Whether ``key`` can be read from the primary tier (``HIT``), is being promoted
        into it (``HIT_PENDING``), is absent (``MISS``) or cannot be told yet (``RETRY``)."""

    @abstractmethod
    def create_store_job(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> TransferJob:
        """Pin ``keys`` (each a ``HIT``) in the primary tier for reading and register a job
        that copies them out; the calling tier reports it through ``get_finished_jobs``."""

    @abstractmethod
    def on_request_finished(self, req_context: ReqContext) -> None:
        """Stop tracking ``req_context``'s request."""


def as_lookup_result(found: LookupResult | bool | None) -> LookupResult:
    """A tier's lookup answer as a :class:`LookupResult`; v0.22 tiers answer True (held),
    False (not held) or None (ask again)."""
    if isinstance(found, LookupResult):
        return found
    if found is None:
        return LookupResult.RETRY
    return LookupResult.HIT if found else LookupResult.MISS


class SecondaryTierManager(ABC):
    """One secondary tier, as the tiering manager drives it.

    Calls never overlap (the manager's lock is held) but may come from different threads:
    a tier that sets ``tolerates_off_thread_polling`` is also polled (finished jobs,
    external requests) from the manager's tier-poll thread between engine steps, for
    counterparts the engine does not drive (a remote peer). Primary rows of a submitted job
    stay reserved until the job is reported finished.

    ``medium`` / ``locality``: where the tier keeps blocks (None: unknown); hits it serves
    count as ``cache_hit_source``, derived from ``medium`` unless a subclass sets it.
    """

    medium: ClassVar[Medium | None] = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    tolerates_off_thread_polling: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "cache_hit_source" not in cls.__dict__ and cls.medium is not None:
            cls.cache_hit_source = _MEDIUM_HIT_SOURCE[cls.medium]
        # A v0.22 tier reports through get_finished(); bridge it to the v0.33 contract
        # before ABCMeta computes the abstract methods.
        if "get_finished" in cls.__dict__ and "get_finished_jobs" not in cls.__dict__:
            cls.get_finished_jobs = cls.__dict__["get_finished"]  # type: ignore[method-assign]
            if "on_new_request" not in cls.__dict__:
                cls.on_new_request = _default_on_new_request  # type: ignore[method-assign]
            if "drain_jobs" not in cls.__dict__:
                cls.drain_jobs = _drain_by_polling  # type: ignore[method-assign]

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        if not getattr(primary_kv_view, "strides", None):
            raise ValueError(
                "primary_kv_view: expected a [num_chunks, chunk bytes] memoryview, got "
                f"{primary_kv_view!r}"
            )
        if backpressure_detector is not None and not isinstance(
            backpressure_detector, BackpressureDetector
        ):
            raise TypeError(
                "backpressure_detector: expected a BackpressureDetector, got "
                f"{type(backpressure_detector).__name__}"
            )
        self._offloading_spec = offloading_spec
        self._primary_kv_view: memoryview = primary_kv_view
        self._block_size_bytes: int = primary_kv_view.strides[0]
        self.tier_type = tier_type
        self.locality: Locality | None = None
        self._bp_detector = backpressure_detector

    @property
    def block_size_bytes(self) -> int:
        """Bytes of one primary chunk (a row of the primary view)."""
        return self._block_size_bytes

    @property
    def bp_detector(self) -> BackpressureDetector | None:
        """The tier's store back-pressure detector (None: stores are never dropped)."""
        return self._bp_detector

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """``HIT``: ``key`` is held and readable; ``MISS``: not held; ``RETRY``: cannot be
        told now (in flight, or an asynchronous lookup pending), ask again."""

    @abstractmethod
    def submit_store(self, job_metadata: TransferJob) -> None:
        """Start copying the job's primary chunks into this tier (skipping keys held
        already, evicting as the tier needs); returns at once. The chunks stay pinned
        until the job is reported."""

    @abstractmethod
    def submit_load(self, job_metadata: TransferJob) -> None:
        """Start copying the job's keys from this tier into its (allocated) primary
        chunks; returns at once."""

    @abstractmethod
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs, loads and stores, that finished since the previous call."""

    def get_finished(self) -> Iterable[JobResult]:
        """v0.22's name of :meth:`get_finished_jobs`."""
        return self.get_finished_jobs()

    def has_pending_work(self) -> bool:
        """True while the engine must keep stepping for this tier (jobs or external work
        outstanding) even with nothing scheduled."""
        return False

    def take_events(self) -> Iterable[OffloadingEvent]:
        """KV events about the storage this tier owns, since the previous call."""
        return ()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """``keys`` were used now (for the tier's eviction order)."""
        return

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """A request is first seen; says how this tier wants its chunks offloaded."""

    def on_request_finished(self, req_context: ReqContext) -> None:
        """No more calls come for this request (its jobs may still be in flight)."""
        return

    def serve_external_requests(self, parent: ParentManager) -> None:
        """Serve requests from outside this engine through ``parent``.

        Called once per scheduler step before the step's promotions are submitted, and per
        tier-poll round for tiers with ``tolerates_off_thread_polling``. ``parent`` is only
        valid during the call, and the manager's lock is held throughout, so a ``HIT`` seen
        here stays valid until pinned; the lock must not be released partway.
        """
        return

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """The end of a scheduler step."""
        return

    @abstractmethod
    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (or failed), never cutting a copy
        short; afterwards no tier I/O touches the primary view and every result is (or was)
        returned by :meth:`get_finished_jobs`. Queued jobs may be cancelled, reported as
        failed."""

    def shutdown(self) -> None:
        """Release the tier's threads, files or connections."""
        return

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The metrics this tier reports, by name."""
        return {}

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The tier's observations since the previous call (None: none collected)."""
        return None

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        """The config-info label names of a tier configured by ``tier_config``
        (:data:`TIER_LABEL` is added by the spec and must not be declared)."""
        return ()

    def config_info(self) -> ConfigInfoMapping:
        """The values of this tier's config-info labels (its one series)."""
        return {}


def _default_on_new_request(
    self: SecondaryTierManager, req_context: ReqContext
) -> RequestOffloadingContext:
    return RequestOffloadingContext()


def _drain_by_polling(self: SecondaryTierManager) -> None:
    """Drain a v0.22 tier, which has no drain: wait while it reports pending work."""
    while self.has_pending_work():
        time.sleep(0.001)


__all__ = [
    "TIER_LABEL",
    "as_lookup_result",
    "JobId",
    "JobMetadata",
    "JobResult",
    "ParentManager",
    "SecondaryTierManager",
    "TieringOffloadingMetrics",
    "TransferJob",
]
