"""The scheduler-side record of blocks offloaded to CPU memory: CPU slots, reference counts,
events, an optional store filter, and an eviction policy (LRU or ARC)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator
from typing import Literal

from vllm.utils import check_positive_int
from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

CACHE_POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUCachePolicy, "arc": ARCCachePolicy}
"""Eviction policies by their ``eviction_policy`` name."""


class CPUOffloadingManager(OffloadingManager):
    """Tracks ``num_blocks`` CPU block slots.

    Slots are handed out fresh (0, 1, ...) until all were used once, then from the slots freed
    since, most recently freed first. A stored block is loadable after :meth:`complete_store`;
    while loads read it (between :meth:`prepare_load` and :meth:`complete_load`) it is not
    evicted. ``store_threshold >= 2`` stores only keys looked up at least that many times,
    counted over the ``max_tracker_size`` most recently looked-up keys. With ``enable_events``,
    stores and evictions are reported by :meth:`take_events`.
    """

    def __init__(
        self,
        num_blocks: int,
        cache_policy: Literal["lru", "arc"] = "lru",
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
    ):
        policy_cls = CACHE_POLICIES.get(cache_policy)
        if policy_cls is None:
            raise ValueError(
                f"cache_policy: expected one of {sorted(CACHE_POLICIES)}, got {cache_policy!r}"
            )
        self.medium: str = CPULoadStoreSpec.medium()
        self._num_blocks = num_blocks
        self._num_allocated_blocks = 0  # slots 0 .. this - 1 were handed out at least once
        self._free_list: list[int] = []
        self._policy: CachePolicy = policy_cls(cache_capacity=num_blocks)
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self.store_threshold = store_threshold
        self.max_tracker_size = check_positive_int("max_tracker_size", max_tracker_size)
        # Lookup counts, least recently looked up first (only with a threshold).
        self.counts: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )

    def _num_free_blocks(self) -> int:
        return self._num_blocks - self._num_allocated_blocks + len(self._free_list)

    def _allocate(self, n: int) -> list[BlockStatus]:
        fresh = min(n, self._num_blocks - self._num_allocated_blocks)
        blocks = [BlockStatus(self._num_allocated_blocks + i) for i in range(fresh)]
        self._num_allocated_blocks += fresh
        blocks.extend(BlockStatus(self._free_list.pop()) for _ in range(n - fresh))
        return blocks

    def _event(self, keys: list[OffloadKey], removed: bool) -> None:
        if keys and self.events is not None:
            self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=removed))

    def _count_lookup(self, key: OffloadKey) -> None:
        if self.counts is None:
            return
        if key in self.counts:
            self.counts[key] += 1
            self.counts.move_to_end(key)
            return
        if len(self.counts) >= self.max_tracker_size:
            self.counts.popitem(last=False)
        self.counts[key] = 1

    def _block(self, key: OffloadKey, ready: bool = False) -> BlockStatus:
        block = self._policy.get(key)
        if block is None:
            raise KeyError(f"offload key {key!r} is not held by the CPU manager")
        if ready and not block.is_ready:
            raise ValueError(f"offload key {key!r}: its store has not completed")
        return block

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        self._count_lookup(key)
        block = self._policy.get(key)
        if block is None:
            return False
        return True if block.is_ready else None

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        blocks = [self._block(key, ready=True) for key in keys]
        for block in blocks:
            block.ref_cnt += 1
        return CPULoadStoreSpec([block.block_id for block in blocks])

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._policy.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            block = self._block(key)
            if block.ref_cnt <= 0:
                raise ValueError(f"offload key {key!r}: complete_load without prepare_load")
            block.ref_cnt -= 1

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        # One slot per key: a key offered twice would take two slots and free one.
        keys = list(dict.fromkeys(keys))
        if self.counts is not None:
            counts = self.counts
            keys = [key for key in keys if counts.get(key, 0) >= self.store_threshold]
        new_keys = [key for key in keys if self._policy.get(key) is None]
        evicted: list[OffloadKey] = []
        shortfall = len(new_keys) - self._num_free_blocks()
        if new_keys and shortfall > 0:
            # Keys of this call that are held already must stay held.
            victims = self._policy.evict(shortfall, set(keys))
            if victims is None:
                return None
            for key, block in victims:
                self._free_list.append(block.block_id)
                evicted.append(key)
            self._event(evicted, removed=True)
        blocks = self._allocate(len(new_keys))
        for key, block in zip(new_keys, blocks, strict=True):
            self._policy.insert(key, block)
        return PrepareStoreOutput(
            keys_to_store=new_keys,
            store_spec=CPULoadStoreSpec([block.block_id for block in blocks]),
            evicted_keys=evicted,
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        stored: list[OffloadKey] = []
        for key in keys:
            block = self._policy.get(key)
            if block is None or block.is_ready:
                continue
            if success:
                block.ref_cnt = 0
                stored.append(key)
            else:
                self._policy.remove(key)
                self._free_list.append(block.block_id)
        self._event(stored, removed=False)

    def reset_cache(self) -> None:
        # The engine guarantees no completion of a job from before the reset arrives later.
        self._policy.clear()
        self._free_list.clear()
        self._num_allocated_blocks = 0

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self.events is None:
            return
        events, self.events = self.events, []
        yield from events
