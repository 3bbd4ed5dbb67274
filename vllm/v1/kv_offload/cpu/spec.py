"""Offloading to CPU memory: :class:`CPUOffloadingSpec`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm.platforms import current_platform
from vllm.utils import check_positive_int
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHandler,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import (
    CPULoadStoreSpec,
    CPUOffloadingInfo,
    CPUOffloadingMetrics,
)
from vllm.v1.kv_offload.cpu.gpu_worker import (
    CpuGpuOffloadingHandlers,
    CPUOffloadingWorker,
    SwapBlocksFn,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

_ALLOCATION_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
"""Histogram bounds of chunks per ``prepare_store`` (powers of 4)."""


def _platform_uses_shared_region() -> bool:
    """Whether workers keep their CPU chunks in the engine's shared region (CUDA, XPU) rather
    than private tensors (ROCm, CPU-only)."""
    platform = current_platform
    return (platform.is_cuda_alike() and not platform.is_rocm()) or platform.is_xpu()


class CPUOffloadingSpec(OffloadingSpec):
    """Offload KV-cache chunks to CPU memory.

    ``extra_config``: ``"cpu_bytes_to_use"``, the CPU budget in bytes of the whole engine
    (every worker), or, ours, ``"num_cpu_blocks"`` (chunks); ``"eviction_policy"`` (a
    :class:`~vllm.v1.kv_offload.cpu.policies.factory.CachePolicyFactory` name, default
    ``"lru"``) and ``"cache_policy_module_path"`` for an out-of-tree one; ``"store_threshold"``
    (offers before a chunk is stored, default 0: off) and ``"max_tracker_size"`` (64000).

    Sizing, in bytes: a chunk holds ``blocks_per_chunk`` blocks of every worker
    (``cpu_page_size_per_worker`` each; one copy for all with a replicated layout, which needs
    the shared region); ``kv_bytes_per_chunk`` rounds that up to
    :attr:`BLOCK_SIZE_ALIGNMENT`, and ``num_chunks = cpu_bytes_to_use // kv_bytes_per_chunk``.
    A worker with no KV cache gets 0 chunks.
    """

    BLOCK_SIZE_ALIGNMENT = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        definitions: dict[str, OffloadingMetricMetadata] = {
            CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC: OffloadingGaugeMetadata(
                "Fraction of CPU KV-cache chunks pinned by transfers in flight (stores or "
                "loads; 0 idle, 1 full: new stores may be dropped)."
            ),
            CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC: OffloadingGaugeMetadata(
                "Fraction of CPU KV-cache chunks pinned by stores in flight."
            ),
            CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC: OffloadingGaugeMetadata(
                "Fraction of CPU KV-cache chunks pinned by loads in flight."
            ),
            CPUOffloadingMetrics.CPU_ALLOCATION_SIZE: OffloadingHistogramMetadata(
                "CPU chunks requested by each KV offload store.", buckets=_ALLOCATION_BUCKETS
            ),
        }
        if int(extra_config.get("store_threshold", 0)) >= 2:
            definitions[CPUOffloadingMetrics.STORES_SKIPPED] = OffloadingCounterMetadata(
                "KV offload stores skipped below the reuse threshold."
            )
        return definitions

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return CPUOffloadingInfo.config_info_keys()

    def __init__(
        self,
        config: OffloadingConfig | VllmConfig,
        kv_cache_config: KVCacheConfig | None = None,
        swap_blocks: SwapBlocksFn | None = None,
    ):
        super().__init__(config, kv_cache_config)
        self.swap_blocks = swap_blocks
        cpu_bytes = self.extra_config.get("cpu_bytes_to_use")
        num_chunks = self.extra_config.get("num_cpu_blocks")
        if not cpu_bytes and num_chunks is None:
            raise ValueError(
                "extra_config: cpu_bytes_to_use must be specified in kv_connector_extra_config "
                f"(bytes of the whole engine; or, ours, num_cpu_blocks), got {cpu_bytes!r}"
            )
        if cpu_bytes and num_chunks is not None:
            raise ValueError(
                "extra_config: expected one of 'cpu_bytes_to_use' and 'num_cpu_blocks', got "
                f"both ({cpu_bytes!r}, {num_chunks!r})"
            )
        config = self.config
        self.replicated_layout = config.replicated_layout and self._uses_shared_region()
        copies = 1 if self.replicated_layout else config.parallel.world_size
        self.cpu_page_size_per_worker: int = (
            config.worker_kv_bytes_per_block * self.blocks_per_chunk
        )
        chunk_bytes = self.cpu_page_size_per_worker * copies
        align = self.BLOCK_SIZE_ALIGNMENT
        self.kv_bytes_per_chunk: int = -(-chunk_bytes // align) * align
        if num_chunks is not None:
            self.num_chunks: int = check_positive_int(
                "extra_config['num_cpu_blocks']", int(num_chunks)
            )
        else:
            self.num_chunks = int(cpu_bytes) // self.kv_bytes_per_chunk if chunk_bytes else 0
        self.cpu_info = CPUOffloadingInfo.from_config(
            config, self.num_chunks, self.kv_bytes_per_chunk
        )
        self.eviction_policy: str = str(self.extra_config.get("eviction_policy", "lru"))
        self.cache_policy_module_path: str | None = self.extra_config.get(
            "cache_policy_module_path"
        )
        self._manager: CPUOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None
        self._handlers: CpuGpuOffloadingHandlers | None = None

    @property
    def num_blocks(self) -> int:
        """v0.22's name of :attr:`num_chunks`."""
        return self.num_chunks

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = CPUOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
                info=self.cpu_info,
            )
        return self._manager

    def _uses_shared_region(self) -> bool:
        """Whether workers' CPU chunks live in the engine's shared region (only then can one
        copy serve every worker of a replicated layout)."""
        return _platform_uses_shared_region()

    def create_worker(self, kv_caches: CanonicalKVCaches) -> CPUOffloadingWorker:
        """A new worker over ``kv_caches``: its CPU side is this worker's cells of the shared
        region where the platform maps one (and there are chunks), else private tensors."""
        region: SharedOffloadRegion | None = None
        if self._uses_shared_region() and self.num_chunks > 0:
            parallel = self.config.parallel
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
                populate_shard=(
                    (parallel.rank, parallel.world_size) if self.replicated_layout else None
                ),
            )
        try:
            return CPUOffloadingWorker(
                kv_caches=kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                num_cpu_chunks=self.num_chunks,
                mmap_region=region,
                swap_blocks=self.swap_blocks,
            )
        except BaseException:
            if region is not None:
                region.cleanup()
            raise

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    @property
    def handlers(self) -> CpuGpuOffloadingHandlers | None:
        """v0.22: the handlers built by :meth:`get_handlers` (None before)."""
        return self._handlers

    def create_handlers(self, kv_caches: CanonicalKVCaches) -> CpuGpuOffloadingHandlers:
        """v0.22: new CPU <-> GPU handlers (and private CPU buffers) for ``kv_caches``."""
        return CpuGpuOffloadingHandlers(
            kv_caches,
            block_size_factor=self.blocks_per_chunk,
            num_cpu_blocks=self.num_chunks,
            swap_blocks=self.swap_blocks,
        )

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        if self._handlers is None:
            self._handlers = self.create_handlers(kv_caches)
        yield GPULoadStoreSpec, CPULoadStoreSpec, self._handlers.gpu_to_cpu_handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self._handlers.cpu_to_gpu_handler
