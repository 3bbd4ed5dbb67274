"""HiSparse connector statistics (upstream's ``...kv_connector.v1.hisparse.stats``).

Counters (hot-buffer hits and misses, host-to-device bytes, host block lifetimes in
seconds) are per-interval deltas that add up; the host gauges (host pool usage as a
fraction of 1, page transfers in flight) are levels, so aggregating keeps the latest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.metrics.stats import KVCacheEvictionEvent

__all__ = ["HiSparseKVConnectorStats"]

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
class HiSparseKVConnectorStats:
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

    def aggregate(self, other: HiSparseKVConnectorStats) -> HiSparseKVConnectorStats:
        """Fold ``other`` in (counters add, levels keep ``other``'s latest); returns self."""
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
