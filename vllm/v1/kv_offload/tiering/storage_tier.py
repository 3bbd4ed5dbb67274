"""What the storage tiers (file system, object store) share: blocks in storage probed by an
:class:`~vllm.v1.kv_offload.tiering.async_lookup.AsyncLookupManager` on its own thread, optional
"stored" events, and failed loads turned into misses."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobId, SecondaryTierManager

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)


class StorageTierManager(SecondaryTierManager):
    """Base of a storage tier. ``enable_kv_events``: announce stored blocks
    (:meth:`take_events`) when KV cache events are enabled globally too. ``locality``:
    ``"LOCAL"`` or ``"REMOTE"`` (a :class:`Locality` name), the storage's place relative to
    this instance, carried by the events. A subclass sets ``_lookup_manager`` and calls
    :meth:`_job_started` / :meth:`_job_finished` around each job."""

    medium: ClassVar[Medium | None] = Medium.STORAGE
    _lookup_manager: AsyncLookupManager

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        enable_kv_events: bool,
        locality: str | None,
        backpressure_detector: BackpressureDetector | None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                logger.warning(
                    "tier %r: enable_kv_events is set but KV cache events are disabled "
                    "globally; the tier emits none",
                    tier_type,
                )
        # Per in-flight job: the store's keys (only with events on) and the load's keys (a
        # failed load turns the verdicts on the keys it did not load into misses).
        self._store_job_keys: dict[JobId, list[OffloadKey]] = {}
        self._load_job_keys: dict[JobId, list[OffloadKey]] = {}

    def _job_started(self, job_id: JobId, keys: list[OffloadKey], is_store: bool) -> None:
        if not is_store:
            self._load_job_keys[job_id] = keys
        elif self.events is not None:
            self._store_job_keys[job_id] = keys

    def _job_finished(self, job_id: JobId, success: bool, loaded: Collection[OffloadKey]) -> None:
        """Announce a successful store; mark the keys a failed load did not bring in
        (``loaded``: those it did) as misses, so the scheduler does not promote them again."""
        store_keys = self._store_job_keys.pop(job_id, None)
        if self.events is not None and success and store_keys:
            self.events.append(
                OffloadingEvent(
                    keys=store_keys, medium=self.medium, removed=False, locality=self.locality
                )
            )
        load_keys = self._load_job_keys.pop(job_id, None)
        if load_keys is not None and not success:
            self._lookup_manager.mark_miss([key for key in load_keys if key not in loaded])

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookup_manager.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup_manager.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup_manager.flush()


__all__ = ["StorageTierManager"]
