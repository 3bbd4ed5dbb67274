"""HiSparse connector statistics and their Prometheus metrics (upstream's
``...kv_connector.v1.hisparse.stats``).

Counters (hot-buffer hits and misses, host-to-device bytes, host block lifetimes in
seconds) are per-interval deltas that add up; the host gauges (host pool usage as a
fraction of 1, page transfers in flight) are levels, so aggregating keeps the latest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.buckets import histogram_buckets
from vllm.v1.metrics.stats import KVCacheEvictionEvent
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["HiSparseKVConnectorStats", "HiSparsePromMetrics"]

_LEVEL_KEYS = frozenset({"host_cache_usage_perc", "pending_page_transfers"})
_KEYS = (
    "cache_hits",
    "cache_misses",
    "host_to_device_bytes",
    "host_cache_usage_perc",
    "pending_page_transfers",
    "host_block_lifetime_seconds",
    "host_block_idle_before_evict_seconds",
    "host_block_reuse_gap_seconds",
)


@dataclass
class HiSparseKVConnectorStats(KVConnectorStats):
    """Serializable HiSparse stats: ``data`` maps each metric to its observations."""

    data: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def to_dict(self) -> dict[str, list[Any]]:
        """The serializable payload (``HiSparseConnector.build_kv_connector_stats`` reads
        it back)."""
        return self.data

    def reset(self) -> None:
        self.data = {key: [] for key in _KEYS}

    def record_snapshot(self, hits: int, misses: int, host_to_device_bytes: int) -> None:
        """One device counter snapshot's deltas (pages, pages, bytes)."""
        self.data["cache_hits"].append(hits)
        self.data["cache_misses"].append(misses)
        self.data["host_to_device_bytes"].append(host_to_device_bytes)

    def record_host_usage(self, usage: float, pending_page_transfers: int) -> None:
        """The host pool's usage (fraction of 1) and the transfers in flight."""
        self.data["host_cache_usage_perc"].append(usage)
        self.data["pending_page_transfers"].append(pending_page_transfers)

    def record_host_evictions(self, events: Iterable[KVCacheEvictionEvent]) -> None:
        for event in events:
            self.data["host_block_lifetime_seconds"].append(event.lifetime_seconds)
            self.data["host_block_idle_before_evict_seconds"].append(event.idle_seconds)
            self.data["host_block_reuse_gap_seconds"].extend(event.reuse_gaps_seconds)

    def aggregate(self, other: KVConnectorStats) -> HiSparseKVConnectorStats:
        """Fold ``other`` in (counters add, levels keep ``other``'s latest); returns self."""
        if not isinstance(other, HiSparseKVConnectorStats):
            raise TypeError(f"other: expected HiSparseKVConnectorStats, got {type(other).__name__}")
        if other.is_empty():
            return self
        for key, values in other.data.items():
            if key not in self.data:
                raise ValueError(f"other.data: expected keys among {_KEYS}, got {key!r}")
            self.data[key].extend(values[-1:] if key in _LEVEL_KEYS else values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """A compact summary for log lines."""
        reduced: dict[str, int | float] = {
            "HiSparse hot-buffer hits": sum(self.data["cache_hits"]),
            "HiSparse hot-buffer misses": sum(self.data["cache_misses"]),
            "HiSparse host-to-device bytes": sum(self.data["host_to_device_bytes"]),
        }
        if self.data["host_cache_usage_perc"]:
            usage = self.data["host_cache_usage_perc"][-1]
            reduced["HiSparse host KV cache usage %"] = round(100 * usage, 1)
        return reduced

    def is_empty(self) -> bool:
        return all(not values for values in self.data.values())


# Metric name suffix -> (help text); every name is prefixed "vllm:hisparse_".
_COUNTERS = {
    "cache_hits": "HiSparse device hot-buffer hits (pages).",
    "cache_misses": "HiSparse device hot-buffer misses (pages).",
    "host_to_device_bytes": "Bytes copied from host KV pages into HiSparse hot buffers.",
}
_GAUGES = {
    "host_cache_usage_perc": (
        "HiSparse host KV-cache usage, 1 meaning full; evictable cached pages count as free."
    ),
    "pending_page_transfers": "HiSparse page write-backs and restores not yet completed.",
}
_HISTOGRAMS = {
    "host_block_lifetime_seconds": (
        "HiSparse host KV block lifetime from allocation to eviction, sampled."
    ),
    "host_block_idle_before_evict_seconds": (
        "HiSparse host KV block idle time before its eviction, sampled."
    ),
    "host_block_reuse_gap_seconds": (
        "Time between consecutive accesses of a HiSparse host KV block, sampled."
    ),
}


class HiSparsePromMetrics(KVConnectorPromMetrics):
    """HiSparse's Prometheus metrics: the counters add every recorded delta, the gauges show
    the latest level, and the host block residency histograms (seconds; only with
    ``observability_config.kv_cache_metrics``) observe every sample."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric_cls: type, name: str, doc: str, **kwargs: Any) -> dict[int, Any]:
            metric = metric_cls(
                name=f"vllm:hisparse_{name}", documentation=doc, labelnames=labelnames, **kwargs
            )
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self.hisparse_counters = {
            name: per_engine(self._counter_cls, name, doc) for name, doc in _COUNTERS.items()
        }
        self.hisparse_gauges = {
            name: per_engine(self._gauge_cls, name, doc, multiprocess_mode="mostrecent")
            for name, doc in _GAUGES.items()
        }
        self.hisparse_histograms: dict[str, dict[int, Any]] = {}
        observability = vllm_config.observability_config
        if observability.kv_cache_metrics:
            buckets = histogram_buckets(
                "kv_cache_residency", overrides=observability.custom_histogram_buckets
            )
            self.hisparse_histograms = {
                name: per_engine(self._histogram_cls, name, doc, buckets=buckets)
                for name, doc in _HISTOGRAMS.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, counter in self.hisparse_counters.items():
            for value in transfer_stats_data.get(name, ()):
                counter[engine_idx].inc(value)
        for name, gauge in self.hisparse_gauges.items():
            if values := transfer_stats_data.get(name):
                gauge[engine_idx].set(values[-1])
        for name, histogram in self.hisparse_histograms.items():
            for value in transfer_stats_data.get(name, ()):
                histogram[engine_idx].observe(value)
