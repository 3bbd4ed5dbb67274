"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy


class LRUCachePolicy(CachePolicy):
    """Blocks in one recency order, least recent first; eviction takes from the front."""

    def __init__(self, cache_capacity: int) -> None:
        self.blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.blocks[key] = block

    def remove(self, key: OffloadKey) -> None:
        del self.blocks[key]

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        # Last moved ends most recent: walk backwards so keys[0] wins.
        for key in reversed(list(keys)):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        chosen: list[tuple[OffloadKey, BlockStatus]] = []
        if n > 0:
            for key, block in self.blocks.items():
                if block.ref_cnt == 0 and key not in protected:
                    chosen.append((key, block))
                    if len(chosen) == n:
                        break
        if len(chosen) < n:
            return None
        for key, _ in chosen:
            del self.blocks[key]
        return chosen

    def clear(self) -> None:
        self.blocks.clear()
