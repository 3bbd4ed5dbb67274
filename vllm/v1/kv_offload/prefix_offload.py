"""The device prefix cache and an offload tier, keyed by the same block hashes.

The offload key of a block is the request block hasher's hash of that block plus its KV-cache
group (:func:`request_offload_keys`); a chained hash names the whole prefix up to the block, so a
page evicted from the device :class:`~vllm.v1.core.block_pool.BlockPool` is found again in any
tier (CPU, file system, Mooncake) by a later request with the same prefix, in any engine
instance that hashes with the same function and ``PYTHONHASHSEED``.

:class:`PrefixCacheOffloader` is the scheduler-side glue: when full blocks enter the device
prefix cache it plans their store (device block ids -> tier rows); when a request's prefix runs
past the device hits, it looks the following blocks up in the tier, allocates device blocks and
plans the load; once the load is done the blocks enter the device prefix cache again. Running
the planned transfers is the worker's job (``OffloadingWorker.transfer_async(job, (src, dst))``).
Offloaded blocks here are device blocks (``block_size_factor`` 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.request import Request

__all__ = ["OffloadTransfer", "PrefixCacheOffloader", "request_offload_keys"]


def request_offload_keys(
    request: Request, group_idx: int, hash_block_size_factor: int = 1, start: int = 0
) -> list[OffloadKey]:
    """The offload keys of ``request``'s full offloaded blocks from block ``start`` on.

    An offloaded block spans ``hash_block_size_factor`` entries of ``request.block_hashes``
    (offloaded block size / hash block size, in tokens); it is keyed by the hash of its last
    entry, which covers everything before it.
    """
    if hash_block_size_factor < 1:
        raise ValueError(
            f"hash_block_size_factor: expected a positive int, got {hash_block_size_factor}"
        )
    if start < 0:
        raise ValueError(f"start: expected a block index >= 0, got {start}")
    hashes = request.block_hashes
    first = (start + 1) * hash_block_size_factor - 1
    return [
        make_offload_key(hashes[i], group_idx)
        for i in range(first, len(hashes), hash_block_size_factor)
    ]


@dataclass
class OffloadTransfer:
    """One planned copy: ``keys[i]`` is request block ``start + i`` (tokens
    ``[(start + i) * block_size, ...)``), held by device block ``blocks[i]``; ``src`` -> ``dst``
    is what the worker copies."""

    keys: list[OffloadKey]
    blocks: list[KVCacheBlock]
    start: int
    src: LoadStoreSpec
    dst: LoadStoreSpec

    @property
    def spec(self) -> tuple[LoadStoreSpec, LoadStoreSpec]:
        """The ``(src, dst)`` pair ``OffloadingWorker.transfer_async`` takes."""
        return self.src, self.dst


def _context(request: Request) -> ReqContext:
    return ReqContext(req_id=request.request_id, kv_transfer_params=request.kv_transfer_params)


class PrefixCacheOffloader:
    """Keeps the full blocks of one KV-cache group of ``block_pool`` in ``manager``'s tier and
    brings them back on later prefix hits; ``block_size`` in tokens (the group's, which must be
    the pool's hash block size)."""

    def __init__(
        self,
        block_pool: BlockPool,
        manager: OffloadingManager,
        block_size: int,
        kv_cache_group_id: int = 0,
    ) -> None:
        if block_size != block_pool.hash_block_size:
            raise ValueError(
                f"block_size: expected the pool's hash block size "
                f"{block_pool.hash_block_size}, got {block_size}"
            )
        self.block_pool = block_pool
        self.manager = manager
        self.block_size = block_size
        self.group_id = kv_cache_group_id

    def plan_store(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> OffloadTransfer | None:
        """The store of ``blocks[num_cached_blocks:num_full_blocks]`` (the arguments of the
        ``cache_full_blocks`` call that just cached them), or None when the tier holds them all
        already or has no room. Null blocks are skipped."""
        keys = request_offload_keys(request, self.group_id, start=num_cached_blocks)
        span = num_full_blocks - num_cached_blocks
        if len(keys) < span:
            raise ValueError(
                f"num_full_blocks: expected at most {num_cached_blocks + len(keys)} hashed "
                f"blocks of request {request.request_id}, got {num_full_blocks}"
            )
        by_key = {
            key: block
            for key, block in zip(
                keys[:span], blocks[num_cached_blocks:num_full_blocks], strict=True
            )
            if not block.is_null
        }
        if not by_key:
            return None
        out = self.manager.prepare_store(list(by_key), _context(request))
        if out is None or not out.keys_to_store:
            return None
        chosen = [by_key[key] for key in out.keys_to_store]
        src = GPULoadStoreSpec([b.block_id for b in chosen], [len(chosen)], [num_cached_blocks])
        return OffloadTransfer(out.keys_to_store, chosen, num_cached_blocks, src, out.store_spec)

    def complete_store(
        self, request: Request, transfer: OffloadTransfer, success: bool = True
    ) -> None:
        """Report a finished store job: its keys become loadable (or are dropped on failure)."""
        self.manager.complete_store(transfer.keys, _context(request), success=success)

    def touch(self, request: Request, num_hit_blocks: int) -> None:
        """Mark the request's first ``num_hit_blocks`` blocks (device prefix hits) recently used
        in the tier too, so its eviction order follows the device's."""
        keys = request_offload_keys(request, self.group_id)[:num_hit_blocks]
        if keys:
            self.manager.touch(keys, _context(request))

    def plan_load(self, request: Request, num_computed_blocks: int) -> OffloadTransfer | None:
        """The load of the consecutive blocks after the request's first ``num_computed_blocks``
        (its device prefix hits) that the tier holds, as many as the pool has free blocks for;
        the device blocks are allocated here. None when there is nothing to load now, also when
        the tier asks to be asked again (it is fetching blocks from a slower tier: every block up
        to the first miss is looked up, so all of those fetches start in this call)."""
        keys = request_offload_keys(request, self.group_id, start=num_computed_blocks)
        context = _context(request)
        hits = 0
        deferred = False
        for key in keys:
            found = self.manager.lookup(key, context)
            if found is LookupResult.MISS:
                break
            deferred = deferred or found is not LookupResult.HIT
            hits += 1
        hits = min(hits, self.block_pool.get_num_free_blocks())
        if deferred or hits == 0:
            return None
        keys = keys[:hits]
        blocks = self.block_pool.get_new_blocks(hits)
        src = self.manager.prepare_load(keys, context)
        dst = GPULoadStoreSpec([b.block_id for b in blocks], [hits], [num_computed_blocks])
        return OffloadTransfer(keys, blocks, num_computed_blocks, src, dst)

    def complete_load(
        self, request: Request, transfer: OffloadTransfer, success: bool = True
    ) -> None:
        """Report a finished load job: the tier unpins the keys; on success the loaded blocks
        enter the device prefix cache (the request holds them), on failure they are freed."""
        self.manager.complete_load(transfer.keys, _context(request))
        if not success:
            self.block_pool.free_blocks(transfer.blocks)
            return
        # cache_full_blocks indexes blocks from the request's first block; only the loaded
        # range is read, the null block fills the places before it.
        padded = [self.block_pool.null_block] * transfer.start + transfer.blocks
        self.block_pool.cache_full_blocks(
            request,
            padded,
            transfer.start,
            transfer.start + len(transfer.blocks),
            self.block_size,
            self.group_id,
        )
