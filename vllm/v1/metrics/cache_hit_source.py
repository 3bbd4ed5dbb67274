"""Where the KV of cached prompt tokens came from (upstream v0.33's
``vllm.v1.metrics.cache_hit_source``), for per-source hit counts."""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum


class CacheHitSource(str, Enum):
    """A cache tier, nearest the accelerator first (the order blocks are offloaded in).

    Per-source token counts are ``dict[CacheHitSource, int]`` with only non-zero entries.
    """

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"
    """A connector or remote store that does not say; last, so that mixed with a known tier
    the unknown one is reported (a hit is never credited to a nearer tier than it was)."""

    @classmethod
    def outermost(cls, sources: Iterable[CacheHitSource]) -> CacheHitSource:
        """The member of ``sources`` farthest from the accelerator (``ValueError`` if empty)."""
        order = list(cls)
        return max(sources, key=order.index)
