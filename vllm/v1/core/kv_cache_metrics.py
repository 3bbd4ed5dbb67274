"""Sampled block-residency metrics (upstream's ``KVCacheMetricsCollector``): for a random
``sample_rate`` fraction of allocated blocks, how long they lived, how long they sat idle before
eviction and the gaps between their reuses (seconds)."""

from __future__ import annotations

import random
import time
from collections import deque

from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.metrics.stats import KVCacheEvictionEvent

__all__ = ["BlockMetricsState", "KVCacheMetricsCollector"]

# Reuse gaps need only the last few accesses; a bound keeps hot blocks from growing it.
_ACCESS_HISTORY = 4


class BlockMetricsState:
    """Timestamps (monotonic ns) of one sampled block."""

    def __init__(self) -> None:
        now = time.monotonic_ns()
        self.birth_time_ns = now
        self.last_access_ns = now
        self.access_history: deque[int] = deque(maxlen=_ACCESS_HISTORY)

    def record_access(self) -> None:
        now = time.monotonic_ns()
        self.last_access_ns = now
        self.access_history.append(now)

    def get_lifetime_seconds(self) -> float:
        return (time.monotonic_ns() - self.birth_time_ns) / 1e9

    def get_idle_time_seconds(self) -> float:
        return (time.monotonic_ns() - self.last_access_ns) / 1e9

    def get_reuse_gaps_seconds(self) -> list[float]:
        h = list(self.access_history)
        return [(b - a) / 1e9 for a, b in zip(h, h[1:], strict=False)]


class KVCacheMetricsCollector:
    """Hooks the block pool calls on allocate / access / evict of a block."""

    def __init__(self, sample_rate: float = 0.01) -> None:
        if not 0 < sample_rate <= 1.0:
            # AssertionError, as upstream raises (its callers and tests expect that type).
            raise AssertionError(f"sample_rate: expected a value in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.block_metrics: dict[int, BlockMetricsState] = {}
        self._eviction_events: list[KVCacheEvictionEvent] = []

    def should_sample_block(self) -> bool:
        return random.random() < self.sample_rate

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        if self.should_sample_block():
            self.block_metrics[block.block_id] = BlockMetricsState()

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        state = self.block_metrics.get(block.block_id)
        if state is not None:
            state.record_access()

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        state = self.block_metrics.pop(block.block_id, None)
        if state is None:
            return
        self._eviction_events.append(
            KVCacheEvictionEvent(
                lifetime_seconds=state.get_lifetime_seconds(),
                idle_seconds=state.get_idle_time_seconds(),
                reuse_gaps_seconds=tuple(state.get_reuse_gaps_seconds()),
            )
        )

    def reset(self) -> None:
        """Forget all samples and events (the prefix cache was reset)."""
        self.block_metrics.clear()
        self._eviction_events.clear()

    def drain_events(self) -> list[KVCacheEvictionEvent]:
        """The eviction events since the last call."""
        events, self._eviction_events = self._eviction_events, []
        return events
