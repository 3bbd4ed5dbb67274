"""Prefix-cache lookup table: cached blocks by ``BlockHashWithGroupId`` (upstream's
``BlockHashToBlockMap``, re-exported by :mod:`vllm.v1.core.block_pool`)."""

from __future__ import annotations

from vllm.v1.core.block_hashing import BlockHashWithGroupId
from vllm.v1.core.kv_cache_block import KVCacheBlock

__all__ = ["BlockHashToBlockMap"]


class BlockHashToBlockMap:
    """Cached full blocks by ``BlockHashWithGroupId``.

    Identical blocks are not de-duplicated (a block id, once in a block table, never changes), so
    one key may map to several blocks. The value is the block itself in the common single-block
    case and a ``{block_id: block}`` dict once a key had duplicates (kept until the key empties),
    which keeps the map to one object per key for the garbage collector.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """A block cached under ``key`` (the first inserted when there are several)."""
        blocks = self._cache.get(key)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def contain(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        """True when block ``block_id`` is cached under ``key``."""
        blocks = self._cache.get(key)
        if blocks is None:
            return False
        if isinstance(blocks, KVCacheBlock):
            return blocks.block_id == block_id
        return block_id in blocks

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        """Cache ``block`` under ``key``."""
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, KVCacheBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove and return block ``block_id`` from under ``key`` (None if it is not there)."""
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id != block_id:
                self._cache[key] = blocks  # another block's entry: put it back
                return None
            return blocks
        block = blocks.pop(block_id, None)
        if blocks:
            self._cache[key] = blocks
        return block

    def __len__(self) -> int:
        return len(self._cache)
