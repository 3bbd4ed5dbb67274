"""The scheduler-side record of chunks offloaded to CPU memory: CPU slots, reference counts,
events, an optional store filter, statistics, and a pluggable eviction policy (built in: LRU,
ARC; others by name through :class:`~vllm.v1.kv_offload.cpu.policies.factory.CachePolicyFactory`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadingConnectorStats,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.cpu.common import (
    CPULoadStoreSpec,
    CPUOffloadingInfo,
    CPUOffloadingMetrics,
)
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource


@dataclass(slots=True)
class _RequestAccess:
    """What one request did with the cache, for the policy when it finishes."""

    manager: object
    generation: int
    key_groups: dict[int, list[OffloadKey]] = field(default_factory=dict)
    seen: set[OffloadKey] = field(default_factory=set)
    inserted: set[OffloadKey] = field(default_factory=set)
    reused: set[OffloadKey] = field(default_factory=set)
    store_misses: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


class CPUOffloadingManager(OffloadingManager):
    """Tracks ``num_chunks`` CPU chunk slots.

    Slots are handed out fresh (0, 1, ...) until all were used once, then from the slots freed
    since, most recently freed first. A stored chunk is loadable after :meth:`complete_store`;
    while loads read it (between :meth:`prepare_load` and :meth:`complete_load`) it is not
    evicted, nor is a key offered to the same :meth:`prepare_store`. ``store_threshold >= 2``
    stores only keys offered at least that many times, counted over the ``max_tracker_size``
    most recently offered keys. With ``enable_events``, stores and evictions are reported by
    :meth:`take_events`. ``num_blocks`` is v0.22's name of ``num_chunks``.
    """

    def __init__(
        self,
        num_chunks: int | None = None,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: CPUOffloadingInfo | None = None,
        *,
        num_blocks: int | None = None,
    ):
        if (num_chunks is None) == (num_blocks is None):
            raise TypeError(
                f"num_chunks: expected exactly one of num_chunks / num_blocks, got "
                f"{num_chunks=}, {num_blocks=}"
            )
        size = num_chunks if num_chunks is not None else num_blocks
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"num_chunks: expected an int >= 0, got {size!r}")
        if isinstance(max_tracker_size, bool) or max_tracker_size < 1:
            raise ValueError(f"max_tracker_size: expected a positive int, got {max_tracker_size}")
        policy_cls = CachePolicyFactory.get_cache_policy_cls(cache_policy, cache_policy_module_path)
        self.medium: Medium = Medium.CPU
        self._num_chunks: int = size
        self._num_allocated_chunks = 0  # slots 0 .. this - 1 were handed out at least once
        self._free_list: list[int] = []
        self._policy: CachePolicy = policy_cls(cache_capacity=size)
        self._num_evictable_cache_chunks = 0  # held with ref_cnt == 0
        self._num_write_pending_chunks = 0  # held with ref_cnt == -1
        self._generation = 0  # bumped by reset_cache: older request records are void
        self._config_info: ConfigInfoMapping = info.as_config_info() if info else {}
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self.store_threshold: int = store_threshold
        self.max_tracker_size: int = max_tracker_size
        # Offer counts, least recently offered first (only with a threshold).
        self.counts: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )
        self.stores_skipped_in_current_batch = 0
        self.allocation_sizes_in_current_batch: list[int] = []

    # --- slots -------------------------------------------------------------------------

    def _get_num_free_chunks(self) -> int:
        return self._num_chunks - self._num_allocated_chunks + len(self._free_list)

    def _allocate_chunks(self, keys: list[OffloadKey]) -> list[ChunkStatus]:
        """One slot per key: fresh ones first, then the most recently freed."""
        fresh = min(len(keys), self._num_chunks - self._num_allocated_chunks)
        chunks = [ChunkStatus(self._num_allocated_chunks + i) for i in range(fresh)]
        self._num_allocated_chunks += fresh
        chunks.extend(ChunkStatus(self._free_list.pop()) for _ in range(len(keys) - fresh))
        return chunks

    def _event(self, keys: list[OffloadKey], removed: bool, metadata_only: bool = False) -> None:
        if keys and self.events is not None:
            self.events.append(
                OffloadingEvent(
                    keys=keys, medium=self.medium, removed=removed, metadata_only=metadata_only
                )
            )

    def _chunk(self, key: OffloadKey) -> ChunkStatus:
        chunk = self._policy.get(key)
        if chunk is None:
            raise KeyError(f"offload key {key!r} is not held by the CPU manager")
        return chunk

    # --- request bookkeeping -------------------------------------------------------------

    def _record_offer(self, keys: Collection[OffloadKey]) -> None:
        """Count one offer of ``keys``; a full tracker forgets its least recent keys, never
        those of this offer it already tracked."""
        counts = self.counts
        assert counts is not None
        tracked = [key for key in keys if key in counts]
        for key in tracked:
            counts[key] += 1
            counts.move_to_end(key)
        forgettable = len(counts) - len(tracked)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if forgettable == 0:
                    continue
                counts.popitem(last=False)
                forgettable -= 1
            counts[key] = 1

    def _request_access(self, req_context: ReqContext) -> _RequestAccess:
        state = req_context.get_state(_RequestAccess)
        if state is None or state.manager is not self or state.generation != self._generation:
            state = _RequestAccess(self, self._generation)
            req_context.set_state(state)
        return state

    def _record_request_cache_access(
        self,
        keys: Iterable[OffloadKey],
        req_context: ReqContext,
        inserted_keys: Iterable[OffloadKey] = (),
        reused_keys: Iterable[OffloadKey] = (),
    ) -> None:
        state = self._request_access(req_context)
        first_seen = []
        for key in keys:
            if key in state.seen:
                continue
            if state.finished:
                raise RuntimeError(f"request {req_context.req_id!r}: accessed after it finished")
            state.key_groups.setdefault(get_offload_group_idx(key), []).append(key)
            state.seen.add(key)
            first_seen.append(key)
        if first_seen:
            self._policy.on_request_access(first_seen, req_context)
        state.inserted.update(inserted_keys)
        # Reading back a chunk this request stored (a tier cascade, say) is no reuse.
        state.reused.update(key for key in reused_keys if key not in state.inserted)

    # --- OffloadingManager ---------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request_access(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        chunk = self._policy.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.is_ready else LookupResult.HIT_PENDING

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """Where a hit of this manager is loaded from: host memory."""
        return CacheHitSource.HOST

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        return self._prepare_load(keys, req_context, record_access=True)

    def _prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext, *, record_access: bool
    ) -> CPULoadStoreSpec:
        """Pin ``keys``' chunks for reading; ``record_access=False`` for reads that are not a
        use by the request (a tier cascade, which may run after the request finished)."""
        chunks = [self._chunk(key) for key in keys]
        for key, chunk in zip(keys, chunks, strict=True):
            if not chunk.is_ready:
                raise ValueError(f"offload key {key!r}: its store has not completed")
        for key, chunk in zip(keys, chunks, strict=True):
            if chunk.ref_cnt == 0:
                self._policy.mark_non_evictable(key)
                self._num_evictable_cache_chunks -= 1
            chunk.ref_cnt += 1
        if record_access:
            self._record_request_cache_access(keys, req_context, reused_keys=keys)
        return CPULoadStoreSpec([chunk.chunk_id for chunk in chunks])

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._policy.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        chunks = [self._chunk(key) for key in keys]
        for key, chunk in zip(keys, chunks, strict=True):
            if chunk.ref_cnt <= 0:
                raise ValueError(f"offload key {key!r}: complete_load without prepare_load")
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self._num_evictable_cache_chunks += 1
                self._policy.mark_evictable(key)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        # One slot per key: a key offered twice would take two slots and free one.
        keys = list(dict.fromkeys(keys))
        if self.counts is not None:
            self._record_offer(keys)
        new_keys: list[OffloadKey] = []
        ready_keys: list[OffloadKey] = []
        for key in keys:
            chunk = self._policy.get(key)
            if chunk is None:
                new_keys.append(key)
            elif chunk.is_ready:
                ready_keys.append(key)
        # The threshold filters new keys only: a held, ready key is a reuse whatever its count.
        if self.counts is not None:
            counts, threshold = self.counts, self.store_threshold
            admitted = [key for key in new_keys if counts.get(key, 0) >= threshold]
            self.stores_skipped_in_current_batch += len(new_keys) - len(admitted)
            new_keys = admitted
        state = self._request_access(req_context)
        misses = [key for key in new_keys if key not in state.store_misses]
        if misses:
            # Before the insert clears a ghost entry (ARC learns from it), once per request.
            self._policy.on_store_miss(misses, req_context)
            state.store_misses.update(misses)
        # Recorded once, before any early return; insertions only once they are allocated.
        recorded = set(new_keys).union(ready_keys)
        self._record_request_cache_access(
            [key for key in keys if key in recorded], req_context, reused_keys=ready_keys
        )
        if not new_keys:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])
        self.allocation_sizes_in_current_batch.append(len(new_keys))
        evicted: list[OffloadKey] = []
        shortfall = len(new_keys) - self._get_num_free_chunks()
        if shortfall > 0:
            if shortfall > self._num_evictable_cache_chunks:
                return None
            # Keys of this offer that are held already must stay held.
            victims = self._policy.evict(shortfall, set(keys))
            if victims is None:
                return None
            self._num_evictable_cache_chunks -= len(victims)
            for key, chunk in victims:
                self._free_list.append(chunk.chunk_id)
                evicted.append(key)
            self._event(evicted, removed=True)
        chunks = self._allocate_chunks(new_keys)
        for key, chunk in zip(new_keys, chunks, strict=True):
            self._policy.insert(key, chunk, req_context)
        self._num_write_pending_chunks += len(new_keys)
        state.inserted.update(new_keys)
        return PrepareStoreOutput(
            keys_to_store=new_keys,
            store_spec=CPULoadStoreSpec([chunk.chunk_id for chunk in chunks]),
            evicted_keys=evicted,
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        done: list[OffloadKey] = []
        for key in keys:
            chunk = self._policy.get(key)
            if chunk is None or chunk.is_ready:
                continue
            self._num_write_pending_chunks -= 1
            if success:
                chunk.ref_cnt = 0
                self._num_evictable_cache_chunks += 1
                self._policy.mark_evictable(key)
            else:
                self._policy.remove(key)
                self._free_list.append(chunk.chunk_id)
            done.append(key)
        # A failed store was never announced: its release is bookkeeping, not an eviction.
        self._event(done, removed=not success, metadata_only=not success)

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = req_context.get_state(_RequestAccess)
        if (
            state is None
            or state.manager is not self
            or state.generation != self._generation
            or state.finished
        ):
            return
        state.finished = True
        key_groups = tuple(
            tuple(order_request_keys([state.key_groups[group]], req_context))
            for group in sorted(state.key_groups)
        )
        self._policy.on_request_finished(
            key_groups, state.inserted - state.reused, state.reused, req_context
        )

    def reset_cache(self) -> None:
        # The scheduler guarantees no completion of a job from before the reset arrives later.
        self._policy.clear()
        self._generation += 1
        self._num_evictable_cache_chunks = 0
        self._num_write_pending_chunks = 0
        self._free_list.clear()
        self._num_allocated_chunks = 0

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self.events is None:
            return
        # Detached first: a drain stopped early must not replay these events.
        events, self.events = self.events, []
        for event in events:
            if event.metadata_only:
                # A retry may hold the key again already; its release is then moot.
                keys = [key for key in event.keys if self._policy.get(key) is None]
                if not keys:
                    continue
                event = replace(event, keys=keys)
            yield event

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    def get_stats(self) -> OffloadingConnectorStats:
        """Usage gauges (fractions of all slots: in use, being written, being read), the
        allocation sizes since the last call (chunks) and, with a threshold, skipped stores."""
        stats = OffloadingConnectorStats()
        total = self._num_chunks
        used = self._num_allocated_chunks - len(self._free_list) - self._num_evictable_cache_chunks
        usage = used / total if total else 0.0
        write_usage = self._num_write_pending_chunks / total if total else 0.0
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write_usage)
        stats.set_gauge(
            CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, max(usage - write_usage, 0.0)
        )
        for size in self.allocation_sizes_in_current_batch:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self.allocation_sizes_in_current_batch.clear()
        if self.counts is not None:
            stats.increase_counter(
                CPUOffloadingMetrics.STORES_SKIPPED, self.stores_skipped_in_current_batch
            )
            self.stores_skipped_in_current_batch = 0
        return stats
