"""Histogram bucket bounds of the KV-cache metrics (upstream's ``vllm.v1.metrics.buckets``).

The defaults of the family the KV-cache subsystem observes are here: ``kv_cache_residency``,
block residency times in seconds. The engine's request-latency and token-count families take
their bounds from ``custom_histogram_buckets`` only.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm.config.observability import BUCKET_FAMILY_KEYS, BucketFamilyKey

__all__ = [
    "BUCKET_FAMILY_KEYS",
    "KV_CACHE_RESIDENCY_BUCKETS",
    "BucketFamilyKey",
    "histogram_buckets",
]

KV_CACHE_RESIDENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
    1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800,
)  # fmt: skip
"""Seconds: from millisecond reuse gaps to half-hour block lifetimes."""

_DEFAULTS: dict[str, tuple[float, ...]] = {"kv_cache_residency": KV_CACHE_RESIDENCY_BUCKETS}


def histogram_buckets(
    family: BucketFamilyKey,
    max_model_len: int | None = None,
    overrides: Mapping[str, list[float]] | None = None,
) -> list[float]:
    """A fresh list of the upper bounds of ``family``'s buckets: ``overrides[family]`` when
    given (``ObservabilityConfig`` validates them), else the defaults, which exist here for
    the KV-cache family only. ``max_model_len`` sizes the engine's token-count family."""
    if family not in BUCKET_FAMILY_KEYS:
        raise ValueError(f"family: expected one of {sorted(BUCKET_FAMILY_KEYS)}, got {family!r}")
    if overrides is not None and (custom := overrides.get(family)) is not None:
        return list(custom)
    if family not in _DEFAULTS:
        raise ValueError(
            f"family: expected {sorted(_DEFAULTS)} without an override (the engine's own "
            f"families' defaults live in the engine), got {family!r}"
        )
    return list(_DEFAULTS[family])
