"""The file-system secondary tier (upstream v0.33's ``tiering.fs.manager``).

Each offloaded block is one file named by :class:`~vllm.v1.kv_offload.file_mapper.FileMapper`
under ``root_dir``, holding a header (the folder's settings fingerprint, the key, a CRC-32; see
:mod:`.block_file`) and the block's primary row (every worker's pages of the block) byte for
byte. Lookups are answered asynchronously (:class:`FsAsyncLookupManager`: a key is present when
a file of the right size is at its path). A job is one batched task on the tier's thread pool,
run by the ``vllm.fs_io_C`` extension when it is built. A load verifies the header and the CRC;
a file that fails is removed, and a batch that fails keeps the blocks loaded before the failing
one (``JobResult.successful_keys``). Files are never evicted by the tier.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import (
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, TransferJob
from vllm.v1.kv_offload.tiering.fs.block_file import HEADER_BYTES, BadBlockFile, BlockFileHeader
from vllm.v1.kv_offload.tiering.fs.io import (
    batch_load_block,
    batch_store_block,
    block_file_present,
    probe_o_direct,
)
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool
from vllm.v1.kv_offload.tiering.storage_tier import StorageTierManager

try:
    from vllm.fs_io_C import batch_lookup as batch_lookup_C

    _HAS_BATCH_LOOKUP_C = True
except ImportError:  # not built: one stat per key from Python
    _HAS_BATCH_LOOKUP_C = False

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)


class FsAsyncLookupManager(AsyncLookupManager):
    """Probes the files of a :class:`FileSystemTierManager` on the lookup thread."""

    def __init__(self, tier: FileSystemTierManager, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        paths = [self._tier.file_mapper.get_file_name(key) for key in keys]
        block_size = self._tier.block_size_bytes
        if _HAS_BATCH_LOOKUP_C:  # the whole batch of stat calls without the GIL
            return batch_lookup_C(paths, HEADER_BYTES + block_size)
        return [block_file_present(path, block_size) for path in paths]


class FileSystemTierManager(StorageTierManager):
    """Blocks as files under ``root_dir``, copied by ``n_read_threads`` load-first and
    ``n_write_threads`` store-first threads. The folder's ``config.json`` records the settings
    its name is derived from; a ``root_dir`` that cannot hold it fails here (``OSError``).
    ``enable_kv_events`` / ``locality``: as for every :class:`StorageTierManager`.

    Instances sharing ``root_dir`` share blocks when their settings match (the folder name
    derives from them) and their block hashes agree (the same ``PYTHONHASHSEED`` where the
    prefix-caching hash is not cryptographic).
    """

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        n_read_threads: int = 16,
        n_write_threads: int = 16,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(
            offloading_spec,
            primary_kv_view,
            tier_type,
            enable_kv_events,
            locality,
            backpressure_detector,
        )
        # Per in-flight job: its block count (transfer bytes).
        self._job_blocks: dict[JobId, int] = {}
        # Per failed load job: blocks loaded before the failing one. Written by the pool thread
        # before the job is reported finished, read after: the finished queue orders the two.
        self._load_progress: dict[JobId, int] = {}
        # The parallel-invariant folder is an opt-in FileMapper honours only when the block's
        # bytes do not depend on the parallel layout.
        self.file_mapper = FileMapper.from_offloading_spec(
            root_dir=root_dir,
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        )
        config_dir = self._write_config()
        self._use_o_direct = probe_o_direct(config_dir)
        if not self._use_o_direct:
            logger.warning(
                "fs tier %r: direct I/O is not supported under %r; using buffered I/O",
                tier_type,
                root_dir,
            )
        self._pool = DualQueueThreadPool(
            n_read_threads, n_write_threads, thread_name_prefix="vllm_kv_fs"
        )
        self._lookup_manager = FsAsyncLookupManager(self, tier_type)

    def _write_config(self) -> str:
        """Write the folder's ``config.json`` (once); the folder's path."""
        path = self.file_mapper.get_config_file_path()
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.file_mapper.get_run_config(), f, indent=2, sort_keys=True)
            os.replace(tmp, path)
        return folder

    def _batch(self, job: TransferJob) -> tuple[list[OffloadKey], list]:
        """The job's keys and the arguments of its batched block I/O call."""
        keys = list(job.keys)
        if len(keys) != len(job.chunk_ids):
            raise ValueError(
                f"job {job.job_id}: expected one chunk id per key, got {len(job.chunk_ids)} "
                f"for {len(keys)} keys"
            )
        fingerprint = self.file_mapper.fingerprint
        args = [
            [self.file_mapper.get_file_name(key) for key in keys],
            self._primary_kv_view,
            [int(cid) * self.block_size_bytes for cid in job.chunk_ids],
            self.block_size_bytes,
            [BlockFileHeader(fingerprint, key) for key in keys],
            self._use_o_direct,
        ]
        return keys, args

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, args = self._batch(job_metadata)
        job_id = job_metadata.job_id
        self._job_started(job_id, keys, is_store=True)
        self._job_blocks[job_id] = len(keys)
        self._pool.enqueue_store(job_id, 1, [functools.partial(batch_store_block, *args)])

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys, args = self._batch(job_metadata)
        job_id = job_metadata.job_id
        self._job_started(job_id, keys, is_store=False)
        self._job_blocks[job_id] = len(keys)

        def load() -> None:
            try:
                batch_load_block(*args)
            except (OSError, BadBlockFile) as exc:
                self._load_progress[job_id] = getattr(exc, "num_succeeded", 0)
                raise

        self._pool.enqueue_load(job_id, 1, [load])

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs finished since the previous call; a failed load turns the verdicts on the
        keys it did not load into misses, so the scheduler does not promote them again."""
        results = []
        for job in self._pool.get_finished():
            blocks = self._job_blocks.pop(job.job_id, 0)
            result = JobResult(
                job_id=job.job_id,
                success=job.success,
                transfer_time=job.transfer_time,
                transfer_bytes=blocks * self.block_size_bytes if blocks else None,
            )
            loaded = self._load_progress.pop(job.job_id, None)
            if loaded:  # a failed load keeps the blocks loaded before the failing one
                result.successful_keys = tuple(self._load_job_keys[job.job_id][:loaded])
            self._job_finished(job.job_id, job.success, result.successful_keys or ())
            results.append(result)
        return results

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (results in :meth:`get_finished_jobs`)."""
        self._pool.wait_idle()

    def shutdown(self) -> None:
        """Stop the lookup thread, drop queued block copies (reported failed) and stop the I/O
        threads (running copies finish)."""
        self._lookup_manager.shutdown()
        self._pool.shutdown(wait=True)
