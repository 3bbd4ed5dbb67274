"""Worker side of the offloading connector: registers the KV cache and runs transfer jobs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.worker.page_views import LayerKVCache, canonicalize_kv_caches
from vllm.v1.kv_offload.worker.worker import (
    OffloadingHandler,
    OffloadingWorker,
    TransferResult,
    TransferSpec,
)


class OffloadingConnectorWorker:
    """Offloads a worker's KV cache through the handlers of an :class:`OffloadingSpec`.

    Job ids are assigned here, increasing in submission order. Ordering (the spec's handler
    pair, see :mod:`vllm.v1.kv_offload.cpu.page_copy`): each direction reports its jobs in
    submission order; a load (CPU -> GPU) starts only after every earlier store (GPU -> CPU) not yet
    reported has completed, so it reads what those stores wrote; a store copies the pages the
    compute work queued before its submission produced.
    """

    def __init__(self, spec: OffloadingSpec):
        self.spec = spec
        self.worker = OffloadingWorker()
        self.handlers: list[OffloadingHandler] = []
        self._next_job_id = 0
        self._not_submitted: list[TransferResult] = []

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
        canonical = canonicalize_kv_caches(kv_caches, config)
        for src_cls, dst_cls, handler in self.spec.get_handlers(canonical):
            self.worker.register_handler(src_cls, dst_cls, handler)
            self.handlers.append(handler)

    def transfer_async(self, spec: TransferSpec) -> int:
        """Submit a transfer; returns its job id. A job that could not be submitted (its
        handler refused or raised, which is logged) is reported failed by :meth:`get_finished`."""
        job_id = self._next_job_id
        self._next_job_id += 1
        if not self.worker.transfer_async(job_id, spec):
            self._not_submitted.append(TransferResult(job_id, False))
        return job_id

    def _every_group(
        self, gpu_block_ids: Iterable[int], offload_block_ids: Iterable[int], block_index: int
    ) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
        # The same ids in every group: each tensor's pages move, whichever group uses it.
        gpu, offload = list(gpu_block_ids), list(offload_block_ids)
        n = len(self.spec.kv_cache_config.kv_cache_groups) or 1
        return (
            GPULoadStoreSpec(gpu * n, [len(gpu)] * n, [block_index] * n),
            CPULoadStoreSpec(offload * n),
        )

    def store(
        self, gpu_block_ids: Iterable[int], offload_block_ids: Iterable[int], block_index: int = 0
    ) -> int:
        """Copy GPU blocks (request blocks from ``block_index`` on) of every KV-cache group
        to offloaded (CPU) blocks; returns the job id."""
        gpu, cpu = self._every_group(gpu_block_ids, offload_block_ids, block_index)
        return self.transfer_async((gpu, cpu))

    def load(
        self, offload_block_ids: Iterable[int], gpu_block_ids: Iterable[int], block_index: int = 0
    ) -> int:
        """Copy offloaded (CPU) blocks into GPU blocks of every KV-cache group (request blocks
        from ``block_index`` on, so the first offloaded block is read from page
        ``block_index % block_size_factor``); returns the job id."""
        gpu, cpu = self._every_group(gpu_block_ids, offload_block_ids, block_index)
        return self.transfer_async((cpu, gpu))

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call."""
        failed, self._not_submitted = self._not_submitted, []
        return failed + self.worker.get_finished()

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs have finished."""
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        """Wait for jobs in flight and release the handlers."""
        self.worker.shutdown()
