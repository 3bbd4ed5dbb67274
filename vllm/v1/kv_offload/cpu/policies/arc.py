"""Adaptive replacement cache (ARC) eviction.

``t1`` holds chunks used once, ``t2`` chunks used again (both least recent first); ``b1`` /
``b2`` remember keys recently evicted from them (ghosts, at most ``cache_capacity`` each).
Evictions take from ``t1`` while it holds at least ``target_t1_size`` chunks, else from ``t2``,
and from the other list when the preferred one has nothing evictable. A ghost hit moves the
target: a ``b1`` hit raises it (recency pays), a ``b2`` hit lowers it (frequency pays), by
``max(1, |other ghost| / |this ghost|)``, within ``[0, capacity]``.

A request's accesses count once, when it finishes: a ready chunk it read moves to (the MRU end
of) ``t2``; a chunk it only stored keeps its list and becomes its most recent entry. A store
miss counts as a ghost hit once per request, before the insert clears the ghost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

_Entries = Iterator[tuple[OffloadKey, ChunkStatus]]


class ARCCachePolicy(CachePolicy):
    """ARC over the CPU chunks; new chunks enter ``t1`` (see the module docstring)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        chunk = self.t1.get(key)
        return chunk if chunk is not None else self.t2.get(key)

    def insert(
        self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext | None = None
    ) -> None:
        self.b1.pop(key, None)
        self.b2.pop(key, None)
        self.t1[key] = chunk

    def remove(self, key: OffloadKey) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            self.t2.pop(key, None)

    def _ghost_hit(self, key: OffloadKey) -> None:
        if key in self.b1:
            step = max(1.0, len(self.b2) / len(self.b1))
            self.target_t1_size = min(self.target_t1_size + step, self.cache_capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            step = max(1.0, len(self.b1) / len(self.b2))
            self.target_t1_size = max(self.target_t1_size - step, 0.0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):
            self._ghost_hit(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext | None = None) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                chunk = self.t1.pop(key)
                # A chunk whose store is in flight was not used twice: stays in t1, now MRU.
                (self.t2 if chunk.is_ready else self.t1)[key] = chunk
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._ghost_hit(key)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        for key in reversed(order_request_keys(key_groups, req_context)):
            if key in insertion_only_keys:
                for held in (self.t1, self.t2):
                    if key in held:
                        held.move_to_end(key)
            elif key in reused_keys:
                if key in self.t1:
                    self.t2[key] = self.t1.pop(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)

    @staticmethod
    def _next_evictable(
        entries: _Entries, protected: set[OffloadKey]
    ) -> tuple[OffloadKey, ChunkStatus] | None:
        for key, chunk in entries:
            if chunk.ref_cnt == 0 and key not in protected:
                return key, chunk
        return None

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        # One forward pass over each list (a rescan per pick would be quadratic); choose all n
        # before changing anything, so a failure leaves the lists untouched.
        t1_entries: _Entries = iter(self.t1.items())
        t2_entries: _Entries = iter(self.t2.items())
        t1_left = len(self.t1)
        chosen: list[tuple[OffloadKey, ChunkStatus, bool]] = []  # (key, chunk, from t1)
        for _ in range(n):
            pick = None
            if t1_left >= int(self.target_t1_size):
                pick = self._next_evictable(t1_entries, protected)
            from_t1 = pick is not None
            if pick is None:
                pick = self._next_evictable(t2_entries, protected)
            if pick is None:
                pick = self._next_evictable(t1_entries, protected)
                from_t1 = True
            if pick is None:
                return None
            t1_left -= from_t1
            chosen.append((*pick, from_t1))
        evicted = []
        for key, chunk, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            evicted.append((key, chunk))
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.cache_capacity:
                ghosts.popitem(last=False)
        return evicted

    def clear(self) -> None:
        for entries in (self.t1, self.t2, self.b1, self.b2):
            entries.clear()
        self.target_t1_size = 0.0
