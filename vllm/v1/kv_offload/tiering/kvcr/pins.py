"""Serving KVCR's requests to pin primary-tier blocks for a remote reader.

KVCR (on its own progress thread) asks the framework to pin blocks a remote peer wants to
read out of this engine's primary tier. The tiering manager can only be driven from
:meth:`SecondaryTierManager.serve_external_requests`, under its lock, so requests are queued
here and resolved on that call: a hit becomes a primary-tier store job whose rows stay
pinned until KVCR releases the pin, when the job is reported finished.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection

from kvcr.types import BlockKey, MemoryRef, PinHandle, PinRequestId, PinResult

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, ParentManager, TransferJob

logger = logging.getLogger(__name__)

# Pin handles and synthetic request ids are visible in logs; the prefixes say who made them.
_PIN_HANDLE_PREFIX = "kvcr-job-"
_SOURCE_REQUEST_PREFIX = "kvcr-source:"


class FrameworkPinServer:
    """The pin callbacks KVCR is bound to (``request_pin``, ``poll_pin_results``,
    ``release_pin``, ``cancel_pin_request``), backed by primary-tier store jobs.

    KVCR calls them from its progress thread while the scheduler thread serves and drains,
    so the shared queues are guarded by a lock (never held while calling the parent).
    """

    def __init__(self, make_ref: Callable[[int], MemoryRef]) -> None:
        """``make_ref``: the KVCR reference to primary-tier row (chunk) ``n``."""
        self._make_ref = make_ref
        self._lock = threading.Lock()
        self._next_pin_request = 0
        self._next_source_request = 0
        self._pending: dict[PinRequestId, tuple[BlockKey, ...]] = {}
        self._answers: list[tuple[PinRequestId, PinResult]] = []
        # Granted pins: handle -> the store job whose rows it holds.
        self._pinned_jobs: dict[PinHandle, int] = {}
        self._job_results: list[JobResult] = []

    def request_pin(self, keys: Collection[BlockKey]) -> PinRequestId:
        """Queue a request to pin ``keys``; answered after the next :meth:`serve`."""
        with self._lock:
            request = PinRequestId(self._next_pin_request)
            self._next_pin_request += 1
            self._pending[request] = tuple(keys)
        return request

    def cancel_pin_request(self, request: PinRequestId) -> None:
        """Drop ``request`` if it is still queued (an answered one is released instead)."""
        with self._lock:
            self._pending.pop(request, None)

    def poll_pin_results(self) -> list[tuple[PinRequestId, PinResult]]:
        """The answers produced since the previous call."""
        with self._lock:
            answers, self._answers = self._answers, []
        return answers

    def release_pin(self, pin_handle: PinHandle) -> bool:
        """End the pin ``pin_handle``: its store job finishes successfully.

        Idempotent (True for a handle released before): KVCR retries a release that returned
        False, and a repeated release must not fail it forever.
        """
        with self._lock:
            job_id = self._pinned_jobs.pop(pin_handle, None)
            if job_id is not None:
                self._job_results.append(JobResult(job_id=job_id, success=True))
        return True

    def has_active_pins(self) -> bool:
        """True while some granted pin is not released yet."""
        with self._lock:
            return bool(self._pinned_jobs)

    def take_job_results(self) -> list[JobResult]:
        """The pin store jobs that finished (released, or failed to become a pin)."""
        with self._lock:
            results, self._job_results = self._job_results, []
        return results

    def serve(self, parent: ParentManager) -> None:
        """Answer every queued request through ``parent`` (valid during this call only)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        answers = [(request, self._pin(parent, keys)) for request, keys in pending.items()]
        with self._lock:
            self._answers.extend(answers)

    def _pin(self, parent: ParentManager, keys: tuple[BlockKey, ...]) -> PinResult:
        """Pin the primary-tier hits among ``keys``: ``(handle, refs)`` with None refs for the
        misses, or None when nothing could be pinned."""
        offload_keys = [OffloadKey(bytes(key)) for key in keys]
        req_context = ReqContext(req_id=f"{_SOURCE_REQUEST_PREFIX}{self._next_source_request}")
        self._next_source_request += 1
        opened = False
        job: TransferJob | None = None
        granted = False
        try:
            parent.on_new_request(req_context)
            opened = True
            hits = [
                key for key in offload_keys if parent.lookup(key, req_context) is LookupResult.HIT
            ]
            if not hits:
                return None
            job = parent.create_store_job(hits, req_context)
            job_keys = list(job.keys)
            rows = [int(row) for row in job.chunk_ids]
            if len(job_keys) != len(rows) or set(job_keys) != set(hits):
                logger.warning(
                    "KVCR pin: the parent's store job %d covers other keys than the %d hits",
                    job.job_id,
                    len(hits),
                )
                return None
            refs: dict[BlockKey, list[MemoryRef] | None] = dict.fromkeys(keys)
            for key, row in zip(job_keys, rows, strict=True):
                refs[BlockKey(key)] = [self._make_ref(row)]
            handle = f"{_PIN_HANDLE_PREFIX}{job.job_id}"
            with self._lock:
                self._pinned_jobs[handle] = job.job_id
            granted = True
            return handle, refs
        except Exception:
            # A pin is best effort: the remote reader falls back to another source.
            logger.warning("KVCR pin: serving a pin request failed", exc_info=True)
            return None
        finally:
            if opened:
                try:
                    parent.on_request_finished(req_context)
                except Exception:
                    logger.warning("KVCR pin: closing the source request failed", exc_info=True)
            if job is not None and not granted:
                # Unpins the job's primary rows without a pin ever holding them.
                with self._lock:
                    self._job_results.append(JobResult(job_id=job.job_id, success=False))
