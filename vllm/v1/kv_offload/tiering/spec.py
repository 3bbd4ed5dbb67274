"""Multi-tier offloading: :class:`TieringOffloadingSpec` (upstream v0.22's
``kv_offload.tiering.spec``).

The CPU tier is primary: offloaded blocks live in one :class:`SharedOffloadRegion` of the
engine (``/dev/shm``), which the scheduler maps whole and each worker joins with its cells;
GPU <-> CPU moves are the CPU spec's handlers on the worker's cells. Secondary tiers (file
system, example, ...) copy blocks between the region's rows and their own storage, never
touching GPU memory.

``extra_config``: the :class:`CPUOffloadingSpec` keys (``cpu_bytes_to_use`` or
``num_cpu_blocks``, ``eviction_policy``; ``store_threshold`` must stay below
2), and ``secondary_tiers``: a list of tier configs, each a dict with ``"type"`` (a
:class:`SecondaryTierFactory` name) and the tier's own parameters.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.gpu_worker import (
    CpuGpuOffloadingHandlers,
    CPUOffloadingWorker,
    SwapBlocksFn,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


class TieringOffloadingSpec(CPUOffloadingSpec):
    """A :class:`TieringOffloadingManager` over a CPU primary tier in the engine's shared
    offload region (named by the config's ``engine_id``) and the configured secondary tiers.

    :meth:`get_manager` (scheduler side) maps the whole region (``rank=None``); workers join
    it with their cells (:meth:`create_worker`; v0.22: :meth:`create_handlers`), at cell 0 for
    all with a replicated layout. The region is always used, so a replicated layout keeps one
    copy of each chunk whatever the platform.
    """

    def __init__(
        self,
        config: OffloadingConfig | VllmConfig,
        kv_cache_config: KVCacheConfig | None = None,
        swap_blocks: SwapBlocksFn | None = None,
    ):
        super().__init__(config, kv_cache_config, swap_blocks)
        tiers = self.extra_config.get("secondary_tiers", [])
        if not isinstance(tiers, list):
            raise ValueError(
                "extra_config['secondary_tiers']: expected a list of tier configurations, got "
                f"{type(tiers).__name__}"
            )
        if int(self.extra_config.get("store_threshold", 0)) >= 2:
            raise ValueError("extra_config['store_threshold']: not supported with tiering")
        self.secondary_tier_configs: list[dict[str, Any]] = tiers
        self._tiering_manager: TieringOffloadingManager | None = None

    def _uses_shared_region(self) -> bool:
        return True

    def _worker_cell(self) -> int:
        return 0 if self.replicated_layout else self.config.parallel.rank

    def _region(self, rank: int | None) -> SharedOffloadRegion:
        return SharedOffloadRegion(
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )

    def get_manager(self) -> OffloadingManager:
        if self._tiering_manager is None:
            enable_events = self.kv_events_config.enable_kv_cache_events
            primary = CPUPrimaryTierOffloadingManager(
                num_chunks=self.num_chunks,
                mmap_region=self._region(None),
                cache_policy=self.eviction_policy,
                enable_events=enable_events,
                info=self.cpu_info,
            )
            rows = primary.get_kv_memoryview()
            tiers: list[SecondaryTierManager] = []
            try:
                for config in self.secondary_tier_configs:
                    tiers.append(SecondaryTierFactory.create_secondary_tier(config, rows, self))
                    logger.info("Created secondary tier %s", tiers[-1].tier_type)
            except Exception:
                for tier in tiers:
                    tier.shutdown()
                primary.shutdown()
                raise
            self._tiering_manager = TieringOffloadingManager(primary, tiers, enable_events)
        return self._tiering_manager

    def create_worker(self, kv_caches: CanonicalKVCaches) -> CPUOffloadingWorker:
        """A worker whose CPU side is its cells of the shared region (the worker owns the
        mapping and cleans it up on shutdown)."""
        region = SharedOffloadRegion(
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            rank=self._worker_cell(),
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
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
            region.cleanup()
            raise

    def create_handlers(self, kv_caches: CanonicalKVCaches) -> CpuGpuOffloadingHandlers:
        """v0.22: handlers whose CPU side is this worker's cells of the shared region (the
        store handler's shutdown cleans the worker's mapping up)."""
        return CpuGpuOffloadingHandlers(
            kv_caches,
            self.blocks_per_chunk,
            self.num_chunks,
            self._region(self._worker_cell()),
            swap_blocks=self.swap_blocks,
        )
