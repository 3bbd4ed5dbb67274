"""Least-recently-used eviction, with recency decided by requests rather than by when
transfers finish.

Every held chunk has a rank ``(stamp, -end_token)``; the smallest evictable rank goes first.
A chunk stored or touched outside a request's prefix gets a fresh stamp. A request gets one
stamp of its own the first time it is seen (per cache reset), and its positioned chunks share
it, so within an unfinished request its tail (larger end token) goes before its head, and an
older request never demotes a chunk a newer one ranked. When a request finishes, its chunks
get fresh stamps tail to head, so the head is the most recent.

Evictable chunks sit in a min-heap whose entries go stale when a rank changes or the chunk is
pinned; stale entries are skipped when popped, and the heap is rebuilt once it holds twice as
many entries as there are evictable chunks (and at least 64).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

Rank = tuple[int, int]
_MIN_HEAP_REBUILD = 64


@dataclass(slots=True)
class _RequestStamp:
    """A request's stamp, valid for one policy and one cache generation."""

    policy: object
    generation: int
    stamp: int


class LRUCachePolicy(CachePolicy):
    """LRU over the CPU chunks (see the module docstring)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._ranks: dict[OffloadKey, Rank] = {}
        self._evictable: set[OffloadKey] = set()
        self._heap: list[tuple[Rank, OffloadKey]] = []
        self._last_stamp = 0
        self._generation = 0

    @property
    def blocks(self) -> dict[OffloadKey, ChunkStatus]:
        """v0.22's name of :attr:`chunks`."""
        return self.chunks

    def _new_stamp(self) -> int:
        self._last_stamp += 1
        return self._last_stamp

    def _request_stamp(self, req_context: ReqContext) -> int:
        state = req_context.get_state(_RequestStamp)
        if state is None or state.policy is not self or state.generation != self._generation:
            state = _RequestStamp(self, self._generation, self._new_stamp())
            req_context.set_state(state)
        return state.stamp

    def _rebuild_heap(self) -> None:
        self._heap = [(self._ranks[key], key) for key in self._evictable]
        heapq.heapify(self._heap)

    def _shrink_heap_if_stale(self) -> None:
        if len(self._heap) >= max(_MIN_HEAP_REBUILD, 2 * len(self._evictable)):
            self._rebuild_heap()

    def _reheap(self, changed: Sequence[OffloadKey]) -> None:
        """Heap entries for evictable ``changed`` keys whose rank moved."""
        if not changed:
            return
        # Many changes at once: one linear rebuild beats that many pushes.
        if len(changed) >= max(_MIN_HEAP_REBUILD, len(self._evictable) // 4):
            self._rebuild_heap()
            return
        for key in changed:
            heapq.heappush(self._heap, (self._ranks[key], key))
        self._shrink_heap_if_stale()

    def _restamp(self, keys: Iterable[OffloadKey]) -> None:
        """Fresh stamps in the order given: the last key ends most recent."""
        changed = []
        for key in keys:
            if key in self.chunks:
                self._ranks[key] = (self._new_stamp(), 0)
                if key in self._evictable:
                    changed.append(key)
        self._reheap(changed)

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(
        self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext | None = None
    ) -> None:
        self.chunks[key] = chunk
        position = None if req_context is None else req_context.get_offload_key_position(key)
        if position is None:
            self._ranks[key] = (self._new_stamp(), 0)
        else:
            assert req_context is not None
            self._ranks[key] = (self._request_stamp(req_context), -position)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
            heapq.heappush(self._heap, (self._ranks[key], key))

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        del self._ranks[key]
        self._evictable.discard(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext | None = None) -> None:
        self._restamp(reversed(list(keys)))

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        stamp = self._request_stamp(req_context)
        changed = []
        for key in keys:
            position = req_context.get_offload_key_position(key)
            if position is None or key not in self.chunks:
                continue
            rank = (stamp, -position)
            # Never demote: a newer request may already have ranked this chunk higher.
            if rank > self._ranks[key]:
                self._ranks[key] = rank
                if key in self._evictable:
                    changed.append(key)
        self._reheap(changed)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        self._restamp(reversed(order_request_keys(key_groups, req_context)))

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        chosen: list[tuple[Rank, OffloadKey]] = []
        chosen_keys: set[OffloadKey] = set()
        skipped: list[tuple[Rank, OffloadKey]] = []
        while self._heap and len(chosen) < n:
            entry = heapq.heappop(self._heap)
            rank, key = entry
            if key not in self._evictable or self._ranks.get(key) != rank:
                continue  # stale
            if key in chosen_keys:
                continue  # a duplicate entry of an unchanged rank
            if key in protected:
                skipped.append(entry)
                continue
            chosen.append(entry)
            chosen_keys.add(key)
        # Protected entries stay current; chosen ones go back only when nothing is evicted.
        for entry in skipped if len(chosen) == n else skipped + chosen:
            heapq.heappush(self._heap, entry)
        if len(chosen) < n:
            return None
        evicted = []
        for _, key in chosen:
            self._evictable.remove(key)
            del self._ranks[key]
            chunk = self.chunks.pop(key)
            assert chunk.ref_cnt == 0, f"evicting {key!r} with ref_cnt={chunk.ref_cnt}"
            evicted.append((key, chunk))
        self._shrink_heap_if_stale()
        return evicted

    def clear(self) -> None:
        self.chunks.clear()
        self._ranks.clear()
        self._evictable.clear()
        self._heap.clear()
        self._generation += 1

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        heapq.heappush(self._heap, (self._ranks[key], key))
        self._shrink_heap_if_stale()

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.remove(key)
