"""The eviction-policy interface of :class:`~vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`
and the per-chunk state it keeps (a chunk: one CPU slot holding ``blocks_per_chunk`` GPU
blocks' worth of KV data)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

from vllm.v1.kv_offload.base import OffloadKey, ReqContext


def order_request_keys(
    key_groups: Sequence[Sequence[OffloadKey]], req_context: ReqContext
) -> list[OffloadKey]:
    """The keys of all groups, head first: by recorded end-token position when every key has
    one, else group after group as given."""
    keys = [key for group in key_groups for key in group]
    positions = [req_context.get_offload_key_position(key) for key in keys]
    if all(position is not None for position in positions):
        order = sorted(range(len(keys)), key=positions.__getitem__)
        return [keys[i] for i in order]
    return keys


class ChunkStatus:
    """One offloaded chunk: its CPU slot ``chunk_id`` and ``ref_cnt``, the number of loads
    reading it, or -1 while its store is in flight (not yet readable)."""

    __slots__ = ("chunk_id", "ref_cnt")

    def __init__(self, chunk_id: int):
        self.chunk_id: int = chunk_id
        self.ref_cnt: int = -1

    @property
    def block_id(self) -> int:
        """v0.22's name of :attr:`chunk_id`."""
        return self.chunk_id

    @property
    def is_ready(self) -> bool:
        """True once the chunk's store completed (it may be read)."""
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"ChunkStatus(chunk_id={self.chunk_id}, ref_cnt={self.ref_cnt})"


BlockStatus = ChunkStatus
"""v0.22's name of :class:`ChunkStatus`."""


class CachePolicy(ABC):
    """Which offloaded chunks are kept, in what order, and which are evicted.

    A policy owns the key -> :class:`ChunkStatus` map; the manager owns slots, reference
    counts and events. Only chunks with ``ref_cnt == 0`` (stored, not being read) are evicted.
    The manager reports every ``ref_cnt`` change to and from 0 (:meth:`mark_evictable`,
    :meth:`mark_non_evictable`) and a request's accesses as they happen
    (:meth:`on_request_access`) and once it finished (:meth:`on_request_finished`).
    """

    def __init__(self, cache_capacity: int) -> None:
        """``cache_capacity``: the number of CPU chunks."""
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        """The chunk of ``key``, or None when it is not held."""

    @abstractmethod
    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        """Hold a newly allocated chunk, stored for ``req_context``'s request."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drop ``key`` (a store that failed)."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Record a use of ``keys`` (the first key counts as the most recent)."""

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """``keys`` were offered for storing and are not held (seen once per request, before
        they are inserted); by default a use."""
        self.touch(keys, req_context)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """A request first accessed ``keys`` (some may not be held yet)."""
        return

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        """A request finished: ``key_groups`` are its keys per KV-cache group, head first;
        ``insertion_only_keys`` it only stored, ``reused_keys`` it read when ready. By default
        one use per group."""
        for keys in key_groups:
            self.touch(keys, req_context)

    @abstractmethod
    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Remove and return ``n`` evictable chunks not in ``protected``; None, changing
        nothing, when fewer than ``n`` can be evicted."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every chunk and any adaptive state."""

    def mark_evictable(self, key: OffloadKey) -> None:
        """``key``'s ``ref_cnt`` became 0."""
        return

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """``key``'s ``ref_cnt`` left 0."""
        return
