"""Prefix hits ending inside a page of append-only K/V (full attention), for partial hash hits.

Hybrid Mamba models whose state pages span many hash blocks take hits at hash-block boundaries
(see vllm.v1.core.hybrid_cache_lookup). Full attention then has to serve a hit ending inside
one of its pages: the page holding the prompt's last reusable hash block is also keyed by that
shorter prefix, and a request hitting it copies the page (copy-on-write) before appending its
own K/V behind the shared tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_hashing import BlockHashList, BlockHashListWithBlockSize
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.core.single_type_manager_base import SingleTypeKVCacheManager
from vllm.v1.request import Request


def find_partial_page_hit(
    block_hashes: BlockHashList,
    max_length: int,
    kv_cache_group_ids: list[int],
    block_pool: BlockPool,
    block_size: int,
    hash_block_size: int,
    drop_eagle_block: bool,
) -> tuple[tuple[list[KVCacheBlock], ...], int]:
    """The cached full pages from the start, then the longest cached prefix ending inside the
    next page (``block_hashes`` per ``hash_block_size`` tokens; lengths in tokens). EAGLE's
    drop removes one hash block: the page still covers the shorter prefix."""
    assert isinstance(block_hashes, Sequence)
    computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
    pages = BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)  # type: ignore[arg-type]
    for page_hash in islice(pages, max_length // block_size):
        cached = block_pool.get_cached_block(page_hash, kv_cache_group_ids)
        if cached is None:
            break
        for blocks, block in zip(computed, cached, strict=True):
            blocks.append(block)
    hit_length = len(computed[0]) * block_size
    scale = block_size // hash_block_size
    first = len(computed[0]) * scale
    last = min(first + scale - 1, max_length // hash_block_size, len(block_hashes))
    for unit in range(last - 1, first - 1, -1):
        cached = block_pool.get_cached_block(block_hashes[unit], kv_cache_group_ids)
        if cached is None:
            continue
        for blocks, block in zip(computed, cached, strict=True):
            blocks.append(block)
        hit_length = (unit + 1) * hash_block_size
        break
    if drop_eagle_block and hit_length > 0:
        hit_length -= hash_block_size
    for blocks in computed:
        del blocks[cdiv(hit_length, block_size) :]
    return computed, hit_length


class PartialPageHits(SingleTypeKVCacheManager):
    """Publishing and copy-on-write of pages hit at a position inside them (mixed into
    append-only attention managers; inactive unless the coordinator lowered
    ``cache_hit_alignment_tokens`` below the page)."""

    def _partial_hits_on(self) -> bool:
        return self.cache_hit_alignment_tokens < self.block_size

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """One more page for the private copy of a hit ending inside its page."""
        num_blocks = super().get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end,
        )
        partial = bool(new_computed_blocks) and num_local_computed_tokens % self.block_size > 0
        return num_blocks + int(partial or request_id in self._partial_hit_reqs)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        copied: list[KVCacheBlock] = []
        partial = self._partial_hit_reqs.pop(request_id, None)
        if partial is not None:
            index, source = partial
            blocks = self.req_to_blocks[request_id]
            assert blocks[index] is source and not source.is_null
            copy = self.block_pool.get_new_blocks(1)[0]
            blocks[index] = copy
            # The hit's reference on ``source`` and an extra one on ``copy`` belong to the copy
            # until its caller releases them (take_pending_cow_copies).
            copy.ref_cnt += 1
            self._pending_cow_copies.append((source, copy))
            copied.append(copy)
        return copied + super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int] = (),
        alignment_tokens: int | None = None,
    ) -> None:
        super().cache_blocks(
            request,
            num_tokens,
            retention_interval,
            replay_boundaries=replay_boundaries,
            alignment_tokens=alignment_tokens,
        )
        if self._partial_hits_on() and self.kv_cache_spec.prefix_cacheable:
            self._publish_prompt_tail(request, num_tokens)

    def _publish_prompt_tail(self, request: Request, num_tokens: int) -> None:
        """Key the page holding the prompt's last reusable hash block by that prefix when it
        ends inside the page (a replay matches at most the prompt less one token; EAGLE reads
        the whole prompt, then drops a hash block)."""
        hash_block_size = self.block_pool.hash_block_size
        limit = request.num_prompt_tokens - (0 if self.use_eagle else 1)
        position = min(limit // hash_block_size, len(request.block_hashes)) * hash_block_size
        if position == 0 or position > num_tokens or position % self.block_size == 0:
            return
        blocks = self.req_to_blocks.get(request.request_id, [])
        index = position // self.block_size
        if index < len(blocks):
            self.block_pool.cache_partial_block(
                request,
                blocks[index],
                position,
                self.kv_cache_group_id,
                self.block_size,
            )
