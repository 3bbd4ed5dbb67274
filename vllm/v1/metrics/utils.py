"""Prometheus helpers shared by the KV-cache metrics (upstream's ``vllm.v1.metrics.utils``)."""

from __future__ import annotations

from typing import Any

__all__ = ["create_metric_per_engine"]


def create_metric_per_engine(
    metric: Any, per_engine_labelvalues: dict[int, list[object]]
) -> dict[int, Any]:
    """One labelled child of ``metric`` (a Prometheus counter, gauge or histogram) per engine
    index, keyed by that index."""
    return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}
