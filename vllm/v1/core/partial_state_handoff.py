"""Mamba (align mode) state pages offered to a KV connector, and the prompt-tail partial hit.

A connector that offloads Mamba states cannot find them by position: align mode nulls old
states in the block table. So the manager offers each published state page itself, as
``(request id, group id, page, boundary tokens)``, until the scheduler drains the offers.

With partial hash hits the prompt's last reusable state may end inside its page. That page is
published at the boundary but the request's next step overwrites it, so it is not offered
right away: the request (the "producer" of that tail) is marked instead, and

* the next allocation copies the page (copy-on-write) and offers the durable copy;
* a request finishing first offers the unchanged table page once
  (:meth:`MambaStateHandoff.finalize_partial_tail_offload`), if nothing ran past the boundary.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.block_hashing import BlockHashWithGroupId
from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.core.single_type_manager_base import SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position
from vllm.v1.request import Request

# (request id, group id, page, boundary in tokens)
BoundaryStateOffload = tuple[str, int, KVCacheBlock, int]


class MambaStateHandoff(SingleTypeKVCacheManager):
    """The hand-off half of ``MambaManager`` (which sets the attributes below)."""

    cached_blocks_this_step: set[BlockHashWithGroupId]
    drop_eagle_checkpoint_block: bool
    mamba_cache_mode: str
    shared_prefix_checkpoint: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # States published since the last take_pending_boundary_state_offloads.
        self._pending_boundary_state_offloads: list[BoundaryStateOffload] = []
        # request id -> (table page, boundary in tokens) of its own prompt tail, published
        # inside the page and not offered yet.
        self._producer_partial_tail_reqs: dict[str, tuple[KVCacheBlock, int]] = {}

    @property
    def _align(self) -> bool:
        return self.mamba_cache_mode == "align"

    def _offer_boundary_state(self, request_id: str, block: KVCacheBlock, boundary: int) -> None:
        self._pending_boundary_state_offloads.append(
            (request_id, self.kv_cache_group_id, block, boundary)
        )

    def take_pending_boundary_state_offloads(self) -> list[BoundaryStateOffload]:
        """Drain the ``(request id, group id, page, boundary tokens)`` states offered since
        the last call (align mode). A page stays valid only until its request frees it: a
        caller reading it later must hold a reference."""
        pending, self._pending_boundary_state_offloads = self._pending_boundary_state_offloads, []
        return pending

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        """``(group id, table page, boundary tokens)`` of the request's unoffered prompt tail
        when it finishes exactly at that boundary (``num_computed_tokens``, none in flight);
        None otherwise. Consumes the mark either way: a page run past its boundary holds a
        later state and is never offered."""
        tail = self._producer_partial_tail_reqs.pop(request_id, None)
        if tail is None:
            return None
        block, boundary = tail
        if num_in_flight_tokens != 0 or num_computed_tokens != boundary:
            return None
        return self.kv_cache_group_id, block, boundary

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        # The pages go back to the pool now: an offer not yet taken would name a page another
        # request may be handed.
        self._producer_partial_tail_reqs.pop(request_id, None)
        self._pending_boundary_state_offloads = [
            entry for entry in self._pending_boundary_state_offloads if entry[0] != request_id
        ]
        return super().pop_blocks_for_free(request_id)

    def _copy_partial_page(
        self, request_id: str, running: bool, index: int, source: KVCacheBlock
    ) -> KVCacheBlock:
        """Queue the copy of the shared state page ``source`` (at ``index``) into a fresh page.
        A new request reads the copy in place of ``source``; a running one keeps writing
        ``source`` (a running block table only grows), so the copy takes over its key and, for
        the request's own prompt tail, its offer. Each page keeps one reference for the copy
        (see take_pending_cow_copies)."""
        copy = self.block_pool.get_new_blocks(1)[0]
        blocks = self.req_to_blocks[request_id]
        assert blocks[index] is source and not source.is_null
        if running:
            self.block_pool.move_block_hashes(source, copy)
            source.ref_cnt += 1
            if copy.block_hash is not None:
                # Filled only by this step's copy: no hit on it before the step ends.
                self.cached_blocks_this_step.add(copy.block_hash)
            tail = self._producer_partial_tail_reqs.pop(request_id, None)
            if tail is not None:
                assert tail[0] is source, "a prompt tail is copied from its own page"
                self._offer_boundary_state(request_id, copy, tail[1])
        else:
            blocks[index] = copy
            copy.ref_cnt += 1
        self._pending_cow_copies.append((source, copy))
        return copy

    def _publish_prompt_tail(self, request: Request, num_tokens: int) -> None:
        """With partial hash hits, key the running state page by the hash at the prompt's last
        reusable position when this step ends there inside a page (a replay of the prompt
        resumes there). The next step overwrites the page, so the request copies it first
        and offers the copy; until then the request is the tail's producer."""
        hash_block_size = self.block_pool.hash_block_size
        if not self._align or self.cache_hit_alignment_tokens >= self.block_size:
            return
        position = get_mamba_prefill_checkpoint_position(
            request.num_prompt_tokens,
            hash_block_size,
            self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens,
        )
        junction = request.shared_prefix_boundary
        if (
            self.shared_prefix_checkpoint
            and num_tokens == junction
            and request.num_computed_tokens < junction <= request.num_prompt_tokens
            and junction % hash_block_size == 0
        ):
            # Where a sibling was seen to diverge and this chunk ends: it resumes there. Only
            # during the prompt: a decode step's state page changes in place.
            position = junction
        if (
            num_tokens != position
            or position % self.block_size == 0
            or len(request.block_hashes) * hash_block_size < position
        ):
            return
        index = position // self.block_size
        blocks = self.req_to_blocks[request.request_id]
        if index >= len(blocks) or blocks[index].is_null:
            return
        block = blocks[index]
        if block.block_hash_num_tokens == position:
            return  # keyed here already (its own hit): re-keying would defer its siblings
        # A state page holds one state: its earlier keys go.
        key = self.block_pool.cache_partial_block(
            request, block, position, self.kv_cache_group_id, self.block_size, True
        )
        if key is None:
            return
        self.cached_blocks_this_step.add(key)
        self._partial_hit_reqs[request.request_id] = (index, block)
        self.num_cached_block[request.request_id] = index
        self._producer_partial_tail_reqs[request.request_id] = (block, position)
