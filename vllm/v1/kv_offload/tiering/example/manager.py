"""The example secondary tier (upstream v0.33's ``tiering.example.manager``): a reference for
writing tiers, and a tier for tests.

Keeps each stored chunk's primary row as ``bytes`` in a dict and finishes every job within
the ``submit_*`` call (reported by the next :meth:`get_finished_jobs`). ``chunks`` says which
keys are held; a key marked held without bytes (as a test may do) is loaded as a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    ConfigInfo,
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExampleTierInfo(ConfigInfo):
    """The example tier's config-info labels (the tier label tells tiers apart, so a tier
    needs no name label of its own)."""

    example_info: int


class ExampleSecondaryTierManager(SecondaryTierManager):
    """Chunks in process memory; ``custom_param`` shows how a tier config passes options
    (published as the ``example_info`` config-info label)."""

    medium: ClassVar[Medium | None] = Medium.CPU

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        custom_param: int = 0,
        backpressure_detector: BackpressureDetector | None = None,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if isinstance(custom_param, bool) or not isinstance(custom_param, int):
            raise TypeError(f"custom_param: expected an int, got {custom_param!r}")
        self._config_info = ExampleTierInfo(example_info=custom_param)
        logger.info("example tier: custom_param=%d", custom_param)
        self.chunks: dict[OffloadKey, bool] = {}
        self.data: dict[OffloadKey, bytes] = {}
        self.completed_jobs: list[JobResult] = []
        self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ExampleTierInfo.config_info_keys()

    def config_info(self) -> ConfigInfoMapping:
        return self._config_info.as_config_info()

    def _row(self, chunk_id: int) -> memoryview:
        size = self.block_size_bytes
        return self._flat[chunk_id * size : (chunk_id + 1) * size]

    def _rows(self, job: TransferJob) -> list[tuple[OffloadKey, int]]:
        if len(job.keys) != len(job.chunk_ids):
            raise ValueError(
                f"job {job.job_id}: expected one chunk id per key, got {len(job.keys)} keys and "
                f"{len(job.chunk_ids)} chunk ids"
            )
        return list(zip(job.keys, (int(c) for c in job.chunk_ids), strict=True))

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.chunks.get(key, False) else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        for key, chunk_id in self._rows(job_metadata):
            if not self.chunks.get(key, False):
                self.data[key] = self._row(chunk_id).tobytes()
                self.chunks[key] = True
        self.completed_jobs.append(JobResult(job_metadata.job_id, True, transfer_time=0.0))

    def submit_load(self, job_metadata: TransferJob) -> None:
        rows = self._rows(job_metadata)
        if not all(self.chunks.get(key, False) for key, _ in rows):
            self.completed_jobs.append(JobResult(job_metadata.job_id, False))
            return
        for key, chunk_id in rows:
            data = self.data.get(key)
            if data is not None:
                self._row(chunk_id)[:] = data
        self.completed_jobs.append(JobResult(job_metadata.job_id, True, transfer_time=0.0))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished, self.completed_jobs = self.completed_jobs, []
        return finished

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Nothing to wait for: jobs finish within ``submit_*``."""
        return

    def shutdown(self) -> None:
        self._flat.release()

    def get_num_chunks(self) -> int:
        """How many chunks the tier holds."""
        return len(self.chunks)


__all__ = ["ExampleSecondaryTierManager", "ExampleTierInfo"]
