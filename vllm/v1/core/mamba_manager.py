"""Single-type manager for Mamba (and other linear-attention) layers.

A Mamba layer's page holds the recurrent state after the last token of its block, not per-token
K/V: the next token needs only the newest state, so a prefix hit is a single cached page (the
state at the end of the hit) with null pages before it. ``mamba_cache_mode`` (from
``cache_config``) says which states a request keeps:

* ``"none"`` / ``"all"``: one page per ``block_size`` tokens like attention, plus
  ``num_speculative_blocks`` pages for the states of draft tokens;
* ``"align"``: only the running state (plus the speculative pages); the state of each finished
  block is written into a fresh page so it can be published, and the page from two steps ago is
  returned to the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_hashing import (
    BlockHashList,
    BlockHashWithGroupId,
    make_block_hash_with_group_id,
)
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.core.partial_state_handoff import MambaStateHandoff
from vllm.v1.core.single_type_manager_base import (
    expect_no_context_parallel,
    expect_spec,
)
from vllm.v1.kv_cache_interface import (
    KVCacheSpec,
    MambaSpec,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)
from vllm.v1.request import Request


class MambaManager(MambaStateHandoff):
    """Mamba state pages of one KV cache group (see the module docstring for the modes)."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: BlockPool, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, block_pool, **kwargs)
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        # Hashes published during the current step: another request may not start from them
        # before the step ends, because their states are written by this step's forward pass.
        self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()
        # align mode: request id -> index of the page holding the state saved two steps ago.
        self.last_state_block_idx: dict[str, int] = {}
        # align mode: requests that got their running-state pages already.
        self._allocated_block_reqs: set[str] = set()
        # align mode: request id -> pages before this index are retired (null or freed).
        self._num_retired_blocks: dict[str, int] = {}
        self.has_prefill_checkpoint_blocks = (
            self._align and kv_cache_spec.num_prefill_checkpoint_blocks > 0
        )
        # Whether checkpoints sit one hash block lower for EAGLE (set like use_eagle).
        self.drop_eagle_checkpoint_block = False
        # Whether the state at a request's shared-prefix junction is published too (set by
        # KVCacheManager from enable_mamba_shared_prefix_checkpoint).
        self.shared_prefix_checkpoint = False
        # align mode: request id -> (checkpoint position in tokens, index of the page that
        # saves it) for the step being allocated.
        self._checkpoints: dict[str, tuple[int, int]] = {}

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
        """The rightmost cached state ending on an ``alignment_tokens`` boundary, preceded by
        null pages; empty lists when none is cached. An alignment finer than the page (partial
        hash hits) means ``block_hashes`` are per ``alignment_tokens`` tokens and a state may
        end inside its page: the hit length is then not a whole number of pages."""
        expect_spec(kv_cache_spec, (MambaSpec,), cls.__name__)
        expect_no_context_parallel(dcp_world_size, pcp_world_size, "Mamba")
        block_size = kv_cache_spec.block_size
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        if alignment_tokens < block_size and block_size % alignment_tokens == 0:
            num_units = min(max_length // alignment_tokens, len(block_hashes))
            for unit in range(num_units - 1, -1, -1):
                cached = block_pool.get_cached_block(block_hashes[unit], kv_cache_group_ids)
                if cached is None:
                    continue
                end = (unit + 1) * alignment_tokens
                for blocks, block in zip(computed, cached, strict=True):
                    blocks.extend([block_pool.null_block] * ((end - 1) // block_size))
                    blocks.append(block)
                return computed, end
            return computed, 0
        for i in range(max_length // block_size - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                continue
            if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens:
                continue
            for blocks, block in zip(computed, cached, strict=True):
                blocks.extend([block_pool.null_block] * i)
                blocks.append(block)
            break
        return computed, len(computed[0]) * block_size

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        # With async scheduling the count may include drafts that get rejected: assume they
        # all are, so no state that may still be needed is freed.
        num_computed = max(0, processed_computed_tokens - self.num_speculative_blocks)
        super().remove_skipped_blocks(request_id, num_computed)
        if not self._align:
            return
        idx = self.last_state_block_idx.get(request_id)
        # The page from two steps ago is no longer a copy source once a newer state exists.
        if idx is None or idx >= cdiv(num_computed, self.block_size) - 1:
            return
        blocks = self.req_to_blocks[request_id]
        if not blocks[idx].is_null:
            self.block_pool.free_blocks([blocks[idx]])
            blocks[idx] = self._null_block

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        """Align mode leaves null gaps between the states still awaiting retirement, so the
        walk crosses null pages instead of stopping at the first; it starts after the pages
        retired by earlier calls."""
        if not self._align:
            super()._remove_blocks_in_range(request_id, first, last)
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first = max(first, self._num_retired_blocks.get(request_id, 0))
        last = min(last, len(blocks))
        if first >= last:
            return
        removed = [blocks[i] for i in range(last - 1, first - 1, -1) if not blocks[i].is_null]
        for i in range(first, last):
            blocks[i] = self._null_block
        self.block_pool.free_blocks(removed)
        self._num_retired_blocks[request_id] = last

    def _relocate_speculative_block(self, req_blocks: list[KVCacheBlock], block_idx: int) -> None:
        """Move the speculative page at ``block_idx`` to the tail (reused by the next step),
        leaving a null page behind. Only a page this request alone holds, unpublished, may
        move: another holder or a hash would still point at its old position."""
        assert self.block_pool.is_block_writable(req_blocks[block_idx]), (
            "Speculative Mamba blocks must be exclusively owned and unhashed before relocation"
        )
        req_blocks.append(req_blocks[block_idx])
        req_blocks[block_idx] = self._null_block

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
        if (
            new_computed_blocks
            and new_computed_blocks[-1].block_hash in self.cached_blocks_this_step
        ):
            # The hit's state is written in this very step: report more pages than the pool
            # has, so the request waits for the next step.
            return self.block_pool.num_gpu_blocks + 1
        if not self._align:
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens + self.block_size * self.num_speculative_blocks,
                new_computed_blocks,
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap=apply_admission_cap,
            )
        # Lookahead tokens would break the page alignment (draft models have no Mamba layers).
        num_spec = self.num_speculative_blocks
        num_required = cdiv(num_tokens_main_model, self.block_size) + num_spec
        checkpoint = self._plan_checkpoint(
            request_id, total_computed_tokens, num_tokens_main_model, prefill_end
        )
        if not apply_admission_cap:
            # The allocation that follows an unrestricted estimate uses this plan.
            if checkpoint is None:
                self._checkpoints.pop(request_id, None)
            else:
                self._checkpoints[request_id] = checkpoint
        num_held = len(self.req_to_blocks.get(request_id, ()))
        if num_held > 0:
            num_cow = int(request_id in self._partial_hit_reqs)
            return self._align_layout(request_id, num_required, checkpoint is not None)[2] + (
                num_cow
            )
        # A new request, page for page as add_local_computed_blocks,
        # allocate_external_computed_blocks and allocate_new_blocks take them: the hit's state
        # page unless the connector's tokens pass it, a state page after the connector's
        # tokens, then the checkpoint page, the running state and the speculative pages.
        num_skipped_blocks = max(total_computed_tokens - 1, 0) // self.block_size
        num_after_hits = max(num_skipped_blocks, len(new_computed_blocks))
        num_after_external = max(cdiv(total_computed_tokens, self.block_size), num_after_hits)
        num_new = num_after_external - num_after_hits
        first_own = num_required - num_spec - 1 - int(checkpoint is not None)
        if num_required > num_after_external:
            num_new += num_required - max(num_after_external, first_own)
        kept_hits = new_computed_blocks[num_skipped_blocks:]
        # A hit ending inside its page gets a private copy of that page.
        num_cow = int(bool(new_computed_blocks) and num_local_computed_tokens % self.block_size)
        return num_new + num_cow + self._get_num_evictable_blocks(kept_hits)

    def _plan_checkpoint(
        self, request_id: str, query_start: int, query_end: int, prefill_end: int
    ) -> tuple[int, int] | None:
        """``(position, page index)`` of the prefill checkpoint a step over tokens
        [query_start, query_end) saves, or None: the position is the prompt-style reusable
        boundary below ``query_end``; the page is the one just before the running state, and
        must be unheld, null, or one of the request's own speculative pages."""
        if not self.has_prefill_checkpoint_blocks or query_end < prefill_end:
            return None
        assert isinstance(self.kv_cache_spec, MambaSpec)
        position = get_mamba_prefill_checkpoint_position(
            query_end,
            self.cache_hit_alignment_tokens,
            self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens,
        )
        index = cdiv(query_end, self.block_size) - 2
        if index < 0 or not is_mamba_prefill_checkpoint_valid(
            query_start,
            query_end,
            position,
            self.block_pool.hash_block_size,
            self.block_size,
            self.kv_cache_spec.prefill_checkpoint_alignment,
        ):
            return None
        blocks = self.req_to_blocks.get(request_id, [])
        if (
            index >= len(blocks)
            or blocks[index].is_null
            or (
                request_id in self._allocated_block_reqs
                and index >= len(blocks) - self.num_speculative_blocks
            )
        ):
            return position, index
        return None

    def _align_layout(
        self, request_id: str, num_required: int, has_checkpoint: bool
    ) -> tuple[int, int, int]:
        """How allocate_new_blocks lays out a held request's pages: (length after padding with
        null pages, how many speculative pages move to the tail, new pages to take). The page
        before the running state stays for the checkpoint when there is one."""
        blocks = self.req_to_blocks.get(request_id, [])
        num_before = len(blocks)
        null_end = num_required - self.num_speculative_blocks - 1 - int(has_checkpoint)
        length = max(num_before, null_end)
        num_moved = 0
        if request_id in self._allocated_block_reqs:
            first_spec = num_before - self.num_speculative_blocks
            num_moved = max(0, min(num_before, null_end) - first_spec)
        return length, num_moved, max(num_required - length - num_moved, 0)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        if not self._align:
            return super().allocate_new_blocks(
                request_id,
                num_tokens + self.block_size * self.num_speculative_blocks,
                num_tokens_main_model,
            )
        num_spec = self.num_speculative_blocks
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_required = cdiv(num_tokens_main_model, self.block_size) + num_spec
        num_before = len(req_blocks)
        has_checkpoint = request_id in self._checkpoints
        partial = self._partial_hit_reqs.pop(request_id, None)
        if num_required <= num_before and not has_checkpoint and partial is None:
            # Pages over-allocated by an earlier step still cover this one.
            self._allocated_block_reqs.add(request_id)
            return []
        running = request_id in self._allocated_block_reqs
        if running:
            # The running state sits just before the speculative pages.
            self.last_state_block_idx[request_id] = num_before - 1 - num_spec
        elif num_before > 0:
            # A new request's last page holds its prefix hit's state.
            self.last_state_block_idx[request_id] = num_before - 1
        length, num_moved, num_new = self._align_layout(request_id, num_required, has_checkpoint)
        # Pages before the new running state (and its checkpoint) need no state of their own.
        req_blocks.extend([self._null_block] * (length - num_before))
        # Move the previous step's speculative pages to the tail so they are reused; one left
        # at the checkpoint index saves the checkpoint.
        first_spec = num_before - num_spec
        for idx in range(first_spec, first_spec + num_moved):
            self._relocate_speculative_block(req_blocks, idx)
        cap = 1 + int(has_checkpoint) + (0 if running else num_spec)
        assert num_new <= cap, "align mode over-allocates"
        returned = req_blocks[num_before:]
        if partial is not None:
            copy = self._copy_partial_page(request_id, running, *partial)
            if not running:
                returned.insert(0, copy)
        fresh = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(fresh)
        self._allocated_block_reqs.add(request_id)
        return returned + fresh

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self._num_retired_blocks.pop(request_id, None)
        self._checkpoints.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

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
        """A hit on a boundary reads the one state page ending there (no window, and drafters
        have no Mamba layers, so no EAGLE shift). Dense (None) without a retention interval or
        when every page ends a segment; else the last page of each ``retention_interval``
        segment (none for 0) and the page ending at each ``reachable_boundaries`` position,
        floored to ``alignment_tokens`` (all in tokens)."""
        expect_spec(kv_cache_spec, (MambaSpec,), cls.__name__)
        if retention_interval is None or alignment_tokens is None:
            return None
        block_size = kv_cache_spec.block_size
        mask = [False] * (end_block - start_block)
        if retention_interval:
            per_segment = retention_interval // block_size
            if per_segment <= 1:
                return None
            # Page i ends at token (i + 1) * block_size: segment tails are i % per_segment
            # == per_segment - 1.
            first_tail = (start_block + per_segment) // per_segment * per_segment - 1
            for i in range(first_tail, end_block, per_segment):
                mask[i - start_block] = True
        for boundary in reachable_boundaries:
            page = boundary // alignment_tokens * alignment_tokens // block_size - 1
            if start_block <= page < end_block:
                mask[page - start_block] = True
        return mask

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """All tokens but the last computed one: only the newest state is read."""
        return num_computed_tokens - 1

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int] = (),
        alignment_tokens: int | None = None,
    ) -> None:
        num_before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(
            request,
            num_tokens,
            retention_interval,
            replay_boundaries=replay_boundaries,
            alignment_tokens=alignment_tokens,
        )
        if not self._publish_checkpoint(request, retention_interval):
            self._publish_prompt_tail(request, num_tokens)
        num_after = self.num_cached_block.get(request.request_id, 0)
        if num_after <= num_before:
            return
        blocks = self.req_to_blocks[request.request_id]
        for index in range(num_before, num_after):
            block = blocks[index]
            # Null pages and pages sparse retention left out carry no hash.
            if block.block_hash is None:
                continue
            self.cached_blocks_this_step.add(block.block_hash)
            if self._align:
                boundary = block.block_hash_num_tokens or (index + 1) * self.block_size
                self._offer_boundary_state(request.request_id, block, boundary)

    def _publish_checkpoint(self, request: Request, retention_interval: int | None) -> bool:
        """Key the checkpoint page of this step by the prefix hash at its position, replacing
        the hash of its page index that cache_blocks gave it (the page holds the state at the
        checkpoint, not at its page's end). A checkpoint that is neither the prompt's, nor a
        retained boundary, nor the shared-prefix junction is transient: its page gets no key.
        False when this step saves no checkpoint."""
        checkpoint = self._checkpoints.get(request.request_id)
        if checkpoint is None:
            return False
        position, index = checkpoint
        block = self.req_to_blocks[request.request_id][index]
        num_blocks = position // self.block_size
        if block.is_null or len(request.block_hashes) * self.block_pool.hash_block_size < position:
            return True
        if not self._is_kept_checkpoint(request, position, retention_interval):
            self.block_pool._maybe_evict_cached_block(block)
            return True
        if position % self.block_size:
            # Partial hash hits: the state ends inside a page.
            key = self.block_pool.cache_partial_block(
                request, block, position, self.kv_cache_group_id, self.block_size, True
            )
            if key is not None:
                self.cached_blocks_this_step.add(key)
            return True
        key = make_block_hash_with_group_id(
            request.block_hashes[position // self.block_pool.hash_block_size - 1],
            self.kv_cache_group_id,
        )
        if block.block_hash == key:
            return True
        self.block_pool._maybe_evict_cached_block(block)
        # cache_full_blocks keys page i by hash i: hand it the checkpoint page at the index of
        # its position, behind null pages (skipped), so the events say the same as the key.
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=[self._null_block] * (num_blocks - 1) + [block],
            num_cached_blocks=num_blocks - 1,
            num_full_blocks=num_blocks,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
        )
        assert block.block_hash is not None
        self.cached_blocks_this_step.add(block.block_hash)
        return True

    def _is_kept_checkpoint(
        self, request: Request, position: int, retention_interval: int | None
    ) -> bool:
        """Whether a lookup may ever resume at checkpoint ``position`` (tokens): the prompt's
        own checkpoint, the shared-prefix junction, or a page end sparse retention keeps."""
        prompt_checkpoint = get_mamba_prefill_checkpoint_position(
            request.num_prompt_tokens,
            self.cache_hit_alignment_tokens,
            self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens,
        )
        if position in (prompt_checkpoint, request.shared_prefix_boundary):
            return True
        if position % self.block_size:
            return False
        index = position // self.block_size - 1
        mask = self.reachable_block_mask(
            index,
            index + 1,
            self.cache_hit_alignment_tokens,
            self.kv_cache_spec,
            self.drop_eagle_checkpoint_block,
            retention_interval=retention_interval,
        )
        return mask is None or mask[0]

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()
