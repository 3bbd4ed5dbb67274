"""KV-cache events (upstream's ``vllm.distributed.kv_events``, the event records): what the block
pool tells external consumers (routers, offload tiers) about pages entering and leaving the
prefix cache. No publisher runs here; consumers drain ``BlockPool.take_events()``.

Block hashes in events are ``ExternalBlockHash`` values (hash bytes, or their low 64 bits as an
int when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is set); ``medium`` names the memory the page
lives in (:data:`MEDIUM_GPU` for the device pool, :data:`MEDIUM_CPU` for a host offload tier).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.block_hashing import ExternalBlockHash

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEventAggregator",
    "KVEventBatch",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass
class KVCacheEvent:
    """Base of the KV-cache events (equal events compare and hash equal, so events from several
    workers can be counted). Mutable: the manager stamps the group's spec kind on each
    ``BlockStored`` after the pool emits it."""


@dataclass
class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: ``block_hashes`` (one per block, in chain order,
    ``parent_block_hash`` before the first) holding ``token_ids`` (``block_size`` tokens each).
    ``extra_keys`` has one entry per block (the keys its hash used) and ``lookahead_token_ids``
    the tokens after each block its hash covers (None without lookahead hashing), so consumers
    can recompute the hashes. ``locality`` (``LOCAL`` / ``REMOTE`` to the publisher) and
    ``ownership`` (an offload tier's id) place the copy; ``session_id`` names the client session
    whose request stored or reused the blocks (not an owner: blocks are shared)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None

    def __hash__(self) -> int:
        lookahead = self.lookahead_token_ids
        return hash(
            (
                tuple(self.block_hashes),
                self.parent_block_hash,
                tuple(self.token_ids),
                self.block_size,
                self.lora_id,
                self.medium,
                tuple(self.extra_keys) if self.extra_keys else None,
                self.group_idx,
                self.kv_cache_spec_kind,
                self.kv_cache_spec_sliding_window,
                self.locality,
                self.ownership,
                self.session_id,
                None if lookahead is None else tuple(map(tuple, lookahead)),
            )
        )


@dataclass
class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache of ``medium`` (evicted or dropped)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __hash__(self) -> int:
        return hash(
            (tuple(self.block_hashes), self.medium, self.group_idx, self.locality, self.ownership)
        )


@dataclass(unsafe_hash=True)
class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


@dataclass
class EventBatch:
    """Events of one step; ``ts`` in seconds since the epoch."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


@dataclass
class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = field(default_factory=list)


class KVEventAggregator:
    """Keeps only the events every one of ``num_workers`` workers reported."""

    def __init__(self, num_workers: int) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers <= 0:
            raise ValueError(f"num_workers: expected a positive int, got {num_workers!r}")
        self._num_workers = num_workers
        self._event_counter: Counter[KVCacheEvent] = Counter()

    def add_events(self, events: list[KVCacheEvent]) -> None:
        """Count one worker's batch."""
        if not isinstance(events, list):
            raise TypeError(f"events: expected a list of KVCacheEvent, got {type(events).__name__}")
        self._event_counter.update(events)

    def get_common_events(self) -> list[KVCacheEvent]:
        """The events all workers reported."""
        return [e for e, n in self._event_counter.items() if n == self._num_workers]

    def clear_events(self) -> None:
        self._event_counter.clear()

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def reset_workers(self) -> None:
        self._num_workers = 1

    def get_number_of_workers(self) -> int:
        return self._num_workers
