"""The Mooncake secondary tier: offloaded blocks in a Mooncake distributed store, shared by
every engine instance that uses the same store and page format.

A cascade puts each primary row (every worker's pages of one offloaded block) behind its header
as one store object; a promotion reads the objects straight into the reserved primary rows and
then checks every header (sizes are checked by the read itself): one Mooncake batch call per
direction (see :mod:`.blocks`). Copies run on one load-first and one store-first thread, so the
scheduler never waits on the store; ``lookup`` is one existence query. A store that cannot be
reached is a miss: after a query or put the master did not answer (a lookup's, or a cascade's),
lookups answer ``MISS`` at once and jobs fail at once for ``retry_after_s`` seconds instead of
stalling the scheduler on each key; a promotion that cannot reach the store just fails (a miss),
and the rows of a failed promotion are dropped, never read. A block whose promotion found a
foreign or corrupt object is a miss from then on, so the engine recomputes it instead of
retrying the same bad object; when it is offloaded again, this tier replaces the bad objects.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.config import MooncakeConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import MooncakeStoreClient
from vllm.kv_quant.calibrated import KVCacheCalibration
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.page_format import KVPageFormat
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool
from vllm.v1.kv_offload.tiering.mooncake.blocks import (
    DEFAULT_KEY_PREFIX,
    BadStoreObject,
    MooncakeRowStore,
    StoreUnreachable,
    check_row_store_args,
    offload_key_name,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

MAX_RECORDED_FAILURES = 4096
"""Blocks whose last failure is remembered (oldest forgotten first)."""


def primary_rows(primary_kv_view: memoryview) -> torch.Tensor:
    """The ``[num_rows, row bytes]`` uint8 tensor over the primary rows (no copy)."""
    if primary_kv_view.ndim != 2 or primary_kv_view.itemsize != 1:
        raise ValueError(
            "primary_kv_view: expected a [num_blocks, row bytes] byte view, got "
            f"{primary_kv_view.ndim} dimensions of {primary_kv_view.itemsize}-byte items"
        )
    if primary_kv_view.readonly:
        raise ValueError("primary_kv_view: expected writable rows, got a read-only view")
    flat = np.frombuffer(primary_kv_view, dtype=np.uint8)
    return torch.from_numpy(flat.reshape(primary_kv_view.shape))


def row_page_format(
    offloading_spec: OffloadingSpec,
    model: str | None = None,
    kv_cache_dtype: str | None = None,
    scale_layouts: Mapping[str, Sequence[Any]] | None = None,
    kv_scales: Mapping[str, Sequence[float]] | None = None,
    kv_cache_layout: str | None = None,
    calibration: str | None = None,
) -> KVPageFormat:
    """The format of one primary row of ``offloading_spec``'s engine: every worker's cells
    (``block_size_factor`` pages of each KV-cache tensor); ``model`` and ``kv_cache_dtype``
    default to the engine's, ``kv_cache_layout`` to the layout in effect; ``calibration`` is
    the path of the layers' calibration file (:class:`~vllm.kv_quant.KVCacheCalibration`)."""
    engine = offloading_spec.vllm_config
    if engine is None or offloading_spec.kv_cache_config is None:
        raise ValueError(
            "offloading_spec: the Mooncake tier describes its rows from the engine's "
            "KVCacheConfig; expected a spec built from (vllm_config, kv_cache_config), got one "
            "built from an OffloadingConfig"
        )
    return KVPageFormat.from_kv_cache_config(
        offloading_spec.kv_cache_config,
        model=model if model is not None else engine.model_config.model,
        kv_cache_dtype=str(
            kv_cache_dtype if kv_cache_dtype is not None else engine.cache_config.cache_dtype
        ),
        block_size_factor=offloading_spec.block_size_factor,
        num_workers=engine.parallel_config.world_size,
        scale_layouts=scale_layouts,
        kv_scales=kv_scales,
        kv_cache_layout=kv_cache_layout,
        calibration=None if calibration is None else KVCacheCalibration.load(calibration),
    )


