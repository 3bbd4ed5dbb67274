"""The page bookkeeping shared by every single-type KV cache manager.

A single-type manager owns the block tables of one KV cache group: which pages (blocks of
``block_size`` tokens) each request holds, how many of them are already published in the prefix
cache, and which pages a request no longer needs. Attention kinds differ only in three answers:
how a prefix hit is searched (:meth:`SingleTypeKVCacheManager.find_longest_cache_hit`), how many
leading tokens no later token attends to (:meth:`~SingleTypeKVCacheManager.get_num_skipped_tokens`)
and how many leading pages all running requests share (cascade attention). Pages a request no
longer needs are replaced by the pool's null block, so block index ``i`` always covers tokens
``[i * block_size, (i + 1) * block_size)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from math import gcd
from typing import ClassVar, cast

from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_hashing import BlockHashList
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_block import KVCacheBlock, trim_null_head
from vllm.v1.core.prefix_retention import check_retention_interval
from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec, KVCacheSpec
from vllm.v1.request import Request


def aligned_block_count(num_blocks: int, block_size: int, alignment_tokens: int) -> int:
    """The largest ``k <= num_blocks`` whose ``k * block_size`` tokens are a multiple of
    ``alignment_tokens`` (block_size and alignment_tokens in tokens)."""
    step = alignment_tokens // gcd(alignment_tokens, block_size)
    return num_blocks - num_blocks % step


def trim_to_alignment(
    computed_blocks: tuple[list[KVCacheBlock], ...], block_size: int, alignment_tokens: int
) -> None:
    """Drop trailing hit blocks (in place, every group alike) until the hit length in tokens is
    a multiple of ``alignment_tokens``."""
    if alignment_tokens == block_size:
        return  # the common single-group case: every page count is aligned
    keep = aligned_block_count(len(computed_blocks[0]), block_size, alignment_tokens)
    for blocks in computed_blocks:
        del blocks[keep:]


def expect_spec(kv_cache_spec: KVCacheSpec, expected: tuple[type, ...], manager: str) -> None:
    """``TypeError`` unless ``kv_cache_spec`` is one of the ``expected`` spec classes."""
    if not isinstance(kv_cache_spec, expected):
        names = " or ".join(t.__name__ for t in expected)
        raise TypeError(
            f"kv_cache_spec: {manager} expected {names}, got {type(kv_cache_spec).__name__}"
        )


def expect_no_context_parallel(dcp_world_size: int, pcp_world_size: int, kind: str) -> None:
    """``ValueError`` for decode / prefill context parallelism, which ``kind`` lacks."""
    if dcp_world_size != 1 or pcp_world_size != 1:
        raise ValueError(
            f"dcp_world_size, pcp_world_size: {kind} expected 1 and 1, got "
            f"{dcp_world_size} and {pcp_world_size}"
        )


class SingleTypeKVCacheManager(ABC):
    """Block tables of one KV cache group, for one kind of attention layer.

    ``supports_fine_grained_hash_lookup``: the kind can take a prefix hit ending inside one of
    its pages (hash-block granularity), which partial hash hits of Mamba models need.
    ``retains_longer_hit``: the hybrid lookup leaves this full-attention kind's hit uncut at
    the reconciled length; allocation keeps only what the local and external hits reuse.

    ``block_size`` is in tokens; with decode context parallelism one logical block of a sharded
    group covers ``block_size * dcp_world_size`` tokens (PCP does not widen it, as v0.33).
    ``scheduler_block_size``
    (tokens, a multiple of ``block_size``; defaults to it) is the scheduling granularity of all
    groups. ``needs_kv_cache_zeroing``: the worker zeroes fresh pages, so attention managers
    list their ids (:meth:`take_new_block_ids`).
    ``max_admission_blocks_per_request`` (pages) caps what the admission check reserves for one
    request; only managers that recycle pages while a request runs (sliding window, chunked
    local) get one.
    """

    supports_fine_grained_hash_lookup: ClassVar[bool] = False
    # Keeps its own hit past the reconciled length (until an external lookup settles it).
    retains_longer_hit: ClassVar[bool] = False

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int | None = None,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        needs_kv_cache_zeroing: bool = False,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        # A group replicated on the context-parallel ranks (Mamba, a draft's layers) keeps whole
        # pages on each: only a sharded one's page covers the ranks' tokens together.
        sharded = kv_cache_spec.dcp_sharded
        self.dcp_world_size = dcp_world_size if sharded else 1
        self.pcp_world_size = pcp_world_size if sharded else 1
        # Prefill context parallelism splits a step's tokens, not a page's: only DCP widens it.
        self.block_size = kv_cache_spec.block_size * self.dcp_world_size
        if scheduler_block_size is None:
            scheduler_block_size = self.block_size
        if scheduler_block_size <= 0 or scheduler_block_size % self.block_size:
            raise ValueError(
                f"scheduler_block_size: expected a positive multiple of block_size "
                f"{self.block_size} (tokens), got {scheduler_block_size}"
            )
        self.scheduler_block_size = scheduler_block_size
        # Granularity of prefix hits (tokens): the hybrid coordinator lowers it to the hash
        # block when Mamba pages take hits inside them (partial hash hits).
        self.cache_hit_alignment_tokens = scheduler_block_size
        # (source, destination) page pairs whose contents the worker must copy before this
        # step's forward pass (copy-on-write of a shared partial page); both stay referenced
        # until the caller of take_pending_cow_copies releases them.
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        # request id -> (page index, shared page) whose tokens past the request's hit its next
        # forward would overwrite: the next allocation copies that page first (managers with
        # hits inside a page: full attention, Mamba).
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        # Pages of a ring are never read before their own request writes them.
        self._record_new_block_ids = (
            needs_kv_cache_zeroing
            and isinstance(kv_cache_spec, AttentionSpec)
            and not isinstance(kv_cache_spec, CircularBufferSpec)
        )
        # Whether this group's hits drop the last page for the EAGLE drafter (set by the
        # coordinator).
        self.use_eagle = False
        self._max_admission_blocks_per_request = max_admission_blocks_per_request
        self._null_block = block_pool.null_block
        # request id -> its pages, index i covering tokens [i * block_size, (i+1) * block_size).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many leading pages are published in the prefix cache. Present only
        # while the request holds pages: it also marks a request as already running.
        self.num_cached_block: dict[str, int] = {}
        # Pages handed out since the last take_new_block_ids() (full attention only), so an
        # engine can zero them before use.
        self.new_block_ids: list[int] = []

    @property
    def max_admission_blocks_per_request(self) -> int | None:
        """The admission cap (pages) of one request; None: none."""
        return self._max_admission_blocks_per_request

    @staticmethod
    def _get_num_evictable_blocks(blocks: Sequence[KVCacheBlock]) -> int:
        """Pages that sit in the free queue (cached, unreferenced): touching them takes them
        out of the free count just like a fresh allocation."""
        return sum(1 for b in blocks if b.ref_cnt == 0 and not b.is_null)

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
        """Free pages that allocating ``num_tokens`` token slots (already held ones included)
        would consume, counting prefix-hit pages that must leave the free queue.

        ``total_computed_tokens`` counts local and connector (external) hits,
        ``num_local_computed_tokens`` the local ones; ``num_tokens_main_model`` excludes
        speculative lookahead tokens and ``prefill_end`` is where the prompt's prefill ends
        (both unused here). ``apply_admission_cap`` clamps the need at
        ``max_admission_blocks_per_request``."""
        num_required = cdiv(num_tokens, self.block_size)
        cap = self._max_admission_blocks_per_request
        if apply_admission_cap and cap is not None:
            num_required = min(num_required, cap)
        num_held = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            # A running request never gets new prefix hits; with spec decode it may hold more
            # pages than it now needs (rejected drafts).
            assert not new_computed_blocks, "a running request cannot take new prefix hits"
            return max(num_required - num_held, 0)

        num_skipped = max(self.get_num_skipped_tokens(total_computed_tokens), 0)
        num_skipped_blocks = num_skipped // self.block_size
        # Pages before the window are null, never allocated: the new pages start after both
        # the skipped region and the pages the request already has (held + hits).
        num_covered = max(num_skipped_blocks, num_held + len(new_computed_blocks))
        num_new = max(num_required - num_covered, 0)
        # Hits falling in the skipped region are not touched (see add_local_computed_blocks).
        first_kept_hit = max(0, num_skipped_blocks - num_held)
        return num_new + self._get_num_evictable_blocks(new_computed_blocks[first_kept_hit:])

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Give a new request its prefix-hit pages, then fresh pages for the connector's
        tokens (both halves below). With several groups the coordinator runs the halves in two
        passes, every group's hits first."""
        if request_id in self.num_cached_block:
            assert not new_computed_blocks, "a running request cannot take new prefix hits"
            return
        self.add_local_computed_blocks(
            request_id, new_computed_blocks, num_local_computed_tokens, num_external_computed_tokens
        )
        self.allocate_external_computed_blocks(
            request_id, num_local_computed_tokens, num_external_computed_tokens
        )

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Give a new request its prefix-hit pages (referenced, so no allocation can evict
        them), with null pages for hits outside the attention window."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, f"request {request_id!r} holds pages but is not running"
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = max(self.get_num_skipped_tokens(num_total), 0) // self.block_size
        new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        elif any(not b.is_null for b in new_computed_blocks):
            raise ValueError(
                "new_computed_blocks: expected no prefix hits with prefix caching disabled, got "
                f"{len(new_computed_blocks)} pages"
            )
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        # Hits (and the nulls before them) are published already: never re-publish them.
        self.num_cached_block[request_id] = len(req_blocks)
        if new_computed_blocks and num_local_computed_tokens % self.block_size:
            # A hit ending inside its page: the page is shared, so the next allocation swaps in
            # a private copy, published (under its full hash) once full.
            index = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (index, new_computed_blocks[-1])
            self.num_cached_block[request_id] = index

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Fresh pages for the connector's ``num_external_computed_tokens`` tokens that the
        window still reads, after the hits :meth:`add_local_computed_blocks` gave. Taking them
        may evict any unreferenced cached page, so every group's hits must be taken first.
        ``record_for_zeroing=False``: the pages are not listed for zeroing (a load writes them
        after this step, which zeroing would race)."""
        num_total = num_local_computed_tokens + num_external_computed_tokens
        # The window may start inside the connector's tokens, or after all of them.
        num_skipped = max(self.get_num_skipped_tokens(num_total), 0)
        if min(num_total - num_skipped, num_external_computed_tokens) <= 0:
            return
        req_blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_total, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return
        fresh = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(fresh)
        if record_for_zeroing and self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in fresh)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Append fresh pages until the request has slots for ``num_tokens`` tokens; returns the
        new pages (empty when it already has enough)."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        fresh = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(fresh)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in fresh)
        return fresh

    @property
    def records_new_block_ids(self) -> bool:
        """True when this manager lists its fresh pages for the worker to zero."""
        return self._record_new_block_ids

    def take_new_block_ids(self) -> list[int]:
        """The ids of the pages handed out since the last call (and forget them)."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Drain the ``(source, destination)`` copies queued since the last call. Each page of a
        pair carries one extra reference for the copy: release both once it has run."""
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        return pending

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        """Drain the ``(request id, group id, page, boundary tokens)`` state pages offered to a
        KV connector since the last call; only Mamba align mode offers any."""
        return []

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        """``(group id, page, boundary tokens)`` of a finishing request's prompt tail still to
        offer; only Mamba align mode has any."""
        return None

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int] = (),
        alignment_tokens: int | None = None,
    ) -> None:
        """Publish the request's full pages among its first ``num_tokens`` tokens in the prefix
        cache. ``alignment_tokens``: the hit granularity of the coordinator (tokens); managers
        whose hits use only some pages of each aligned segment publish only those.
        ``retention_interval`` (tokens, a multiple of ``scheduler_block_size``; None: dense)
        and ``replay_boundaries`` (token positions a replay can resume at) are the sparse
        retention controls, applied by kinds with a :meth:`reachable_block_mask`; the request's
        ``shared_prefix_boundary`` (a junction another request was seen to share) is kept
        too."""
        check_retention_interval(retention_interval, self.scheduler_block_size)
        if not self.kv_cache_spec.prefix_cacheable:
            return
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        # A block whose hash also covers lookahead tokens not yet known has no hash yet.
        num_hashed_tokens = len(request.block_hashes) * self.block_pool.hash_block_size
        num_full = min(num_tokens, num_hashed_tokens) // self.block_size
        if num_full <= num_cached:
            return
        boundaries = list(replay_boundaries)
        junction = request.shared_prefix_boundary
        if junction:
            boundaries.append(junction)
            if self.use_eagle:
                # A sibling diverging right after the junction has no page past it to peek
                # at: its EAGLE hit ends one page lower.
                boundaries.append(junction - self.block_size)
        block_mask = self.reachable_block_mask(
            start_block=num_cached,
            end_block=num_full,
            alignment_tokens=alignment_tokens or self.scheduler_block_size,
            kv_cache_spec=self.kv_cache_spec,
            use_eagle=self.use_eagle,
            retention_interval=retention_interval,
            reachable_boundaries=boundaries,
            dcp_world_size=self.dcp_world_size,
        )
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=self.req_to_blocks[request_id],
            num_cached_blocks=num_cached,
            num_full_blocks=num_full,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
            block_mask=block_mask,
        )
        self.num_cached_block[request_id] = num_full

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
        """Which of pages ``[start_block, end_block)`` a later hit can use, so only those are
        published; None: all of them. Hits end on ``alignment_tokens`` boundaries (tokens);
        ``retention_interval`` (tokens; None: every boundary, 0: none) thins them, and
        ``reachable_boundaries`` (token positions) are kept anyway. Every page of a kind whose
        hit reads the whole prefix is reachable (this default)."""
        return None

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request and return its pages, leading null pages left out, without
        freeing them: the caller frees them, tail first (an unknown id gives [])."""
        self.num_cached_block.pop(request_id, None)
        self._partial_hit_reqs.pop(request_id, None)
        # A list in, a list out (the table itself when it has no null head).
        return cast(list[KVCacheBlock], trim_null_head(self.req_to_blocks.pop(request_id, [])))

    def free(self, request_id: str) -> None:
        """Release every page of the request (an unknown id is a no-op: aborted before any
        allocation). Tail pages go back first so they are evicted before the shared head."""
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading pages shared by every request holding pages (for cascade attention); 0 for
        kinds whose leading pages may be null."""
        return 0

    @classmethod
    @abstractmethod
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
        """The cached pages of the longest usable prefix of at most ``max_length`` tokens whose
        length is a multiple of ``alignment_tokens``, one list per group of
        ``kv_cache_group_ids`` (all groups hit together), with null pages where the kind needs
        no page, and the hit length (tokens). With ``drop_eagle_block`` the last hit page is
        dropped so the drafter recomputes it."""

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Return the pages no later token attends to (after ``processed_computed_tokens``
        committed local and external tokens) to the pool, replacing them by null pages.
        ``num_prompt_tokens`` is for kinds that free a middle range (R-SWA); unused here."""
        num_skipped = self.get_num_skipped_tokens(processed_computed_tokens)
        if num_skipped > 0:
            self._remove_blocks_in_range(request_id, 0, num_skipped // self.block_size)

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        """Free pages ``[first, last)`` of the request, replacing them by null pages. Walks
        back from ``last`` and stops at a null page: earlier calls nulled everything before it.
        The range may reach past the pages allocated so far (connector tokens)."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        removed: list[KVCacheBlock] = []
        for i in range(min(last, len(blocks)) - 1, first - 1, -1):
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            blocks[i] = self._null_block
        self.block_pool.free_blocks(removed)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens that the next token does not attend to, given ``num_computed_tokens``
        computed tokens: none for full attention."""
        return 0

    def new_step_starts(self) -> None:
        """Hook called at the start of every scheduler step."""
        return None
