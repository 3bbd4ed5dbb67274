"""What offloading managers report about themselves (upstream v0.33's metric records).

- Metric metadata (:class:`OffloadingCounterMetadata`, :class:`OffloadingGaugeMetadata`,
  :class:`OffloadingHistogramMetadata`): what a spec declares it emits, by metric name.
- :class:`ConfigInfo`: fixed facts a manager publishes as the labels of one info series.
- :class:`OffloadingConnectorStats`: the observations of one reporting interval, as plain
  nested dicts (metric types and values by label tuple), so they cross process boundaries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

ConfigInfoMapping = Mapping[str, str | int | float | bool]
"""One info series: label name -> label value."""


@dataclass(frozen=True)
class OffloadingMetricMetadata:
    """What one metric means (its help text) and the names of its labels."""

    documentation: str
    labelnames: tuple[str, ...] = ()


@dataclass(frozen=True)
class OffloadingCounterMetadata(OffloadingMetricMetadata):
    """A metric that only grows (summed over an interval)."""


@dataclass(frozen=True)
class OffloadingGaugeMetadata(OffloadingMetricMetadata):
    """A metric whose latest value counts; ``multiprocess_mode`` tells a multi-process
    collector how to merge writers (each report is a whole snapshot, so the newest wins)."""

    multiprocess_mode: str = "mostrecent"


@dataclass(frozen=True)
class OffloadingHistogramMetadata(OffloadingMetricMetadata):
    """A distribution of observations; ``buckets`` are the upper bounds (None: the
    collector's default)."""

    buckets: tuple[float, ...] | None = None


@dataclass(frozen=True)
class OffloadingKVEventsConfig:
    """Whether KV events are published (``enable_kv_cache_events``) and whether stored-block
    events should describe themselves fully (``self_describing_kv_events``; only with
    events on)."""

    enable_kv_cache_events: bool
    self_describing_kv_events: bool


@dataclass(frozen=True)
class ConfigInfo:
    """Fixed facts of one component, each field one label of an info metric series.

    The spec declares the label names (:meth:`config_info_keys`), the manager fills them
    (:meth:`as_config_info`); values must not change while the process lives.
    """

    @classmethod
    def config_info_keys(cls) -> tuple[str, ...]:
        """The label names: the field names, in declaration order."""
        return tuple(info.name for info in fields(cls))

    def as_config_info(self) -> ConfigInfoMapping:
        """The labels; a None value is published as the text ``"None"`` (known to be
        unknown), never as an empty label."""
        return {
            info.name: "None" if (value := getattr(self, info.name)) is None else value
            for info in fields(self)
        }


_COUNTER, _GAUGE, _HISTOGRAM = "counter", "gauge", "histogram"


@dataclass
class OffloadingConnectorStats:
    """Observations of one interval, keyed by metric name and label values.

    ``data`` is ``{"types": {name: kind}, "data": {name: {labelvalues: value}}, "info":
    [labels, ...] | None}``: counters hold a running sum, gauges the last value, histograms
    the list of samples. Unlabelled metrics use ``()`` as their label values.
    """

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "data" not in self.data:
            self.reset()

    def reset(self) -> None:
        """Drop every observation and the info."""
        self.data = {"types": {}, "data": {}, "info": None}

    def metric_sections(self) -> tuple[dict[str, str], dict[str, dict[tuple[str, ...], Any]]]:
        """The live (types, values) dicts, for a manager that edits its own metrics in
        place (renaming them, say)."""
        return self.data["types"], self.data["data"]

    def _slot(self, name: str, kind: str) -> dict[tuple[str, ...], Any]:
        known = self.data["types"].setdefault(name, kind)
        if known != kind:
            raise ValueError(f"{name}: expected a {known} metric, got a {kind} observation")
        return self.data["data"].setdefault(name, {})

    def increase_counter(
        self, name: str, value: int | float = 1, labelvalues: tuple[str, ...] = ()
    ) -> None:
        """Add ``value`` to counter ``name``."""
        slot = self._slot(name, _COUNTER)
        slot[labelvalues] = slot.get(labelvalues, 0) + value

    def set_gauge(self, name: str, value: int | float, labelvalues: tuple[str, ...] = ()) -> None:
        """Set gauge ``name`` to ``value``."""
        self._slot(name, _GAUGE)[labelvalues] = value

    def observe_histogram(
        self, name: str, value: int | float, labelvalues: tuple[str, ...] = ()
    ) -> None:
        """Record one sample of histogram ``name``."""
        self._slot(name, _HISTOGRAM).setdefault(labelvalues, []).append(value)

    def set_info(self, info: list[ConfigInfoMapping]) -> None:
        """Attach the info series (sent once, kept through :meth:`aggregate`)."""
        self.data["info"] = [dict(series) for series in info]

    def is_empty(self) -> bool:
        """No observation and no info."""
        return not self.data["data"] and self.data["info"] is None

    def aggregate(self, other: OffloadingConnectorStats) -> OffloadingConnectorStats:
        """Merge ``other`` into this payload (counters add, gauges take ``other``'s value,
        histograms concatenate); returns self."""
        if other.data["info"] is not None:
            self.set_info(other.data["info"])
        for name, by_labels in other.data["data"].items():
            kind = other.data["types"][name]
            slot = self._slot(name, kind)
            for labels, value in by_labels.items():
                if kind == _HISTOGRAM:
                    slot.setdefault(labels, []).extend(value)
                elif kind == _COUNTER:
                    slot[labels] = slot.get(labels, 0) + value
                else:
                    slot[labels] = value
        return self

    def reduce(self) -> dict[str, int | float]:
        """One summary value per series: ``name`` (or ``name:labels``) for counters and
        gauges, ``<name>_count`` and ``<name>_sum`` for histograms."""
        out: dict[str, int | float] = {}
        for name, by_labels in self.data["data"].items():
            kind = self.data["types"][name]
            for labels, value in by_labels.items():
                key = f"{name}:{labels}" if labels else name
                if kind == _HISTOGRAM:
                    out[f"{key}_count"] = len(value)
                    out[f"{key}_sum"] = sum(value)
                else:
                    out[key] = value
        return out
