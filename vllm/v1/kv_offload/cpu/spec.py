"""Offloading to CPU memory: :class:`CPUOffloadingSpec`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from vllm.utils import check_positive_int
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingHandler,
    OffloadingManager,
    OffloadingSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import CpuGpuOffloadingHandlers, SwapBlocksFn
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.worker.page_views import kv_cache_tensor_page_sizes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class CPUOffloadingSpec(OffloadingSpec):
    """Offload KV-cache pages to CPU memory (pinned on CUDA machines).

    ``extra_config``: ``"cpu_bytes_to_use"``, the CPU budget in bytes of the whole engine
    (every worker), or, ours, ``"num_cpu_blocks"``; ``"eviction_policy"`` (``"lru"``, default,
    or ``"arc"``); ``"store_threshold"`` (lookups before a block is stored, default 0: off) and
    ``"max_tracker_size"`` (default 64000). ``num_blocks = cpu_bytes_to_use //
    (world_size x block_size_factor x sum of page_size_bytes over the KV-cache tensors)``; page
    sizes are per tensor (shared tensors count once), never one size for all layers.
    ``cpu_page_size_per_worker``: bytes of one offloaded block on one worker.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        swap_blocks: SwapBlocksFn | None = None,
    ):
        super().__init__(vllm_config, kv_cache_config)
        self.swap_blocks = swap_blocks
        self.cpu_page_size_per_worker: int = self.block_size_factor * sum(
            kv_cache_tensor_page_sizes(kv_cache_config)
        )
        workers = vllm_config.parallel_config.world_size
        num_blocks = self.extra_config.get("num_cpu_blocks")
        cpu_bytes = self.extra_config.get("cpu_bytes_to_use")
        if (num_blocks is None) == (cpu_bytes is None):
            raise ValueError(
                "extra_config: set exactly one of 'cpu_bytes_to_use' (bytes) and "
                f"'num_cpu_blocks', got {num_blocks=!r}, {cpu_bytes=!r}"
            )
        if cpu_bytes is not None:
            num_blocks = int(cpu_bytes) // (workers * self.cpu_page_size_per_worker)
            if num_blocks <= 0:
                raise ValueError(
                    f"extra_config['cpu_bytes_to_use']: {cpu_bytes} bytes hold no offloaded "
                    f"block of {self.cpu_page_size_per_worker} bytes on each of {workers} "
                    "workers"
                )
        self.num_blocks: int = check_positive_int("extra_config['num_cpu_blocks']", num_blocks)
        self.eviction_policy: str = str(self.extra_config.get("eviction_policy", "lru"))
        self._manager: CPUOffloadingManager | None = None
        self._handlers: CpuGpuOffloadingHandlers | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            events = self.vllm_config.kv_events_config
            self._manager = CPUOffloadingManager(
                num_blocks=self.num_blocks,
                cache_policy=self.eviction_policy,  # type: ignore[arg-type]
                enable_events=events is not None and events.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
            )
        return self._manager

    @property
    def handlers(self) -> CpuGpuOffloadingHandlers | None:
        """The handlers built by :meth:`get_handlers` (None before)."""
        return self._handlers

    def create_handlers(self, kv_caches: CanonicalKVCaches) -> CpuGpuOffloadingHandlers:
        """New CPU <-> GPU handlers (and CPU buffers) for ``kv_caches``."""
        return CpuGpuOffloadingHandlers(
            kv_caches,
            block_size_factor=self.block_size_factor,
            num_cpu_blocks=self.num_blocks,
            swap_blocks=self.swap_blocks,
        )

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        if self._handlers is None:
            self._handlers = self.create_handlers(kv_caches)
        yield GPULoadStoreSpec, CPULoadStoreSpec, self._handlers.gpu_to_cpu_handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self._handlers.cpu_to_gpu_handler
