"""Multi-tier offloading: :class:`TieringOffloadingSpec` (upstream v0.33's
``kv_offload.tiering.spec``).

The CPU tier is primary: offloaded blocks live in one :class:`SharedOffloadRegion` of the
engine (``/dev/shm``), which the scheduler maps whole and each worker joins with its cells;
GPU <-> CPU moves are the CPU spec's handlers on the worker's cells. Secondary tiers (file
system, example, ...) copy blocks between the region's rows and their own storage, never
touching GPU memory.

``extra_config``: the :class:`CPUOffloadingSpec` keys (``cpu_bytes_to_use`` or
``num_cpu_blocks``, ``eviction_policy``; ``store_threshold`` must stay below
2), ``secondary_tiers``: a list of tier configs, each a dict with ``"type"`` (a
:class:`SecondaryTierFactory` name) and the tier's own parameters, ``tier_poll_interval_s``
(seconds between tier-poll rounds; 0 disables the thread) and ``backpressure``: detector
settings every tier with a ``"backpressure"`` entry inherits field by field (the tier's own
fields win; a tier without the entry gets none unless this is set).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.gpu_worker import (
    CpuGpuOffloadingHandlers,
    CPUOffloadingWorker,
    SwapBlocksFn,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.base import TIER_LABEL, SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    DEFAULT_TIER_POLL_INTERVAL_S,
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)
from vllm.v1.kv_offload.tiering.metrics import tiering_metric_definitions

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


class ReservedLabelError(ValueError, AssertionError):
    """A tier declares the config-info label the manager writes itself (an
    ``AssertionError`` too, as upstream raises)."""


def _tier_configs(extra_config: dict[str, Any]) -> list[dict[str, Any]]:
    tiers = extra_config.get("secondary_tiers", [])
    if not isinstance(tiers, list):
        raise ValueError(
            "extra_config['secondary_tiers']: expected a list of tier configurations, got "
            f"{type(tiers).__name__}"
        )
    for i, tier in enumerate(tiers):
        if not isinstance(tier, dict):
            raise ValueError(
                f"extra_config['secondary_tiers'][{i}]: expected a dict, got {type(tier).__name__}"
            )
    return tiers


def _with_backpressure_defaults(
    tier: dict[str, Any], defaults: dict[str, Any] | None
) -> dict[str, Any]:
    """``tier`` with the instance-wide back-pressure settings under its own (a copy)."""
    own = tier.get("backpressure")
    if own is not None and not isinstance(own, dict):
        raise ValueError(f"secondary tier backpressure: expected a dict, got {own!r}")
    if not defaults and own is None:
        return dict(tier)
    return {**tier, "backpressure": {**(defaults or {}), **(own or {})}}


class TieringOffloadingSpec(CPUOffloadingSpec):
    """A :class:`TieringOffloadingManager` over a CPU primary tier in the engine's shared
    offload region (named by the config's ``engine_id``) and the configured secondary tiers.

    :meth:`get_manager` (scheduler side) maps the whole region (``rank=None``); workers join
    it with their cells (:meth:`create_worker`; v0.22: :meth:`create_handlers`), at cell 0 for
    all with a replicated layout. The region is always used, so a replicated layout keeps one
    copy of each chunk whatever the platform.
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The CPU tier's metrics, the tiering manager's, and each tier's."""
        metrics = super().build_metric_definitions(extra_config)
        metrics.update(tiering_metric_definitions())
        for tier_config, tier_cls in cls._get_secondary_tiers(extra_config):
            metrics.update(tier_cls.build_metric_definitions(tier_config))
        return metrics

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The CPU tier's label names, :data:`TIER_LABEL`, then each tier's (each name once;
        a tier declaring :data:`TIER_LABEL` is a :class:`ReservedLabelError`)."""
        keys = dict.fromkeys(super().config_info_keys(extra_config))
        keys[TIER_LABEL] = None
        for tier_config, tier_cls in cls._get_secondary_tiers(extra_config):
            tier_keys = tier_cls.config_info_keys(tier_config)
            if TIER_LABEL in tier_keys:
                raise ReservedLabelError(
                    f"{tier_cls.__name__}.config_info_keys: expected names other than the "
                    f"reserved label {TIER_LABEL!r}, got {tier_keys}"
                )
            keys.update(dict.fromkeys(tier_keys))
        return tuple(keys)

    @classmethod
    def _get_secondary_tiers(
        cls, extra_config: dict[str, Any]
    ) -> list[tuple[dict[str, Any], type[SecondaryTierManager]]]:
        """(tier config, tier class) per configured tier, in order (the order sets the
        tier index)."""
        return [
            (tier, SecondaryTierFactory.get_tier_class(tier))
            for tier in _tier_configs(extra_config)
        ]

    def __init__(
        self,
        config: OffloadingConfig | VllmConfig,
        kv_cache_config: KVCacheConfig | None = None,
        swap_blocks: SwapBlocksFn | None = None,
    ):
        super().__init__(config, kv_cache_config, swap_blocks)
        tiers = _tier_configs(self.extra_config)
        if int(self.extra_config.get("store_threshold", 0)) >= 2:
            raise ValueError("extra_config['store_threshold']: not supported with tiering")
        defaults = self.extra_config.get("backpressure")
        if defaults is not None and not isinstance(defaults, dict):
            raise ValueError(f"extra_config['backpressure']: expected a dict, got {defaults!r}")
        self.secondary_tier_configs: list[dict[str, Any]] = [
            _with_backpressure_defaults(tier, defaults) for tier in tiers
        ]
        interval = self.extra_config.get("tier_poll_interval_s", DEFAULT_TIER_POLL_INTERVAL_S)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise ValueError(
                f"extra_config['tier_poll_interval_s']: expected seconds, got {interval!r}"
            )
        self.tier_poll_interval_s = float(interval)
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
                cache_policy_module_path=self.cache_policy_module_path,
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
            self._tiering_manager = TieringOffloadingManager(
                primary, tiers, tier_poll_interval_s=self.tier_poll_interval_s
            )
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
