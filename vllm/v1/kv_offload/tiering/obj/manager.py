"""The object-store secondary tier (upstream v0.33's ``tiering.obj.manager``).

Each offloaded block is one object, named like the file-system tier's file (the
:class:`~vllm.v1.kv_offload.file_mapper.FileMapper` path under ``prefix``), holding the block's
primary row byte for byte. NIXL's OBJ backend moves the bytes between the primary tier's buffer
(registered once as DRAM) and the bucket; a job is one NIXL transfer of all its blocks, polled
by :meth:`ObjectStoreSecondaryTierManager.get_finished_jobs` (NIXL reports completion only when
asked, so the tier keeps the engine stepping while transfers are in flight). Lookups ask NIXL
whether the objects exist, batched on the lookup thread. The tier never deletes objects: the
bucket's lifecycle rules bound it.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from vllm.distributed.nixl_utils import NixlWrapper as nixl_agent
from vllm.distributed.nixl_utils import nixl_agent_config
from vllm.v1.kv_offload.base import (
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, TransferJob
from vllm.v1.kv_offload.tiering.obj.config import ObjStoreConfig
from vllm.v1.kv_offload.tiering.storage_tier import StorageTierManager

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

_AGENT_NAME = "ObjAgent"
_BACKEND = "OBJ"
_STATE_IN_PROGRESS = "PROC"
_STATE_DONE = "DONE"
_STATE_ERROR = "ERR"
# NIXL's OBJ backend maps a descriptor's device id to its object key, so every registered
# object descriptor needs its own id. Id 0 is kept for existence probes, whose address and
# length NIXL ignores.
_PROBE_DEV_ID = 0
_DRAM_DEV_ID = 0
_CONNECTIVITY_KEY = "__nixl_probe__/connectivity_test"
_DRAIN_WARN_SECONDS = 5.0


class TransferEntry(NamedTuple):
    """The NIXL handles of an in-flight job, released once it has finished."""

    xfer_handle: Any
    files_desc: Any
    obj_handle: Any


class ObjAsyncLookupManager(AsyncLookupManager):
    """Asks NIXL about a batch of objects in one ``query_memory`` call (one round trip per
    request and step, on the lookup thread)."""

    def __init__(self, tier: ObjectStoreSecondaryTierManager, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._objects_exist([self._tier._object_key(key) for key in keys])


class ObjectStoreSecondaryTierManager(StorageTierManager):
    """Blocks as objects of an S3-compatible bucket, through NIXL's OBJ backend.

    ``store_config``: the :class:`ObjStoreConfig` fields (bucket, endpoint, credentials).
    ``prefix``: prepended to every object key (``""``: none). ``io_threads``: NIXL's I/O
    threads. ``enable_kv_events`` / ``locality``: as for every :class:`StorageTierManager`.
    The bucket must answer an existence probe here, else ``RuntimeError``.
    """

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        store_config: dict,
        prefix: str = "",
        io_threads: int = 4,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        # Settings first: a bad value fails before any connection is made.
        super().__init__(
            offloading_spec,
            primary_kv_view,
            tier_type,
            enable_kv_events,
            locality,
            backpressure_detector,
        )
        if not isinstance(store_config, dict):
            raise TypeError(f"store_config: expected a dict, got {type(store_config).__name__}")
        obj_config = ObjStoreConfig(**store_config)
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads: expected an int >= 1, got {io_threads!r}")
        if nixl_agent is None or nixl_agent_config is None:
            raise ImportError("the obj tier needs NIXL's Python package (pip install nixl)")
        self._transfers: dict[JobId, TransferEntry] = {}
        # Results not yet handed out: submissions that failed, and jobs drain_jobs() saw end.
        self._pending_results: list[JobResult] = []
        self._next_obj_dev_id = _PROBE_DEV_ID + 1
        self._num_chunks = len(primary_kv_view)
        self._file_mapper = FileMapper.from_offloading_spec(
            root_dir=prefix.rstrip("/"),
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        )
        agent_config = nixl_agent_config(backends=[], capture_telemetry=True)
        self._agent = nixl_agent(_AGENT_NAME, agent_config)
        self._agent.create_backend(
            _BACKEND, {**obj_config.to_nixl_params(), "num_threads": str(io_threads)}
        )
        self._check_connectivity()
        # The whole primary buffer, registered once; a transfer picks rows by index.
        base = ctypes.addressof(ctypes.c_char.from_buffer(primary_kv_view))
        row = self.block_size_bytes
        self._primary_reg: Any = self._agent.register_memory(
            [(base, primary_kv_view.nbytes, _DRAM_DEV_ID, "")], "DRAM"
        )
        rows = [(base + i * row, row, _DRAM_DEV_ID) for i in range(self._num_chunks)]
        # NIXL names the local side of a prepared transfer "NIXL_INIT_AGENT".
        self._dram_prepped_handle: Any = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", rows, "DRAM"
        )
        self._lookup_manager = ObjAsyncLookupManager(self, tier_type)

    # ---- object names and probes --------------------------------------------------------

    def _object_key(self, key: OffloadKey) -> str:
        # Without a prefix the mapper's path starts with "/": object keys do not.
        return self._file_mapper.get_file_name(key).lstrip("/")

    def _objects_exist(self, object_keys: list[str]) -> list[bool]:
        probes = [(0, 1, _PROBE_DEV_ID, name) for name in object_keys]
        answers = self._agent.query_memory(probes, _BACKEND, _BACKEND)
        return [answer is not None for answer in answers]

    def _check_connectivity(self) -> None:
        """One existence probe of a key that never exists: any answer means the bucket is
        reachable; an exception means the settings are wrong."""
        try:
            self._objects_exist([_CONNECTIVITY_KEY])
        except Exception as exc:
            raise RuntimeError(
                f"obj tier {self.tier_type!r}: the object store did not answer a probe; check "
                f"bucket, endpoint_override and scheme, and the credentials (access_key / "
                f"secret_key, or the AWS SDK's default chain): {exc}"
            ) from exc
        logger.info("obj tier %r: the object store answers", self.tier_type)

    # ---- jobs ----------------------------------------------------------------------------

    def _rows(self, job: TransferJob) -> np.ndarray:
        """The job's primary rows as NIXL's int32 indices, checked against the buffer."""
        rows = np.asarray(job.chunk_ids)
        if len(rows) != len(job.keys):
            raise ValueError(
                f"job {job.job_id}: expected one chunk id per key, got {len(rows)} for "
                f"{len(job.keys)} keys"
            )
        if len(rows) and (rows.min() < 0 or rows.max() >= self._num_chunks):
            raise ValueError(
                f"job {job.job_id}: chunk ids: expected ids in [0, {self._num_chunks}), got "
                f"{rows.min()}..{rows.max()}"
            )
        return rows.astype(np.int32, copy=False)

    def _submit(self, job: TransferJob, op: str) -> None:
        """Start a NIXL transfer of the job's rows (``op``: ``"WRITE"`` to the bucket,
        ``"READ"`` from it); a step that fails reports the job failed at the next poll."""
        rows = self._rows(job)
        first = self._next_obj_dev_id
        objects = [
            (0, self.block_size_bytes, first + i, self._object_key(key))
            for i, key in enumerate(job.keys)
        ]
        self._next_obj_dev_id += len(objects)
        files_desc = obj_handle = xfer_handle = None
        try:
            files_desc = self._agent.register_memory(objects, _BACKEND)
            if files_desc is None:
                raise RuntimeError("register_memory refused the object descriptors")
            obj_handle = self._agent.prep_xfer_dlist(_AGENT_NAME, files_desc.trim())
            if not obj_handle:
                raise RuntimeError("prep_xfer_dlist refused the object descriptors")
            xfer_handle = self._agent.make_prepped_xfer(
                op,
                self._dram_prepped_handle,
                rows,
                obj_handle,
                np.arange(len(objects), dtype=np.int32),
            )
            if not xfer_handle:
                raise RuntimeError("make_prepped_xfer refused the transfer")
            if self._agent.transfer(xfer_handle) == _STATE_ERROR:
                raise RuntimeError("transfer could not start")
        except Exception as exc:
            logger.warning("obj tier %r: job %d: %s", self.tier_type, job.job_id, exc)
            self._release(job.job_id, TransferEntry(xfer_handle, files_desc, obj_handle))
            self._pending_results.append(JobResult(job_id=job.job_id, success=False))
            return
        self._transfers[job.job_id] = TransferEntry(xfer_handle, files_desc, obj_handle)

    def _release(self, job_id: JobId, entry: TransferEntry) -> bool:
        """Release a job's NIXL handles; False while NIXL refuses to let go of the transfer
        (it may still touch the primary rows, so the job must not finish yet)."""
        if entry.xfer_handle:
            try:
                self._agent.release_xfer_handle(entry.xfer_handle)
            except Exception as exc:
                logger.warning("obj tier: job %d: release_xfer_handle: %s", job_id, exc)
                return False
        # Past this point nothing touches the rows: a failure only leaks NIXL metadata.
        cleanups = (
            ("release_dlist_handle", self._agent.release_dlist_handle, entry.obj_handle),
            ("deregister_memory", self._agent.deregister_memory, entry.files_desc),
        )
        for name, release, handle in cleanups:
            if handle:
                try:
                    release(handle)
                except Exception as exc:
                    logger.warning("obj tier: job %d: %s: %s", job_id, name, exc)
        return True

    def _poll(self) -> None:
        """Check every in-flight transfer once; finished ones (done or failed) release their
        handles and wait in ``_pending_results``."""
        for job_id, entry in list(self._transfers.items()):
            try:
                state = self._agent.check_xfer_state(entry.xfer_handle)
            except Exception as exc:
                logger.warning("obj tier: job %d: check_xfer_state: %s", job_id, exc)
                state = _STATE_ERROR
            if state == _STATE_IN_PROGRESS:
                continue
            success = state == _STATE_DONE
            if not success:
                logger.warning("obj tier: job %d: transfer ended in state %s", job_id, state)
            seconds = None
            if success:  # NIXL's telemetry counts microseconds
                seconds = self._agent.get_xfer_telemetry(entry.xfer_handle).xferDuration / 1e6
            if not self._release(job_id, entry):
                continue  # polled again next time, until NIXL releases it
            del self._transfers[job_id]
            self._pending_results.append(
                JobResult(job_id=job_id, success=success, transfer_time=seconds)
            )

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._job_started(job_metadata.job_id, list(job_metadata.keys), is_store=True)
        self._submit(job_metadata, "WRITE")

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._job_started(job_metadata.job_id, list(job_metadata.keys), is_store=False)
        self._submit(job_metadata, "READ")

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Poll the transfers: the jobs finished since the previous call. A failed load turns
        the verdicts on its keys into misses, so the scheduler does not promote them again."""
        self._poll()
        results, self._pending_results = self._pending_results, []
        for result in results:
            self._job_finished(result.job_id, result.success, set(result.successful_keys or ()))
        return results

    def has_pending_work(self) -> bool:
        """Transfers in flight: NIXL reports them only when polled, so keep stepping."""
        return bool(self._transfers or self._pending_results)

    def drain_jobs(self) -> None:
        """Poll until no transfer is in flight (results wait for :meth:`get_finished_jobs`);
        a transfer stuck for 5 s is logged once."""
        start = time.monotonic()
        warned = False
        while self._transfers:
            self._poll()
            if not self._transfers:
                return
            if not warned and time.monotonic() - start > _DRAIN_WARN_SECONDS:
                logger.warning(
                    "obj tier %r: %d transfers still in flight after %.0f s of draining",
                    self.tier_type,
                    len(self._transfers),
                    _DRAIN_WARN_SECONDS,
                )
                warned = True
            time.sleep(0.001)

    def shutdown(self) -> None:
        """Stop the lookup thread and release every NIXL handle (in-flight transfers are
        abandoned); a second call does nothing."""
        self._lookup_manager.shutdown()
        for job_id, entry in self._transfers.items():
            self._release(job_id, entry)
        self._transfers.clear()
        if self._dram_prepped_handle is not None:
            try:
                self._agent.release_dlist_handle(self._dram_prepped_handle)
            except Exception as exc:
                logger.warning("obj tier: releasing the primary rows' handle: %s", exc)
            self._dram_prepped_handle = None
        if self._primary_reg is not None:
            try:
                self._agent.deregister_memory(self._primary_reg)
            except Exception as exc:
                logger.warning("obj tier: deregistering the primary buffer: %s", exc)
            self._primary_reg = None
