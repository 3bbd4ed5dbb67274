"""The device page pool (upstream's ``BlockPool`` and ``BlockHashToBlockMap``).

The pool owns ``num_gpu_blocks`` :class:`KVCacheBlock` s. Block 0 is the *null block*, a
placeholder that block tables use for skipped positions (sliding window, Mamba); it is never
allocated, cached or freed. Every other block is either in use (``ref_cnt`` > 0) or in the free
queue, in eviction order. With prefix caching a free block may still carry its hash and sit in
the hash map: a later request with the same prefix can take it back (``touch``) until it is
handed out for new data (``get_new_blocks`` evicts it then, emitting ``BlockRemoved``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.block_hash_map import BlockHashToBlockMap
from vllm.v1.core.block_hashing import (
    BlockHash,
    BlockHashList,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    ExternalBlockHash,
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.core.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock, OwningPool
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.request import Request

__all__ = ["BlockHashToBlockMap", "BlockPool", "PartialKeyError"]

logger = logging.getLogger(__name__)


class PartialKeyError(ValueError, AssertionError):
    """A partial prefix key cannot be placed as asked (an AssertionError too: v0.33 asserts)."""


class BlockPool:
    """Allocates, frees and caches the device KV-cache blocks.

    Args:
        num_gpu_blocks: pages in the pool, the null block included.
        enable_caching: keep full blocks findable by hash after they are freed.
        hash_block_size: tokens per entry of ``request.block_hashes``; a group's block size is
            a multiple of it (groups with larger pages hash concatenations of entries).
        enable_kv_cache_events: queue ``BlockStored`` / ``BlockRemoved`` /
            ``AllBlocksCleared`` for :meth:`take_events`.
        metrics_collector: optional residency sampler, told of allocations, hits and evictions.
        medium: the storage medium KV events report (a host-resident pool passes
            ``MEDIUM_CPU``).
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: KVCacheMetricsCollector | None = None,
        num_hash_lookahead_tokens: int = 0,
        medium: str = MEDIUM_GPU,
    ) -> None:
        if not isinstance(medium, str) or not medium:
            raise ValueError(f"medium: expected a non-empty medium name, got {medium!r}")
        if isinstance(num_gpu_blocks, bool) or not isinstance(num_gpu_blocks, int):
            raise ValueError(f"num_gpu_blocks: expected a positive int, got {num_gpu_blocks!r}")
        if num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks: expected a positive int, got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        # Tokens after each block that its hash also covers (the requests' hasher setting):
        # a prefill checkpoint must leave them uncomputed so its hash is known.
        self.num_hash_lookahead_tokens = int(num_hash_lookahead_tokens)
        self.blocks: list[KVCacheBlock] = [
            KVCacheBlock(i, pool=self) for i in range(num_gpu_blocks)
        ]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # block id -> the keys a block is cached under besides its own ``block_hash``: an
        # append-only page keyed at a later position also serves shorter prefixes inside it.
        self.cached_block_hashes_by_block: dict[int, set[BlockHashWithGroupId]] = {}
        # Block 0 is taken out for good; its ref_cnt is not maintained.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Pages out of circulation for good without a request holding them (attention sinks).
        self.num_reserved_blocks = 0
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        self.metrics_collector = metrics_collector
        self.medium = medium
        # block id -> callback of a block released by unpin_blocks, told when the block is
        # handed out again (or the cache is reset), so its reader stops reading it.
        self._reuse_watchers: dict[int, Callable[[KVCacheBlock], None]] = {}

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block of ``block_hash`` in each group, or None if any group misses."""
        lookup = self.cached_block_hash_to_block.get_one_block
        if len(kv_cache_group_ids) == 1:  # the common case, without the loop
            block = lookup(make_block_hash_with_group_id(block_hash, kv_cache_group_ids[0]))
            return None if block is None else [block]
        found: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            block = lookup(make_block_hash_with_group_id(block_hash, group_id))
            if block is None:
                return None
            found.append(block)
        return found

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` (just filled) under the request's
        block hashes in group ``kv_cache_group_id``.

        Null blocks, and blocks whose ``block_mask`` entry (aligned with that slice) is False,
        are skipped: they can never serve a hit. ``block_size`` is the group's block size in
        tokens, a multiple of ``hash_block_size``.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        if block_mask is not None and len(block_mask) != len(new_blocks):
            raise ValueError(
                f"block_mask: expected {len(new_blocks)} entries, got {len(block_mask)}"
            )
        block_hashes = self._block_hashes(request, block_size)
        if len(block_hashes) < num_full_blocks:
            raise AssertionError(
                f"request {request.request_id}: expected >= {num_full_blocks} block hashes, "
                f"got {len(block_hashes)}"
            )
        new_hashes = block_hashes[num_cached_blocks:num_full_blocks]
        # The group-id suffix of every key of this call, built once (hot loop below).
        suffix = make_block_hash_with_group_id(BlockHash(b""), kv_cache_group_id)
        insert = self.cached_block_hash_to_block.insert
        stored: list[int] = []  # indices into new_blocks that were cached
        for i, block in enumerate(new_blocks):
            if block.is_null or (block_mask is not None and not block_mask[i]):
                continue
            key = BlockHashWithGroupId(new_hashes[i] + suffix)
            if block.block_hash is not None:
                # A page keyed at a position inside it (partial hit) is now full.
                self._maybe_evict_cached_block(block)
            block.set_block_hash(key, (num_cached_blocks + i + 1) * block_size)
            insert(key, block)
            stored.append(i)
        if self.enable_kv_cache_events:
            parent: ExternalBlockHash | None = None
            if num_cached_blocks > 0:
                parent = maybe_convert_block_hash(block_hashes[num_cached_blocks - 1])
            self._queue_stored_event(
                request,
                parent,
                [(num_cached_blocks + i, new_hashes[i]) for i in stored],
                num_cached_blocks * block_size,
                num_full_blocks * block_size,
                block_size,
                kv_cache_group_id,
            )

    def emit_cached_block_events(
        self, request: Request, num_cached_blocks: int, block_size: int, kv_cache_group_id: int
    ) -> None:
        """Queue a ``BlockStored`` for the request's first ``num_cached_blocks`` blocks of
        ``block_size`` tokens, reused from the prefix cache in group ``kv_cache_group_id``, so
        that consumers tracking the cache (a router) learn of a hit; the pool is not changed.
        Nothing without events or hit blocks."""
        if not self.enable_kv_cache_events or num_cached_blocks <= 0:
            return
        block_hashes = self._block_hashes(request, block_size)
        if len(block_hashes) < num_cached_blocks:
            raise ValueError(
                f"num_cached_blocks: expected at most {len(block_hashes)} (the request's block "
                f"hashes), got {num_cached_blocks}"
            )
        hashes = [(i, block_hashes[i]) for i in range(num_cached_blocks)]
        # A hit starts at the first block: no parent.
        self._queue_stored_event(
            request, None, hashes, 0, num_cached_blocks * block_size, block_size, kv_cache_group_id
        )

    def _block_hashes(self, request: Request, block_size: int) -> BlockHashList:
        """The request's block hashes at ``block_size`` tokens per block."""
        if block_size == self.hash_block_size:
            return request.block_hashes  # type: ignore[return-value]
        return BlockHashListWithBlockSize(
            request.block_hashes,  # type: ignore[arg-type]
            self.hash_block_size,
            block_size,
        )

    def _queue_stored_event(
        self,
        request: Request,
        parent: ExternalBlockHash | None,
        hashes: list[tuple[int, BlockHash]],
        start_token: int,
        end_token: int,
        block_size: int,
        group_id: int,
    ) -> None:
        """Queue one ``BlockStored``: ``hashes`` are (block index, hash) of the blocks stored,
        each with its extra keys; the token ids are the range [start_token, end_token)
        (tokens), skipped blocks included."""
        lookahead = self.num_hash_lookahead_tokens
        extra_keys: list[tuple[Any, ...] | None] = []
        lookahead_token_ids: list[list[int]] | None = [] if lookahead else None
        mm_idx = 0
        for index, _ in hashes:
            start = index * block_size
            end = start + block_size
            # An event's extra keys cover the tokens its block's hash covers.
            if lookahead_token_ids is not None:
                keys, mm_idx = generate_lookahead_block_hash_extra_keys(
                    request, start, end, end + lookahead, mm_idx
                )
                lookahead_token_ids.append(request.all_token_ids[end : end + lookahead])
            else:
                keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            extra_keys.append(keys)
        lora = request.lora_request
        self.kv_event_queue.append(
            BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for _, h in hashes],
                parent_block_hash=parent,
                token_ids=request.all_token_ids[start_token:end_token],
                block_size=block_size,
                lora_id=None if lora is None else lora.adapter_id,
                medium=self.medium,
                lora_name=None if lora is None else lora.name,
                extra_keys=to_event_extra_keys(extra_keys),
                group_idx=group_id,
                session_id=request.session_id,
                lookahead_token_ids=lookahead_token_ids,
            )
        )

    def cache_partial_block(
        self,
        request: Request,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> BlockHashWithGroupId | None:
        """Make ``block`` findable by the request's prefix hash at ``num_tokens`` tokens (a
        positive multiple of ``hash_block_size``, possibly inside the block); ``block_size``
        (tokens, the owning group's page) must be a multiple of ``hash_block_size``.

        A key covering fewer tokens than ``block``'s current one adds a key (an append-only
        K/V page serves every prefix it holds; see ``cached_block_hashes_by_block``); a longer
        one replaces every key the block had. ``replace_existing_hashes`` drops them all first
        (the page's contents changed: a state page holds one state). Returns the key, or None
        for the null page."""
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, int)
            or block_size <= 0
            or block_size % self.hash_block_size
        ):
            raise PartialKeyError(
                f"block_size: expected a positive multiple of {self.hash_block_size} "
                f"(tokens), got {block_size!r}"
            )
        if num_tokens <= 0 or num_tokens % self.hash_block_size:
            raise PartialKeyError(
                f"num_tokens: expected a positive multiple of {self.hash_block_size}, "
                f"got {num_tokens}"
            )
        num_hashes = num_tokens // self.hash_block_size
        if num_hashes > len(request.block_hashes):
            raise PartialKeyError(
                f"num_tokens: expected at most {len(request.block_hashes) * self.hash_block_size}"
                f" (the request's hashed tokens), got {num_tokens}"
            )
        if block.is_null:
            return None
        block_hash = request.block_hashes[num_hashes - 1]
        key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
        cached = self.cached_block_hash_to_block.contain(key, block.block_id)
        if block.block_hash is not None and (
            replace_existing_hashes
            or (not cached and (block.block_hash_num_tokens or 0) < num_tokens)
        ):
            self._maybe_evict_cached_block(block)
            cached = False
        if cached:
            return key
        if block.block_hash is None:
            block.set_block_hash(key, num_tokens)
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
        self.cached_block_hash_to_block.insert(key, block)
        if self.enable_kv_cache_events:
            parent = (
                maybe_convert_block_hash(request.block_hashes[num_hashes - 2])
                if num_hashes > 1
                else None
            )
            start = num_tokens - self.hash_block_size
            self._queue_stored_event(
                request,
                parent,
                [(num_hashes - 1, block_hash)],
                start,
                num_tokens,
                self.hash_block_size,
                kv_cache_group_id,
            )
        return key

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Re-point every prefix-cache key of ``src_block`` to ``dst_block`` (unkeyed), which
        gets a copy of its contents while ``src_block``'s owner keeps writing into it. No
        events: the cached content stays the same."""
        key = src_block.block_hash
        if key is None:
            return
        if dst_block.block_hash is not None:
            raise ValueError(f"dst_block: expected a block without a hash, got {dst_block!r}")
        num_tokens = src_block.block_hash_num_tokens
        extra_keys = self.cached_block_hashes_by_block.pop(src_block.block_id, set())
        for moved in (key, *extra_keys):
            self.cached_block_hash_to_block.pop(moved, src_block.block_id)
            self.cached_block_hash_to_block.insert(moved, dst_block)
        src_block.reset_hash()
        dst_block.set_block_hash(key, num_tokens)
        if extra_keys:
            self.cached_block_hashes_by_block[dst_block.block_id] = extra_keys

    def reserve_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` pages out of the pool for good, for data every request shares
        (attention-sink tokens). No request holds them, so :meth:`reset_prefix_cache` does not
        count them as in use. ValueError when too few are free."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks: expected a non-negative int, got {num_blocks!r}")
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"num_blocks: expected at most the {self.free_block_queue.num_free_blocks} free "
                f"pages, got {num_blocks}"
            )
        reserved = self.free_block_queue.popleft_n(num_blocks)
        for block in reserved:
            if block.block_hash is not None:
                self._maybe_evict_cached_block(block)
        self.num_reserved_blocks += num_blocks
        return reserved

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue (ref_cnt 1 each),
        evicting any cached hash they still carry. ValueError when too few are free."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        taken = self.free_block_queue.popleft_n(num_blocks)
        if self._reuse_watchers:
            self._notify_reuse(taken)
        collector = self.metrics_collector
        evict = self._maybe_evict_cached_block if self.enable_caching else None
        for block in taken:
            if block.ref_cnt != 0:
                raise AssertionError(
                    f"block {block.block_id}: expected ref_cnt 0 in the free queue, "
                    f"got {block.ref_cnt}"
                )
            if evict is not None and (block.block_hash is not None or collector is not None):
                evict(block)
            block.ref_cnt = 1
            if collector is not None:
                collector.on_block_allocated(block)
        return taken

    def _notify_reuse(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            watcher = self._reuse_watchers.pop(block.block_id, None)
            if watcher is not None:
                watcher(block)

    def unpin_blocks(
        self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[[KVCacheBlock], None]
    ) -> None:
        """Drop a reference on each of ``blocks`` while keeping their contents readable: those
        no longer used join the tail of the free queue (reused last, caching on or off) and
        count as free. ``on_reuse(block)`` is called when :meth:`get_new_blocks` hands one out
        again or the prefix cache is reset; :meth:`touch` just takes it back."""
        blocks = list(blocks)
        num_unpins = Counter(block.block_id for block in blocks)
        for block in blocks:
            if block.is_null or block.ref_cnt < num_unpins[block.block_id]:
                raise ValueError(
                    f"blocks: expected non-null blocks holding a reference per listing, got "
                    f"block {block.block_id} (ref_cnt {block.ref_cnt}, listed "
                    f"{num_unpins[block.block_id]}x{', null' if block.is_null else ''})"
                )
        released: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            self._reuse_watchers[block.block_id] = on_reuse
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop every prefix-cache key of ``block``; True if it had any."""
        if self.metrics_collector is not None:
            self.metrics_collector.on_block_evicted(block)
        key = block.block_hash
        if key is None:
            return False
        keys = [key, *self.cached_block_hashes_by_block.pop(block.block_id, ())]
        pop = self.cached_block_hash_to_block.pop
        removed = [k for k in keys if pop(k, block.block_id) is not None]
        block.reset_hash()
        if self.enable_kv_cache_events:
            for k in removed:
                self.kv_event_queue.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(get_block_hash(k))],
                        medium=self.medium,
                        group_idx=get_group_id(k),
                    )
                )
        return bool(removed)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on each of ``blocks`` (a prefix hit), pulling free ones out of the
        free queue so they cannot be evicted while used. The null page is never pooled: it is
        left alone."""
        remove = self.free_block_queue.remove
        collector = self.metrics_collector
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1
            if collector is not None:
                collector.on_block_accessed(block)

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        """True when ``block`` may be changed in place by its one owner: a real page held once
        and not published under a hash."""
        return not block.is_null and block.ref_cnt == 1 and block.block_hash is None

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; those no longer used go back to the free queue in
        the given order (the first is evicted first): cached ones to its tail (LRU eviction),
        the others, which no lookup can match, to its head (reused first, while still warm in
        device caches). The null page is left alone; pages of another pool are freed there."""
        cached: list[KVCacheBlock] = []
        uncached: list[KVCacheBlock] = []
        other_pools: dict[OwningPool, list[KVCacheBlock]] = {}
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.pool is not None and block.pool is not self:
                other_pools.setdefault(block.pool, []).append(block)
                continue
            block.ref_cnt -= 1
            # A block listed twice is released once, when its count reaches 0.
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    uncached.append(block)
                else:
                    cached.append(block)
        self.free_block_queue.prepend_n(uncached)
        self.free_block_queue.append_n(cached)
        for pool, blocks in other_pools.items():
            pool.free_blocks(blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop the given blocks from the prefix cache (used or not; used ones stay used)."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_gpu_blocks:
                raise AssertionError(
                    f"block_ids: expected ids in [0, {self.num_gpu_blocks}), got {block_id} "
                    "(a KV connector reported a block the scheduler never allocated)"
                )
            self._maybe_evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, if no block is in use (False, with a warning, if some
        are). The null page and reserved pages are not in use."""
        num_used = self.num_gpu_blocks - self.get_num_free_blocks() - 1 - self.num_reserved_blocks
        if num_used != 0:
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_used,
            )
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        for block in self.blocks:
            block.reset_hash()
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        logger.info("Successfully reset prefix cache")
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (cached-but-free ones included)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the non-null blocks in use, in [0, 1]."""
        usable = self.num_gpu_blocks - 1
        if usable == 0:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / usable

    def take_events(self) -> list[KVCacheEvent]:
        """The queued events, oldest first; the queue is emptied."""
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
