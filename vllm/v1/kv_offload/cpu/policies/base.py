"""The eviction-policy interface of :class:`~vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`
and the per-block state it keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from vllm.v1.kv_offload.base import OffloadKey


class BlockStatus:
    """One offloaded block: its CPU slot ``block_id`` and ``ref_cnt``, the number of loads
    reading it, or -1 while its store is in flight (not yet readable)."""

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id: int = block_id
        self.ref_cnt: int = -1

    @property
    def is_ready(self) -> bool:
        """True once the block's store completed (it may be read)."""
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"BlockStatus(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class CachePolicy(ABC):
    """Which offloaded blocks are kept, in what order, and which are evicted.

    A policy owns the key -> :class:`BlockStatus` map; the manager owns slots, reference
    counts and events. Only blocks with ``ref_cnt == 0`` (stored, not being read) are evicted.
    """

    @abstractmethod
    def __init__(self, cache_capacity: int) -> None:
        """``cache_capacity``: the number of CPU blocks."""

    @abstractmethod
    def get(self, key: OffloadKey) -> BlockStatus | None:
        """The block of ``key``, or None when it is not held."""

    @abstractmethod
    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        """Hold a newly allocated block."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drop ``key`` (a store that failed)."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Record a use of ``keys`` (the first key counts as the most recent)."""

    @abstractmethod
    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """Remove and return ``n`` evictable blocks not in ``protected``; None, changing
        nothing, when fewer than ``n`` can be evicted."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every block and any adaptive state."""
