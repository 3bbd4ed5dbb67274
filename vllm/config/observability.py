"""The observability settings the KV-cache metrics read (upstream's ``ObservabilityConfig``,
reduced to its KV-cache fields)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal, get_args

__all__ = ["BUCKET_FAMILY_KEYS", "BucketFamilyKey", "ObservabilityConfig"]

BucketFamilyKey = Literal[
    "request_latency",
    "time_to_first_token",
    "inter_token_latency",
    "iteration_tokens",
    "request_params_n",
    "request_num_preemptions",
    "request_tokens",
    "kv_cache_residency",
]
"""The engine's histogram bucket families (``custom_histogram_buckets`` keys); the KV-cache
metrics use ``kv_cache_residency``."""

BUCKET_FAMILY_KEYS: frozenset[str] = frozenset(get_args(BucketFamilyKey))


@dataclass
class ObservabilityConfig:
    """``kv_cache_metrics``: sample block residency (lifetime, idle time before eviction,
    reuse gaps, in seconds) for Prometheus histograms; ``kv_cache_metrics_sample``: the
    fraction of blocks sampled, in (0, 1]; ``custom_histogram_buckets``: bucket family ->
    upper bounds replacing its defaults (positive, finite, strictly increasing)."""

    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01
    custom_histogram_buckets: dict[str, list[float]] | None = None

    def __post_init__(self) -> None:
        sample = self.kv_cache_metrics_sample
        if isinstance(sample, bool) or not isinstance(sample, (int, float)) or not 0 < sample <= 1:
            raise ValueError(
                f"kv_cache_metrics_sample: expected a fraction in (0, 1], got {sample!r}"
            )
        if self.custom_histogram_buckets is not None:
            for family, bounds in self.custom_histogram_buckets.items():
                _check_buckets(family, bounds)


def _check_buckets(family: str, bounds: object) -> None:
    arg = f"custom_histogram_buckets[{family!r}]"
    if family not in BUCKET_FAMILY_KEYS:
        raise ValueError(
            f"custom_histogram_buckets: expected bucket families among "
            f"{sorted(BUCKET_FAMILY_KEYS)}, got {family!r}"
        )
    if not isinstance(bounds, list) or not bounds:
        raise ValueError(f"{arg}: expected a non-empty list of bounds, got {bounds!r}")
    for bound in bounds:
        if isinstance(bound, bool) or not isinstance(bound, (int, float)):
            raise ValueError(f"{arg}: expected numbers, got {bound!r}")
        if not math.isfinite(bound) or bound <= 0:
            raise ValueError(f"{arg}: expected finite bounds > 0, got {bound!r}")
    if any(a >= b for a, b in pairwise(bounds)):
        raise ValueError(f"{arg}: expected strictly increasing bounds, got {bounds}")
