"""The example secondary tier (upstream v0.22's ``tiering.example.manager``).

Keeps each stored block's primary row as ``bytes`` in a dict and finishes every job within
the ``submit_*`` call (reported by the next :meth:`get_finished`). ``blocks`` says which keys
are held; a key marked held without bytes (as a test may do) is loaded as a no-op.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

from vllm.v1.kv_offload.base import Medium, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobMetadata, JobResult, SecondaryTierManager

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = logging.getLogger(__name__)


class ExampleSecondaryTierManager(SecondaryTierManager):
    """Blocks in process memory; ``custom_param`` shows how a tier config passes options."""

    medium: ClassVar[Medium | None] = Medium.CPU

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        custom_param: int = 0,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self.custom_param = custom_param
        logger.info("example tier: custom_param=%d", custom_param)
        self.blocks: dict[OffloadKey, bool] = {}
        self.data: dict[OffloadKey, bytes] = {}
        self.completed_jobs: list[JobResult] = []
        self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view
        self._row_bytes: int = (primary_kv_view.strides or (1,))[0]

    def _row(self, row: int) -> memoryview:
        return self._flat[row * self._row_bytes : (row + 1) * self._row_bytes]

    def _rows(self, job: JobMetadata) -> list[tuple[OffloadKey, int]]:
        if len(job.keys) != len(job.block_ids):
            raise ValueError(
                f"job {job.job_id}: {len(job.keys)} keys but {len(job.block_ids)} block_ids"
            )
        return list(zip(job.keys, (int(b) for b in job.block_ids), strict=True))

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        return self.blocks.get(key, False)

    def submit_store(self, job_metadata: JobMetadata) -> None:
        for key, row in self._rows(job_metadata):
            if not self.blocks.get(key, False):
                self.data[key] = self._row(row).tobytes()
                self.blocks[key] = True
        self.completed_jobs.append(JobResult(job_metadata.job_id, True))

    def submit_load(self, job_metadata: JobMetadata) -> None:
        rows = self._rows(job_metadata)
        ok = all(self.blocks.get(key, False) for key, _ in rows)
        if ok:
            for key, row in rows:
                data = self.data.get(key)
                if data is not None:
                    self._row(row)[:] = data
        self.completed_jobs.append(JobResult(job_metadata.job_id, ok))

    def get_finished(self) -> list[JobResult]:
        finished, self.completed_jobs = self.completed_jobs, []
        return finished

    def shutdown(self) -> None:
        self._flat.release()

    def get_num_blocks(self) -> int:
        """How many blocks the tier holds."""
        return len(self.blocks)