class MooncakeTierManager(SecondaryTierManager):
    """Blocks as objects of a Mooncake store (tier type ``"mooncake"``).

    Tier-config keys (besides ``"type"``): ``"mooncake"``, a mapping of
    :class:`~vllm.distributed.kv_transfer.kv_connector.v1.mooncake.config.MooncakeConfig`
    fields (unset ones come from the ``MOONCAKE_*`` environment); ``"key_prefix"`` (default
    ``"vllm-kv"``); ``"max_blocks_per_batch"`` (default 256); ``"retry_after_s"`` (default
    5.0); and what besides the KV-cache config decides the bytes: ``"model"`` (default the
    engine's model), ``"kv_cache_dtype"`` (default the engine's cache dtype),
    ``"scale_layouts"``, ``"kv_scales"``, ``"kv_cache_layout"`` (default the layout in effect)
    and ``"calibration"`` (a calibration file's path; see
    :meth:`~vllm.v1.kv_offload.page_format.KVPageFormat.from_kv_cache_config`). Those and the
    layers' specs (their encodings) make the format fingerprint in every key, so instances
    share exactly the blocks they can read.

    The client connects at construction: an unreachable master is a ``MooncakeStoreError``
    here, in seconds.
    """

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        mooncake: Mapping[str, Any] | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        max_blocks_per_batch: int = 256,
        retry_after_s: float = 5.0,
        model: str | None = None,
        kv_cache_dtype: str | None = None,
        scale_layouts: Mapping[str, Sequence[Any]] | None = None,
        kv_scales: Mapping[str, Sequence[float]] | None = None,
        kv_cache_layout: str | None = None,
        calibration: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        number = isinstance(retry_after_s, (int, float)) and not isinstance(retry_after_s, bool)
        if not number or not retry_after_s >= 0:
            raise ValueError(f"retry_after_s: expected seconds ≥ 0, got {retry_after_s!r}")
        self.page_format: KVPageFormat = row_page_format(
            offloading_spec,
            model,
            kv_cache_dtype,
            scale_layouts,
            kv_scales,
            kv_cache_layout,
            calibration,
        )
        rows = primary_rows(primary_kv_view)
        check_row_store_args(rows, self.page_format, key_prefix, max_blocks_per_batch)
        config = MooncakeConfig.from_mapping(mooncake)
        client = MooncakeStoreClient(config)
        try:
            self.rows = MooncakeRowStore(
                client, rows, self.page_format, key_prefix, max_blocks_per_batch
            )
        except BaseException:
            client.close()
            raise
        self.retry_after_s = float(retry_after_s)
        self._unreachable_until = 0.0
        self._failures: OrderedDict[OffloadKey, BaseException] = OrderedDict()
        # Blocks whose store objects are foreign or corrupt: misses until this tier replaced
        # them; kept apart from the failure log so that other failures never evict them.
        self._bad: OrderedDict[OffloadKey, None] = OrderedDict()
        self._lock = threading.Lock()
        self._in_flight: set[JobId] = set()
        self._closed = False
        self._pool = DualQueueThreadPool(1, 1, thread_name_prefix="vllm_kv_mooncake")

    @property
    def jobs_in_flight(self) -> int:
        """Jobs submitted and not yet reported by :meth:`get_finished_jobs`."""
        return len(self._in_flight)

    def failure(self, key: OffloadKey) -> BaseException | None:
        """The error of ``key``'s last failed copy (None when its last copy succeeded or none
        failed), for diagnosis; the error is also logged."""
        with self._lock:
            return self._failures.get(key)

    def _record(
        self,
        keys: Iterable[OffloadKey],
        error: BaseException | None,
        replaced: Iterable[OffloadKey] = (),
    ) -> None:
        """The outcome of a job of ``keys``: a bad object found by a promotion makes its own
        block a miss from now on, until a store job of this tier replaced it (``replaced``)."""
        bad = error.name if isinstance(error, BadStoreObject) else None
        with self._lock:
            for key in keys:
                self._failures.pop(key, None)
                if error is not None:
                    self._failures[key] = error
                if bad is not None and offload_key_name(key) == bad:
                    self._bad[key] = None
            for key in replaced:
                self._bad.pop(key, None)
            for log in (self._failures, self._bad):
                while len(log) > MAX_RECORDED_FAILURES:
                    log.popitem(last=False)

    def _is_bad(self, key: OffloadKey) -> bool:
        with self._lock:
            return key in self._bad

    def _store_unreachable(self) -> bool:
        return time.monotonic() < self._unreachable_until

    def _mark_unreachable(self, error: StoreUnreachable) -> None:
        self._unreachable_until = time.monotonic() + self.retry_after_s
        logger.warning(
            "Mooncake tier: the store does not answer (%s); lookups are misses for %.1f s",
            error,
            self.retry_after_s,
        )

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        # A foreign or corrupt object is a miss: recompute rather than retry it.
        if self._closed or self._is_bad(key) or self._store_unreachable():
            return LookupResult.MISS
        try:
            present = self.rows.present([offload_key_name(key)])[0]
        except StoreUnreachable as e:
            self._mark_unreachable(e)
            return LookupResult.MISS
        return LookupResult.HIT if present else LookupResult.MISS

    def _task(self, job: TransferJob) -> Callable[[], None]:
        keys = list(job.keys)
        rows = np.asarray(job.chunk_ids, dtype=np.int64)

        def run() -> None:
            replaced: list[OffloadKey] = []
            try:
                if self._store_unreachable():
                    raise RuntimeError(
                        "mooncake store: unreachable at the last query (retried "
                        f"{self.retry_after_s} s after it)"
                    )
                names = [offload_key_name(k) for k in keys]
                try:
                    if job.is_promotion:
                        self.rows.load(names, rows)
                    else:
                        # Bad objects this tier found would be kept by the put (Mooncake
                        # keeps an object already there): the store replaces them.
                        bad = {n for k, n in zip(keys, names, strict=True) if self._is_bad(k)}
                        self.rows.store(names, rows, replace=bad)
                        replaced = [k for k, n in zip(keys, names, strict=True) if n in bad]
                except StoreUnreachable as e:
                    self._mark_unreachable(e)
                    raise
            except Exception as e:
                self._record(keys, e)
                raise
            self._record(keys, None, replaced)

        return run

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._pool.enqueue_store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._pool.enqueue_load)

    def _submit(
        self, job: TransferJob, enqueue: Callable[[JobId, int, list[Callable[[], None]]], None]
    ) -> None:
        if self._closed:
            raise RuntimeError(f"job {job.job_id}: the Mooncake tier is shut down")
        self._in_flight.add(job.job_id)
        enqueue(job.job_id, 1, [self._task(job)])

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished = [
            JobResult(job.job_id, job.success, transfer_time=job.transfer_time)
            for job in self._pool.get_finished()
        ]
        for result in finished:
            self._in_flight.discard(result.job_id)
        return finished

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        self._pool.wait_idle()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # the store evicts by its own policy

    def shutdown(self) -> None:
        """Drop queued copies (the pool reports them failed to :meth:`get_finished_jobs`), stop the
        threads (running copies finish), disconnect; lookups are misses from then on."""
        self._closed = True
        self._pool.shutdown(wait=True)
        self.rows.client.close()
