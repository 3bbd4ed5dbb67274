"""KV-connector statistics and Prometheus metric bases (upstream's
``...kv_connector.v1.metrics``).

A connector's stats travel from the workers to the logger as a plain dict
(:meth:`KVConnectorStats.to_dict`); a connector's :class:`KVConnectorPromMetrics` registers
its metrics with the metric classes it is handed and records those dicts. ``prometheus_client``
(the ``metrics`` extra) is needed only to build metrics, not to import this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

    from vllm.config import VllmConfig

PromMetric: TypeAlias = "Gauge | Counter | Histogram"
PromMetricT = TypeVar("PromMetricT")

__all__ = ["KVConnectorPromMetrics", "KVConnectorStats", "PromMetric", "PromMetricT"]


@dataclass
class KVConnectorStats(ABC):
    """A connector's telemetry over an interval; subclasses say how to fold and summarize it.
    ``data`` must stay serializable: it crosses from the workers to the logger."""

    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The serializable payload."""
        return self.data

    @abstractmethod
    def reset(self) -> None:
        """Clear the observations."""

    @abstractmethod
    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Fold ``other``'s observations in."""

    @abstractmethod
    def reduce(self) -> dict[str, int | float]:
        """The interval's observations as a few representative values, for log lines."""

    @abstractmethod
    def is_empty(self) -> bool:
        """True when nothing was observed."""


class KVConnectorPromMetrics(ABC):
    """Base of a connector's Prometheus metrics: ``metric_types`` maps prometheus_client's
    ``Gauge`` / ``Counter`` / ``Histogram`` to the classes to instantiate (the engine's
    multiprocess-aware wrappers, or test doubles); ``per_engine_labelvalues`` gives each
    engine index its label values."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        missing = [t.__name__ for t in (Gauge, Counter, Histogram) if t not in metric_types]
        if missing:
            raise ValueError(
                f"metric_types: expected classes for Gauge, Counter and Histogram, got none "
                f"for {', '.join(missing)}"
            )
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._gauge_cls = metric_types[Gauge]
        self._counter_cls = metric_types[Counter]
        self._histogram_cls = metric_types[Histogram]
        self._labelnames = labelnames
        self.per_engine_labelvalues = per_engine_labelvalues

    @abstractmethod
    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one stats payload (:meth:`KVConnectorStats.to_dict`) for ``engine_idx``."""
