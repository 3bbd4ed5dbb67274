"""HiSparse's Prometheus metrics with real prometheus_client metrics in a private registry,
the bucket families, and the observability settings they read."""

from __future__ import annotations

import prometheus_client
import pytest

from vllm.config import ObservabilityConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import HiSparseConnector
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.stats import (
    HiSparseKVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.buckets import KV_CACHE_RESIDENCY_BUCKETS, histogram_buckets
from vllm.v1.metrics.stats import KVCacheEvictionEvent


def _registry_bound_types(registry):
    """prometheus_client's metric classes, registering in ``registry``."""
    from prometheus_client import Counter, Gauge, Histogram

    def bind(cls):
        def make(**kwargs):
            kwargs.pop("multiprocess_mode", None)  # the multiprocess wrapper's option
            return cls(registry=registry, **kwargs)

        return make

    return {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}


@pytest.mark.parametrize("kv_cache_metrics", [True, False])
def test_observed_stats_reach_the_registry(kv_cache_metrics: bool) -> None:
    registry = prometheus_client.CollectorRegistry()
    config = VllmConfig(
        observability_config=ObservabilityConfig(
            kv_cache_metrics=kv_cache_metrics,
            custom_histogram_buckets={"kv_cache_residency": [1.0, 4.0]},
        )
    )
    prom = HiSparseConnector.build_prom_metrics(
        config, _registry_bound_types(registry), ["model_name"], {0: ["m0"], 1: ["m1"]}
    )
    stats = HiSparseKVConnectorStats()
    stats.record_snapshot(hits=5, misses=1, host_to_device_bytes=4096)
    stats.record_host_usage(usage=0.25, pending_page_transfers=2)
    stats.record_host_evictions([KVCacheEvictionEvent(3.0, 0.5, (0.5, 2.0))])
    prom.observe(stats.to_dict(), engine_idx=1)

    def value(name: str, labels: dict[str, str] | None = None) -> float | None:
        return registry.get_sample_value(name, labels or {"model_name": "m1"})

    assert value("vllm:hisparse_cache_hits_total") == 5
    assert value("vllm:hisparse_cache_misses_total") == 1
    assert value("vllm:hisparse_host_to_device_bytes_total") == 4096
    assert value("vllm:hisparse_host_cache_usage_perc") == 0.25
    assert value("vllm:hisparse_pending_page_transfers") == 2
    assert value("vllm:hisparse_cache_hits_total", {"model_name": "m0"}) == 0
    lifetime = "vllm:hisparse_host_block_lifetime_seconds_bucket"
    if kv_cache_metrics:
        # The custom bounds replace the defaults: 3 s falls in the (1, 4] bucket.
        assert value(lifetime, {"model_name": "m1", "le": "1.0"}) == 0
        assert value(lifetime, {"model_name": "m1", "le": "4.0"}) == 1
        assert value("vllm:hisparse_host_block_reuse_gap_seconds_count") == 2
    else:
        assert value(lifetime, {"model_name": "m1", "le": "4.0"}) is None


def test_bases_are_abstract_and_check_metric_types() -> None:
    with pytest.raises(TypeError):
        KVConnectorStats()  # type: ignore[abstract]
    with pytest.raises(ValueError, match="metric_types: expected classes for Gauge"):
        HiSparseConnector.build_prom_metrics(VllmConfig(), {}, [], {})
    assert issubclass(HiSparseKVConnectorStats, KVConnectorStats)
    with pytest.raises(TypeError, match="other: expected HiSparseKVConnectorStats"):
        HiSparseKVConnectorStats().aggregate(_OtherStats())
    assert KVConnectorPromMetrics.__abstractmethods__ == frozenset({"observe"})


class _OtherStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return self

    def reduce(self) -> dict[str, int | float]:
        return {}

    def is_empty(self) -> bool:
        return False


def test_histogram_buckets() -> None:
    assert histogram_buckets("kv_cache_residency") == list(KV_CACHE_RESIDENCY_BUCKETS)
    fresh = histogram_buckets("kv_cache_residency")
    fresh.append(1e9)
    assert histogram_buckets("kv_cache_residency") == list(KV_CACHE_RESIDENCY_BUCKETS)
    custom = {"request_latency": [0.5, 1.0]}
    assert histogram_buckets("request_latency", overrides=custom) == [0.5, 1.0]
    with pytest.raises(ValueError, match="family: expected \\['kv_cache_residency'\\] without"):
        histogram_buckets("request_latency")
    with pytest.raises(ValueError, match="family: expected one of"):
        histogram_buckets("nope")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"kv_cache_metrics_sample": 0.0}, "kv_cache_metrics_sample: expected a fraction"),
        ({"kv_cache_metrics_sample": True}, "kv_cache_metrics_sample: expected a fraction"),
        ({"custom_histogram_buckets": {"nope": [1.0]}}, "expected bucket families among"),
        ({"custom_histogram_buckets": {"kv_cache_residency": []}}, "non-empty list"),
        ({"custom_histogram_buckets": {"kv_cache_residency": [1.0, True]}}, "expected numbers"),
        ({"custom_histogram_buckets": {"kv_cache_residency": [0.0]}}, "finite bounds > 0"),
        ({"custom_histogram_buckets": {"kv_cache_residency": [2.0, 1.0]}}, "strictly increasing"),
    ],
)
def test_observability_config_checks(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ObservabilityConfig(**kwargs)
