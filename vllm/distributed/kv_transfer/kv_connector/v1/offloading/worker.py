"""Worker side of the offloading connector: registers the KV cache and runs transfer jobs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from vllm.v1.kv_offload.spec import OffloadingSpec
from vllm.v1.kv_offload.worker.page_views import LayerKVCache
from vllm.v1.kv_offload.worker.worker import (
    OffloadingHandler,
    OffloadingWorker,
    TransferResult,
    TransferSpec,
)


class OffloadingConnectorWorker:
    """Offloads a worker's KV cache through the handlers of an :class:`OffloadingSpec`.

    Job ids are assigned here, increasing in submission order. Ordering (see
    :mod:`vllm.v1.kv_offload.worker.cpu_gpu`): :meth:`get_finished` reports jobs in submission
    order across both directions (a later job is never reported before an earlier one); a load
    (CPU -> GPU) starts only after every earlier store (GPU -> CPU) not yet reported has
    completed, so it reads what those stores wrote; a store copies the pages the compute work
    queued before its submission produced. :meth:`wait` waits for the given jobs and every
    earlier one.
    """

    def __init__(self, spec: OffloadingSpec):
        self.spec = spec
        self.worker = OffloadingWorker()
        self.handlers: list[OffloadingHandler] = []
        self._next_job_id = 0

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, LayerKVCache],
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        """Register the worker's KV cache for offloading.

        ``kv_caches`` maps layer names to what the worker holds for each layer (the per-layer
        views of ``_reshape_kv_cache``, raw byte buffers, or a Mamba layer's state views);
        ``kv_cache_config`` (default: the spec's) gives the buffers and page sizes. The number
        of GPU blocks is ``kv_cache_config.num_blocks``, never read from a tensor's shape.
        Layers sharing a ``KVCacheTensor`` are registered once; the spec's handlers allocate
        the matching offload-side buffers.
        """
        if self.handlers:
            raise RuntimeError("register_kv_caches: the KV cache is already registered")
        config = kv_cache_config or self.spec.kv_cache_config
        for src_cls, dst_cls, handler in self.spec.get_handlers(kv_caches, config):
            self.worker.register_handler(src_cls, dst_cls, handler)
            self.handlers.append(handler)

    def transfer_async(self, spec: TransferSpec) -> int:
        """Submit a transfer; returns its job id."""
        job_id = self._next_job_id
        self.worker.transfer_async(job_id, spec)
        self._next_job_id += 1
        return job_id

    def store(self, gpu_block_ids: Iterable[int], offload_block_ids: Iterable[int]) -> int:
        """Copy GPU blocks to offloaded (CPU) blocks; returns the job id."""
        return self.transfer_async(
            (GPULoadStoreSpec(gpu_block_ids), CPULoadStoreSpec(offload_block_ids))
        )

    def load(self, offload_block_ids: Iterable[int], gpu_block_ids: Iterable[int]) -> int:
        """Copy offloaded (CPU) blocks into GPU blocks; returns the job id."""
        return self.transfer_async(
            (CPULoadStoreSpec(offload_block_ids), GPULoadStoreSpec(gpu_block_ids))
        )

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call."""
        return self.worker.get_finished()

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs (and every job submitted before them) have finished."""
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        """Wait for jobs in flight and release the handlers."""
        self.worker.shutdown()
