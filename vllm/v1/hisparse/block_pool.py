"""HiSparse's host block pool (upstream's ``vllm.v1.hisparse.block_pool``)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.core.block_pool import BlockPool

__all__ = ["SharedEventQueueBlockPool"]


class SharedEventQueueBlockPool(BlockPool):
    """A block pool whose KV events land in another pool's queue (``event_owner``), so one
    drain of the owner reports both tiers in order.

    The queue is read through the owner each time: draining swaps in a new list, so a
    reference kept here would go stale.
    """

    def __init__(self, *args: Any, event_owner: BlockPool, **kwargs: Any) -> None:
        self._event_owner = event_owner
        super().__init__(*args, **kwargs)

    @property  # type: ignore[override]
    def kv_event_queue(self) -> list[KVCacheEvent]:
        return self._event_owner.kv_event_queue

    @kv_event_queue.setter
    def kv_event_queue(self, events: list[KVCacheEvent]) -> None:
        # BlockPool seeds an empty queue at init and swaps in an empty one on a drain; both
        # belong to the owner, which does the draining.
        if events:
            raise ValueError(
                f"events: expected an empty queue (the owner pool drains), got {len(events)}"
            )
