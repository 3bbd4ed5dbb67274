"""Adaptive replacement cache (ARC) eviction.

``t1`` holds blocks used once, ``t2`` blocks used again (both least recent first); ``b1`` /
``b2`` remember keys recently evicted from them (ghosts, at most ``cache_capacity`` each).
Evictions take from ``t1`` while it holds at least ``target_t1_size`` blocks, else from ``t2``.
A touched ghost moves the target: a ``b1`` hit raises it (recency pays), a ``b2`` hit lowers
it (frequency pays), by ``max(1, |other ghost| / |this ghost|)``, within ``[0, capacity]``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy


class ARCCachePolicy(CachePolicy):
    """ARC over the CPU blocks; new blocks enter ``t1``, a touch of a stored one promotes it."""

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity: int = cache_capacity
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> BlockStatus | None:
        block = self.t1.get(key)
        return block if block is not None else self.t2.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.b1.pop(key, None)
        self.b2.pop(key, None)
        self.t1[key] = block

    def remove(self, key: OffloadKey) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            self.t2.pop(key, None)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                block = self.t1.pop(key)
                # A block whose store is in flight was not used twice: stays in t1, now MRU.
                (self.t2 if block.is_ready else self.t1)[key] = block
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                step = max(1.0, len(self.b2) / len(self.b1))
                self.target_t1_size = min(self.target_t1_size + step, self.cache_capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                step = max(1.0, len(self.b1) / len(self.b2))
                self.target_t1_size = max(self.target_t1_size - step, 0.0)
                self.b2.move_to_end(key)

    @staticmethod
    def _evictable(
        blocks: OrderedDict[OffloadKey, BlockStatus],
        protected: set[OffloadKey],
        taken: set[OffloadKey],
    ) -> OffloadKey | None:
        for key, block in blocks.items():
            if block.ref_cnt == 0 and key not in protected and key not in taken:
                return key
        return None

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        # Choose all n first (nothing changes on failure), then apply.
        chosen: list[tuple[OffloadKey, bool]] = []  # (key, from t1)
        taken: set[OffloadKey] = set()
        t1_left = len(self.t1)
        for _ in range(n):
            key = None
            if t1_left >= int(self.target_t1_size):
                key = self._evictable(self.t1, protected, taken)
            from_t1 = key is not None
            if key is None:
                key = self._evictable(self.t2, protected, taken)
                if key is None:
                    return None
            t1_left -= from_t1
            taken.add(key)
            chosen.append((key, from_t1))
        evicted: list[tuple[OffloadKey, BlockStatus]] = []
        for key, from_t1 in chosen:
            if from_t1:
                evicted.append((key, self.t1.pop(key)))
                self.b1[key] = None
            else:
                evicted.append((key, self.t2.pop(key)))
                self.b2[key] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.cache_capacity:
                ghosts.popitem(last=False)
        return evicted

    def clear(self) -> None:
        for blocks in (self.t1, self.t2, self.b1, self.b2):
            blocks.clear()
        self.target_t1_size = 0.0
