"""The file-system secondary tier (upstream v0.22's ``tiering.fs.manager``).

Each offloaded block is one file named by :class:`~vllm.v1.kv_offload.file_mapper.FileMapper`
under ``root_dir``, holding a header (the folder's settings fingerprint, the key, a CRC-32; see
:mod:`.block_file`) and the block's primary row (every worker's pages of the block) byte for
byte. A block is present when a file of the right size is at its path; a load verifies the
header and the CRC, and a file that fails is removed. Files are never evicted by the tier.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

from vllm.v1.kv_offload.base import Medium, OffloadKey, ReqContext
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import JobMetadata, JobResult, SecondaryTierManager
from vllm.v1.kv_offload.tiering.fs.block_file import BlockFileHeader
from vllm.v1.kv_offload.tiering.fs.io import block_file_present, load_block, store_block
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool, Task

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec


class FileSystemTierManager(SecondaryTierManager):
    """Blocks as files under ``root_dir``, copied by ``n_read_threads`` load-first and
    ``n_write_threads`` store-first threads. The folder's ``config.json`` records the settings
    its name is derived from; a ``root_dir`` that cannot hold it fails here (``OSError``)."""

    medium: ClassVar[Medium | None] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        n_read_threads: int = 16,
        n_write_threads: int = 16,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        strides = primary_kv_view.strides
        if not strides:
            raise ValueError("primary_kv_view: expected a [num_blocks, row] view with strides")
        self._block_size: int = strides[0]
        self.file_mapper = FileMapper.from_offloading_spec(
            root_dir=root_dir,
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
        )
        self._write_config()
        self._pool = DualQueueThreadPool(
            n_read_threads, n_write_threads, thread_name_prefix="vllm_kv_fs"
        )

    def _write_config(self) -> None:
        path = self.file_mapper.get_config_file_path()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.file_mapper.get_run_config(), f, indent=2, sort_keys=True)
        os.replace(tmp, path)

    def _tasks(
        self,
        job: JobMetadata,
        io: Callable[[str, memoryview, int, int, BlockFileHeader], None],
    ) -> Iterator[Task]:
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            yield functools.partial(
                io,
                self.file_mapper.get_file_name(key),
                self._primary_kv_view,
                int(block_id) * self._block_size,
                self._block_size,
                BlockFileHeader(self.file_mapper.fingerprint, key),
            )

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> bool | None:
        return block_file_present(self.file_mapper.get_file_name(key), self._block_size)

    def submit_store(self, job_metadata: JobMetadata) -> None:
        n = len(job_metadata.keys)
        self._pool.enqueue_store(job_metadata.job_id, n, self._tasks(job_metadata, store_block))

    def submit_load(self, job_metadata: JobMetadata) -> None:
        n = len(job_metadata.keys)
        self._pool.enqueue_load(job_metadata.job_id, n, self._tasks(job_metadata, load_block))

    def get_finished(self) -> Iterable[JobResult]:
        return [JobResult(job_id, success) for job_id, success in self._pool.get_finished()]

    def shutdown(self) -> None:
        """Drop queued block copies and stop the threads (running copies finish)."""
        self._pool.shutdown(wait=True)
