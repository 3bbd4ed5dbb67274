"""KV-cache block metadata and the free-block queue (upstream's ``KVCacheBlock`` and
``FreeKVCacheBlockQueue``, importable from :mod:`vllm.v1.core.kv_cache_utils`).

A block is one page of the device KV cache: ``block_id`` indexes the page (0 ..
``num_gpu_blocks - 1``), ``ref_cnt`` counts the requests using it, and a full, cached block
carries its ``block_hash`` (a ``BlockHashWithGroupId``: block hash bytes + 4-byte group id).

The free queue is an intrusive doubly linked list threaded through the blocks' own
``prev_free_block`` / ``next_free_block`` fields between two sentinel blocks, so allocate
(popleft), free (append) and touch (remove from the middle) are O(1) and allocate no Python
objects. Order = eviction order: the front is evicted first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

__all__ = [
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheBlockCopy",
    "null_head_len",
    "trim_null_head",
]


class KVCacheBlockCopy(NamedTuple):
    """One page copy the worker runs before a step's forward pass (copy-on-write of a shared
    page hit inside it): the contents of ``src_block_id`` go to ``dst_block_id``."""

    src_block_id: int
    dst_block_id: int


class OwningPool(Protocol):
    """The pool a page returns to (a :class:`vllm.v1.core.block_pool.BlockPool`)."""

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None: ...


@dataclass(slots=True)
class KVCacheBlock:
    """Metadata of one KV-cache page."""

    block_id: int
    ref_cnt: int = 0
    # The pool that owns the page (None: built outside a pool), so a list of pages from
    # several pools (a device and a host pool) can be freed through either.
    pool: OwningPool | None = field(default=None, repr=False, compare=False, kw_only=True)
    _block_hash: bytes | None = None
    # Prefix tokens the hash covers (a full block's end, or a position inside a state page).
    _block_hash_num_tokens: int | None = None
    # Links of the free queue; only FreeKVCacheBlockQueue writes them.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # The placeholder page (id 0 of a BlockPool): never cached, never freed.
    is_null: bool = False

    @property
    def block_hash(self) -> bytes | None:
        """The ``BlockHashWithGroupId`` key of a full cached block, else None."""
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: bytes) -> None:
        self.set_block_hash(block_hash)

    @property
    def block_hash_num_tokens(self) -> int | None:
        """Prefix tokens (from the sequence start) the hash covers; None: not cached or set
        without a count (up to the block's end)."""
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash: bytes, num_tokens: int | None = None) -> None:
        """Record the ``BlockHashWithGroupId`` key this block is cached under, covering
        ``num_tokens`` prefix tokens (None: the whole block)."""
        # A cached block keeps its key until evicted; overwriting it would orphan the
        # hash-map entry that still points at this block.
        if self._block_hash is not None:
            raise AssertionError(
                f"block {self.block_id}: expected no hash before caching, got {self._block_hash!r}"
            )
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        """Forget the hash (the block was evicted from the prefix cache)."""
        self._block_hash = None
        self._block_hash_num_tokens = None

    def __repr__(self) -> str:
        # Neighbours by id only: printing them whole would recurse along the list.
        prev_id = None if self.prev_free_block is None else self.prev_free_block.block_id
        next_id = None if self.next_free_block is None else self.next_free_block.block_id
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"_block_hash={self._block_hash!r}, prev_free_block={prev_id}, "
            f"next_free_block={next_id})"
        )


class FreeKVCacheBlockQueue:
    """The free blocks in eviction order, as a linked list through the blocks themselves.

    Initially the blocks are in the given order (block id order for a pool). Callers keep the
    LRU order by appending freed blocks at the tail, a request's blocks tail-first so the end of
    a prefix chain is evicted before its start.

    Args:
        blocks: the blocks that start out free, front first.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        # Sentinels: every real block in the queue has both neighbours, so no link
        # update needs a None check.
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Take the front block (the next to evict). ValueError when empty."""
        head = self.fake_free_list_head
        first = head.next_free_block
        if first is None or first is self.fake_free_list_tail:
            if self.num_free_blocks != 0:
                raise AssertionError(
                    f"num_free_blocks: expected 0 for an empty list, got {self.num_free_blocks}"
                )
            raise ValueError("No free blocks available")
        after = first.next_free_block
        if after is None:
            raise RuntimeError(f"popleft(): block {first.block_id} has no next_free_block")
        head.next_free_block = after
        after.prev_free_block = head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the ``n`` front blocks, front first."""
        if n == 0:
            return []
        if n > self.num_free_blocks:
            raise AssertionError(f"n: expected at most {self.num_free_blocks} blocks, got {n}")
        taken: list[KVCacheBlock] = []
        block = self.fake_free_list_head.next_free_block
        for _ in range(n):
            assert block is not None
            taken.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        self.fake_free_list_head.next_free_block = block
        block.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue (a prefix hit on a free block)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        if self.fake_free_list_tail.prev_free_block is None:
            raise RuntimeError("prev_free_block of fake_free_list_tail should always exist")
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the tail in the given order."""
        if not blocks:
            return
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        if last is None:
            raise AssertionError("prev_free_block of fake_free_list_tail should always exist")
        self._link_between(blocks, last, tail)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front in the given order (evicted first, before the
        blocks already queued)."""
        if not blocks:
            return
        head = self.fake_free_list_head
        first = head.next_free_block
        if first is None:
            raise AssertionError("next_free_block of fake_free_list_head should always exist")
        self._link_between(blocks, head, first)

    def _link_between(
        self, blocks: list[KVCacheBlock], prev: KVCacheBlock, after: KVCacheBlock
    ) -> None:
        """Link ``blocks``, in order, between the adjacent nodes ``prev`` and ``after``."""
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = after
        after.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, front first (O(n); for tests and debugging)."""
        block = self.fake_free_list_head.next_free_block
        if block is None:
            raise RuntimeError("next_free_block of fake_free_list_head should always exist")
        out: list[KVCacheBlock] = []
        while block.next_free_block is not None:
            out.append(block)
            block = block.next_free_block
        return out


def null_head_len(blocks: Sequence[KVCacheBlock]) -> int:
    """Leading null blocks of a block table (a sliding window's skipped prefix)."""
    if not blocks or not blocks[0].is_null:
        return 0
    # Binary search for the first real block, then check that the run is all null: tables
    # whose nulls are not one leading run fall back to a scan.
    lo, hi = 1, len(blocks)
    while lo < hi:
        mid = (lo + hi) // 2
        if blocks[mid].is_null:
            lo = mid + 1
        else:
            hi = mid
    if all(b.is_null for b in blocks[:lo]):
        return lo
    return next((i for i, b in enumerate(blocks) if not b.is_null), len(blocks))


def trim_null_head(blocks: Sequence[KVCacheBlock]) -> Sequence[KVCacheBlock]:
    """``blocks`` without its leading null blocks (``blocks`` itself when it has none)."""
    head = null_head_len(blocks)
    return blocks[head:] if head else blocks
