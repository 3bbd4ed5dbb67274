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
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    BlockHashList,
    BlockHashWithGroupId,
    KVCacheBlock,
    make_block_hash_with_group_id,
)
from vllm.v1.core.single_type_manager_base import (
    SingleTypeKVCacheManager,
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


class MambaManager(SingleTypeKVCacheManager):
    """Mamba state pages of one KV cache group (see the module docstring for the modes)."""

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
        # align mode: request id -> (checkpoint position in tokens, index of the page that
        # saves it) for the step being allocated.
        self._checkpoints: dict[str, tuple[int, int]] = {}

    @property
    def _align(self) -> bool:
        return self.mamba_cache_mode == "align"

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
        """The rightmost cached page ending on an ``alignment_tokens`` boundary, preceded by
        null pages; empty lists when none is cached."""
        expect_spec(kv_cache_spec, (MambaSpec,), cls.__name__)
        expect_no_context_parallel(dcp_world_size, pcp_world_size, "Mamba")
        block_size = kv_cache_spec.block_size
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
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
            return self._align_layout(request_id, num_required, checkpoint is not None)[2]
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
        return num_new + self._get_num_evictable_blocks(kept_hits)

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
            query_end, self.scheduler_block_size, self.drop_eagle_checkpoint_block
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
        if num_required <= num_before and not has_checkpoint:
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
        req_blocks.extend(self.block_pool.get_new_blocks(num_new))
        self._allocated_block_reqs.add(request_id)
        return req_blocks[num_before:]

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self._num_retired_blocks.pop(request_id, None)
        self._checkpoints.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

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
        self._publish_checkpoint(request)
        num_after = self.num_cached_block.get(request.request_id, 0)
        if num_after <= num_before:
            return
        for block in self.req_to_blocks[request.request_id][num_before:num_after]:
            if not block.is_null:
                assert block.block_hash is not None
                self.cached_blocks_this_step.add(block.block_hash)

    def _publish_checkpoint(self, request: Request) -> None:
        """Key the checkpoint page of this step by the prefix hash at its position, replacing
        the hash of its page index that cache_blocks gave it (the page holds the state at the
        checkpoint, not at its page's end). Positions are multiples of scheduler_block_size,
        hence of block_size: the key is a whole-page hit."""
        checkpoint = self._checkpoints.get(request.request_id)
        if checkpoint is None:
            return
        position, index = checkpoint
        block = self.req_to_blocks[request.request_id][index]
        num_blocks = position // self.block_size
        if block.is_null or len(request.block_hashes) * self.block_pool.hash_block_size < position:
            return
        key = make_block_hash_with_group_id(
            request.block_hashes[position // self.block_pool.hash_block_size - 1],
            self.kv_cache_group_id,
        )
        if block.block_hash == key:
            return
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

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()
