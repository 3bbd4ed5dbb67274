"""Prefix-cache statistics (upstream's ``vllm.v1.metrics.stats``, the cache part): per-step
counters the KV-cache manager fills, and a hit rate over the most recent requests."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = [
    "BaseCacheStats",
    "CachingMetrics",
    "KVCacheEvictionEvent",
    "PrefixCacheStats",
]


@dataclass
class BaseCacheStats:
    """Cache lookups of one update: ``requests`` looked up ``queries`` units, ``hits`` hit;
    ``reset`` says the cache was reset before them."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0


@dataclass
class PrefixCacheStats(BaseCacheStats):
    """Prefix-cache lookups; ``queries`` and ``hits`` are in tokens. Requests resumed after
    preemption are counted apart, so they do not inflate the hit rate of new requests."""

    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Count one request's lookup of ``num_tokens`` tokens with ``num_hits`` cached."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass
class KVCacheEvictionEvent:
    """Residency of one sampled block when it was evicted (seconds)."""

    lifetime_seconds: float
    idle_seconds: float
    reuse_gaps_seconds: tuple[float, ...]


class CachingMetrics:
    """Hit rate over about the last ``max_recent_requests`` requests.

    Updates are kept whole: the oldest are dropped while more than ``max_recent_requests``
    requests are aggregated, but the newest update always stays.
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        # (requests, queries, hits) of each kept update, oldest first.
        self.query_queue: deque[tuple[int, int, int]] = deque()

    def observe(self, stats: BaseCacheStats) -> None:
        """Add one update (after a reset when ``stats.reset``)."""
        if stats.reset:
            self.reset()
        if stats.requests == 0:
            # An empty update would push real ones out of the window for nothing.
            return
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            requests, queries, hits = self.query_queue.popleft()
            self.aggregated_requests -= requests
            self.aggregated_query_total -= queries
            self.aggregated_query_hit -= hits

    def reset(self) -> None:
        """Forget every update."""
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue.clear()

    @property
    def empty(self) -> bool:
        return self.aggregated_requests == 0

    @property
    def hit_rate(self) -> float:
        """Hits / queries over the window (0.0 when nothing was queried)."""
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total
