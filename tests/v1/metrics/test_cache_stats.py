"""Prefix-cache statistics: per-step counters and the windowed hit rate."""

from __future__ import annotations

from vllm.v1.metrics.stats import CachingMetrics, PrefixCacheStats


def test_record_separates_preempted_requests() -> None:
    s = PrefixCacheStats()
    s.record(num_tokens=10, num_hits=4, preempted=False)
    s.record(num_tokens=6, num_hits=6, preempted=True)
    assert (s.requests, s.queries, s.hits) == (1, 10, 4)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 6, 6)


def test_window_drops_oldest_updates_but_keeps_the_newest() -> None:
    m = CachingMetrics(max_recent_requests=3)
    assert m.empty and m.hit_rate == 0.0
    m.observe(PrefixCacheStats(requests=2, queries=10, hits=5))
    m.observe(PrefixCacheStats(requests=0, queries=0, hits=0))  # ignored
    m.observe(PrefixCacheStats(requests=1, queries=10, hits=0))
    assert m.hit_rate == 0.25 and len(m.query_queue) == 2
    m.observe(PrefixCacheStats(requests=1, queries=5, hits=5))  # 4 requests: drop the oldest
    assert (m.aggregated_requests, m.aggregated_query_total, m.aggregated_query_hit) == (2, 15, 5)
    m.observe(PrefixCacheStats(requests=9, queries=4, hits=1))  # alone over the limit: kept
    assert m.aggregated_requests == 9 and m.hit_rate == 0.25
    m.observe(PrefixCacheStats(reset=True, requests=1, queries=2, hits=2))
    assert m.aggregated_requests == 1 and m.hit_rate == 1.0
