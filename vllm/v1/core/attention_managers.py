"""Single-type managers for attention layers whose pages hold per-token K/V: full attention
(plus attention sinks and encoder-decoder cross-attention), sliding window and chunked local.

Full attention keeps every page until the request ends and hits on any cached prefix. Sliding
window only needs the last ``sliding_window - 1`` tokens before the next one, so a prefix hit
needs just the pages of that tail (earlier ones become null pages) and pages leaving the window
return to the pool while the request runs. Chunked local attention attends within aligned chunks
of ``attention_chunk_size`` tokens: pages of finished chunks are never read again.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import Any, ClassVar

from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_hashing import BlockHashList, resolve_block_hashes
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.core.partial_page_hits import PartialPageHits, find_partial_page_hit
from vllm.v1.core.single_type_manager_base import (
    SingleTypeKVCacheManager,
    expect_no_context_parallel,
    expect_spec,
    trim_to_alignment,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request


def _empty_hit(num_groups: int) -> tuple[list[KVCacheBlock], ...]:
    return tuple([] for _ in range(num_groups))


def _drop_last(computed_blocks: tuple[list[KVCacheBlock], ...]) -> None:
    """EAGLE recomputes the last hit page to get its hidden states: drop it."""
    if computed_blocks[0]:
        for blocks in computed_blocks:
            blocks.pop()


class FullAttentionManager(PartialPageHits, SingleTypeKVCacheManager):
    """Every page stays with the request until it finishes."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Leading pages found in the cache, left to right: a miss ends the prefix because the
        hash of a page chains the hashes of all pages before it. An alignment finer than the
        page (partial hash hits) means ``block_hashes`` are per ``alignment_tokens`` tokens: the
        hit may then end inside the page after the full ones, and EAGLE drops one hash block."""
        expect_spec(kv_cache_spec, (FullAttentionSpec, ChunkedLocalAttentionSpec), cls.__name__)
        block_size = kv_cache_spec.block_size * dcp_world_size
        if alignment_tokens < block_size and block_size % alignment_tokens == 0:
            return find_partial_page_hit(
                block_hashes,
                max_length,
                kv_cache_group_ids,
                block_pool,
                block_size,
                alignment_tokens,
                drop_eagle_block,
            )
        computed = _empty_hit(len(kv_cache_group_ids))
        for block_hash in islice(block_hashes, max_length // block_size):
            cached = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if cached is None:
                break
            for blocks, block in zip(computed, cached, strict=True):
                blocks.append(block)
        if drop_eagle_block:
            _drop_last(computed)
        trim_to_alignment(computed, block_size, alignment_tokens)
        return computed, len(computed[0]) * block_size

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading pages of ``running_request_id`` referenced by every request holding pages."""
        num_requests = len(self.req_to_blocks)
        count = 0
        for block in self.req_to_blocks[running_request_id]:
            if block.ref_cnt != num_requests:
                break
            count += 1
        return count


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention whose ``sink_len`` sink tokens live in pages reserved once, up front, for
    all requests (``sink_blocks``): they are taken out of the free queue for good."""

    def __init__(
        self,
        kv_cache_spec: SinkFullAttentionSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id, **kwargs)
        sink_len = kv_cache_spec.sink_len
        if not sink_len or sink_len % self.block_size:
            raise ValueError(
                f"sink_len: expected a positive multiple of block_size={self.block_size} "
                f"(tokens), got {sink_len}"
            )
        self.sink_blocks = block_pool.reserve_blocks(sink_len // self.block_size)


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Encoder-decoder cross-attention: the encoder's K/V of one request, allocated once from
    the encoder token count. Encoder outputs are unique per request, so nothing is shared or
    published in the prefix cache; engines run these models with prefix caching disabled."""

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        if new_computed_blocks:
            raise ValueError(
                "new_computed_blocks: cross-attention expected no prefix hits, got "
                f"{len(new_computed_blocks)} pages"
            )

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Connector tokens are decoder tokens; the encoder's pages come with the first step."""

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int] = (),
        alignment_tokens: int | None = None,
    ) -> None:
        raise ValueError(
            "enable_caching: cross-attention pages are never published, expected prefix "
            "caching disabled, got a cache_blocks call"
        )

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        expect_spec(kv_cache_spec, (CrossAttentionSpec,), cls.__name__)
        raise ValueError(
            "enable_caching: cross-attention has no reusable prefix, expected prefix caching "
            "disabled, got a prefix lookup"
        )


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Attention over the last ``sliding_window`` tokens (the new one included)."""

    def __init__(self, kv_cache_spec: SlidingWindowSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix whose last ``cdiv(sliding_window - 1, block_size)`` pages are all
        cached (one more with EAGLE, which then drops it), searched from the right; pages
        before that tail are null. A prefix shorter than the tail hits when all its pages are
        cached."""
        expect_spec(kv_cache_spec, (SlidingWindowSpec,), cls.__name__)
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        expect_no_context_parallel(dcp_world_size, pcp_world_size, "sliding window")
        block_size = kv_cache_spec.block_size
        # Finer hashes (one per hash_block_size tokens) are seen one per page.
        block_hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        num_tail = cdiv(kv_cache_spec.sliding_window - 1, block_size) + int(drop_eagle_block)
        num_blocks = max_length // block_size
        computed = tuple(
            [block_pool.null_block] * num_blocks for _ in range(len(kv_cache_group_ids))
        )
        run = 0  # contiguous cached pages ending at the current end candidate
        found = False
        for i in range(num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                run = 0
                continue
            if run == 0 and block_size != alignment_tokens:
                # A hit may only end where the prefix (after the EAGLE drop) is aligned.
                end = i if drop_eagle_block else i + 1
                if end * block_size % alignment_tokens:
                    continue
            for blocks, block in zip(computed, cached, strict=True):
                blocks[i] = block
            run += 1
            if run >= num_tail:
                for blocks in computed:
                    del blocks[i + run :]
                found = True
                break
        if not found:
            # Only the run reaching page 0 is usable: every page of it is cached.
            for blocks in computed:
                del blocks[run:]
            trim_to_alignment(computed, block_size, alignment_tokens)
        if drop_eagle_block and computed[0]:
            _drop_last(computed)
            trim_to_alignment(computed, block_size, alignment_tokens)
        return computed, len(computed[0]) * block_size

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        """A hit ending on a boundary reads only the window's tail pages before it (with
        EAGLE one more page, after it): the other pages of each segment are not published.
        ``final_segment_end_block`` (exclusive): the request's last, possibly incomplete,
        segment ends there, and without EAGLE its tail is reachable too. Alignments finer than
        a page cannot be told apart per page: every page is reachable then."""
        expect_spec(kv_cache_spec, (SlidingWindowSpec,), cls.__name__)
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        block_size = kv_cache_spec.block_size * dcp_world_size
        if alignment_tokens is None or alignment_tokens % block_size:
            return None
        need = cdiv(kv_cache_spec.sliding_window - 1, block_size) + int(use_eagle)
        # With EAGLE the run ends one page past the boundary.
        shift = int(use_eagle)
        mask = [False] * (end_block - start_block)

        def keep(first: int, last: int) -> None:
            for i in range(max(start_block, first), min(end_block, last)):
                mask[i - start_block] = True

        segment_tokens = alignment_tokens if retention_interval is None else retention_interval
        if segment_tokens:
            per_segment = segment_tokens // block_size
            if need >= per_segment:
                return None
            for i in range(max(start_block, shift), end_block):
                if (i - shift) % per_segment >= per_segment - need:
                    mask[i - start_block] = True
            final_size = (final_segment_end_block or 0) % per_segment
            if final_segment_end_block is not None and not use_eagle and final_size:
                first = max(final_segment_end_block - final_size, final_segment_end_block - need)
                keep(first, final_segment_end_block)
        if retention_interval is not None:
            # Boundaries a replay or a shared prefix resumes at, which sparse segments miss.
            for boundary in reachable_boundaries:
                end = boundary // alignment_tokens * alignment_tokens // block_size + shift
                keep(end - need, end)
        return mask

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the next token's window: with ``num_computed_tokens`` computed, the
        next token attends to the last ``sliding_window - 1`` of them."""
        return max(0, num_computed_tokens - self.sliding_window + 1)


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Attention within aligned chunks of ``attention_chunk_size`` tokens."""

    def __init__(self, kv_cache_spec: ChunkedLocalAttentionSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Pages before the chunk holding token ``max_length`` count as computed (null pages:
        never read again); inside that chunk the cached pages extend the hit left to right."""
        expect_spec(kv_cache_spec, (ChunkedLocalAttentionSpec,), cls.__name__)
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec)
        if drop_eagle_block:
            raise ValueError("drop_eagle_block: chunked local attention expected False, got True")
        expect_no_context_parallel(dcp_world_size, pcp_world_size, "chunked local attention")
        block_size = kv_cache_spec.block_size
        if block_size != alignment_tokens:
            raise ValueError(
                f"alignment_tokens: chunked local attention expected its block_size "
                f"{block_size}, got {alignment_tokens}"
            )
        chunk = kv_cache_spec.attention_chunk_size
        first_live = max_length // chunk * chunk // block_size
        computed = tuple(
            [block_pool.null_block] * first_live for _ in range(len(kv_cache_group_ids))
        )
        for i in range(first_live, max_length // block_size):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                break
            for blocks, block in zip(computed, cached, strict=True):
                blocks.append(block)
        return computed, len(computed[0]) * block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of the chunks before the one the next token falls in."""
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size


__all__ = [
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "SinkFullAttentionManager",
    "SlidingWindowManager",
]
