"""Device residency of HiSparse requests: which resident pages are pinned, which are clean
copies the pool may reuse, and which device copies of published host pages a later prefix
hit can adopt. :class:`~vllm.v1.hisparse.coordinator.HiSparseCoordinator` builds on it.

A resident page is *dirty* (only the device copy exists), *clean* (its host copy is complete:
``valid_pages``) or *unpinned* (clean, and its allocation reference given back with
``BlockPool.unpin_blocks``: still read, but the pool counts it free and may hand it out, at
which point the request reads that page from the host instead). Clean pages keep their
reference (``pinned_clean``) while the request cannot read from the host yet, i.e. until it
holds its hot buffer.

Units: page indices count ``block_size``-token pages from a request's first token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_hashing import BlockHashWithGroupId
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.hisparse_managers import (
    HiSparseHotManager,
    HiSparseResidentManager,
    HiSparseSourceManager,
)
from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.hisparse.types import ACTIVE_TAIL_PAGES, SparseKVResidencyUpdate, SparseKVRowMirror
from vllm.v1.request import Request


@dataclass
class PendingPublication:
    """A host-group publication waiting for its pages' host copies (tokens / pages)."""

    request: Request
    num_computed_tokens: int
    num_pages: int
    retention_interval: int | None
    replay_boundaries: Sequence[int]
    # Set when the request finished with copies in flight: its host pages, kept referenced
    # until the copies land and the prefix is published.
    detached_blocks: list[KVCacheBlock] | None = None
    num_cached_blocks: int = 0


@dataclass
class HiSparseRequestState:
    """The residency bookkeeping of one request (page indices)."""

    valid_pages: set[int] = field(default_factory=set)
    # Pages [0, ready_prefix_pages) all have complete host copies.
    ready_prefix_pages: int = 0
    # page -> transfer id of its copy in flight.
    pending_pages: dict[int, int] = field(default_factory=dict)
    publication: PendingPublication | None = None
    copies_recorded_blocks: int = 0
    pinned_clean: set[int] = field(default_factory=set)
    unpinned_pages: set[int] = field(default_factory=set)
    # Prefix pages whose device copies are adopted once the admitting allocation ran.
    pages_to_adopt: int = 0
    # The worker knows this request's residency below synced_pages, except stale_pages.
    synced_pages: int = 0
    stale_pages: set[int] = field(default_factory=set)


class HiSparseResidency:
    """Residency policy and the worker's views of it (the coordinator sets the fields)."""

    resident_managers: tuple[HiSparseResidentManager, ...]
    hot_managers: tuple[HiSparseHotManager, ...]
    host_manager: HiSparseSourceManager | None
    gpu_pool: BlockPool | None
    # Free device pages below which requests start reading from the host.
    transition_watermark: int
    request_states: dict[str, HiSparseRequestState]
    # Requests whose resident pages were all on the device when last checked.
    _resident_requests: set[str]
    # Published host hash -> the device copies of that page (one per resident group).
    copies: dict[BlockHashWithGroupId, tuple[KVCacheBlock, ...]]
    _copy_by_block: dict[int, BlockHashWithGroupId]
    # Unpinned device block id -> the (request, page) pairs still reading it.
    _owners: dict[int, set[tuple[str, int]]]

    def _get_request_state(self, request_id: str) -> HiSparseRequestState:
        return self.request_states.setdefault(request_id, HiSparseRequestState())

    # Device copies of published host pages.

    def _adopt_copies(
        self, request_id: str, state: HiSparseRequestState, host_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Read host-only prefix pages from surviving device copies of them, page by page
        (the hit length is settled already, so gaps do not matter)."""
        if not self.copies:
            return
        for page_idx, host_block in enumerate(host_blocks):
            if host_block.is_null or host_block.block_hash is None:
                continue
            blocks = self.copies.get(host_block.block_hash)
            if blocks is None:
                continue
            for manager, block in zip(self.resident_managers, blocks, strict=True):
                if manager.adopt_resident_page(request_id, page_idx, block):
                    manager.block_pool.touch([block])
                    state.pinned_clean.add(page_idx)
                    if page_idx < state.synced_pages:
                        state.stale_pages.add(page_idx)

    def _record_copies(self, request_id: str, num_computed_tokens: int) -> None:
        """Index the device copies of the request's newly published host pages."""
        if not self.resident_managers or self.host_manager is None:
            return
        host_blocks = self.host_manager.req_to_blocks.get(request_id)
        if not host_blocks:
            return
        state = self._get_request_state(request_id)
        num_pages = min(num_computed_tokens // self.host_manager.block_size, len(host_blocks))
        for page_idx in range(state.copies_recorded_blocks, num_pages):
            if page_idx not in state.pending_pages:
                self._record_copy(request_id, page_idx, host_blocks[page_idx])
        state.copies_recorded_blocks = max(state.copies_recorded_blocks, num_pages)

    def _record_copy(self, request_id: str, page_idx: int, host_block: KVCacheBlock) -> None:
        if host_block.is_null or host_block.block_hash is None:
            return
        blocks: list[KVCacheBlock] = []
        for manager in self.resident_managers:
            block = manager.get_resident_page(request_id, page_idx)
            if block is None:
                return
            blocks.append(block)
        self._drop_copy(host_block.block_hash)
        self.copies[host_block.block_hash] = tuple(blocks)
        for block in blocks:
            self._copy_by_block[block.block_id] = host_block.block_hash

    def _drop_copy(self, host_hash: BlockHashWithGroupId) -> None:
        for block in self.copies.pop(host_hash, ()):
            self._copy_by_block.pop(block.block_id, None)

    # Pinning, unpinning and losing pages.

    def _can_read_from_host(self, request_id: str) -> bool:
        """Whether the request holds every hot buffer, so its pages may leave the device."""
        return bool(self.hot_managers) and all(m.has_hot(request_id) for m in self.hot_managers)

    def _fills_admission_window(self, request_id: str) -> bool:
        """Whether the request holds the resident pages admission reserved for it: pinning
        more would let a chunked prefill outgrow the pool it was admitted into."""
        for manager in self.resident_managers:
            cap = manager.max_admission_blocks_per_request
            if cap is not None and len(manager.req_to_blocks.get(request_id, ())) >= cap:
                return True
        return False

    def _resident_page_blocks(self, request_id: str, page_idx: int) -> list[KVCacheBlock] | None:
        """The page's device blocks, or None when it is host-only or near the tail."""
        blocks: list[KVCacheBlock] = []
        for manager in self.resident_managers:
            num_pages = len(manager.req_to_blocks.get(request_id, ()))
            block = manager.get_resident_page(request_id, page_idx)
            if page_idx >= num_pages - ACTIVE_TAIL_PAGES or block is None:
                return None
            blocks.append(block)
        return blocks

    def _unpin_page(self, request_id: str, state: HiSparseRequestState, page_idx: int) -> bool:
        if page_idx in state.pending_pages or page_idx not in state.valid_pages:
            return False
        blocks = self._resident_page_blocks(request_id, page_idx)
        if blocks is None:
            return False
        for manager, block in zip(self.resident_managers, blocks, strict=True):
            self._owners.setdefault(block.block_id, set()).add((request_id, page_idx))
            manager.block_pool.unpin_blocks([block], self._on_block_reused)
        state.pinned_clean.discard(page_idx)
        state.unpinned_pages.add(page_idx)
        return True

    def _page_became_clean(
        self, request_id: str, state: HiSparseRequestState, page_idx: int
    ) -> None:
        state.pinned_clean.add(page_idx)
        if self._can_read_from_host(request_id):
            self._unpin_page(request_id, state, page_idx)

    def _on_block_reused(self, block: KVCacheBlock) -> None:
        host_hash = self._copy_by_block.get(block.block_id)
        if host_hash is not None:
            self._drop_copy(host_hash)
        for request_id, page_idx in self._owners.pop(block.block_id, ()):
            self._lose_page(request_id, page_idx)

    def _lose_page(self, request_id: str, page_idx: int) -> None:
        """The pool reused the page's device block: read it from the host from now on."""
        self._resident_requests.discard(request_id)
        state = self.request_states.get(request_id)
        if state is None:
            return
        for manager in self.resident_managers:
            block = manager.drop_resident_page(request_id, page_idx)
            if block is not None and block.block_id in self._owners:
                self._owners[block.block_id].discard((request_id, page_idx))
        state.unpinned_pages.discard(page_idx)
        if page_idx < state.synced_pages:
            state.stale_pages.add(page_idx)
        for manager in self.hot_managers:
            manager.require_hot(request_id)

    def update_residency(self, request_id: str) -> None:
        """One step's residency policy for a scheduled request: adopt prefix copies, then
        release every clean page when it can read from the host; otherwise keep its pages
        pinned and ask for a hot buffer once the pool runs low or the request fills its
        admission window (the buffer comes with its next allocation)."""
        if not self.resident_managers:
            return
        state = self._get_request_state(request_id)
        if state.pages_to_adopt:
            assert self.host_manager is not None
            host_blocks = self.host_manager.req_to_blocks.get(request_id, [])
            self._adopt_copies(request_id, state, host_blocks[: state.pages_to_adopt])
            state.pages_to_adopt = 0
        if self._can_read_from_host(request_id):
            # The tail first, so a shared prefix loses its tail pages before its head.
            for page_idx in sorted(state.pinned_clean, reverse=True):
                self._unpin_page(request_id, state, page_idx)
            return
        assert self.gpu_pool is not None
        if (
            self.gpu_pool.get_num_free_blocks() < self.transition_watermark
            or self._fills_admission_window(request_id)
        ):
            for manager in self.hot_managers:
                manager.require_hot(request_id)

    # The worker's views.

    def build_row_mirrors(
        self, requests: Iterable[tuple[str, int, int]]
    ) -> tuple[SparseKVRowMirror, ...]:
        """The host rows this step's tokens must be mirrored to, for each scheduled
        ``(request id, computed tokens, scheduled tokens)``. A page without a device copy
        or a host page is skipped alone: its neighbours still mirror, and a window never
        moves back, so skipping them would leave their host rows stale for good."""
        if not self.resident_managers or self.host_manager is None:
            return ()
        block_size = self.resident_managers[0].block_size
        mirrors: list[SparseKVRowMirror] = []
        for request_id, num_computed, num_scheduled in requests:
            host_blocks = self.host_manager.req_to_blocks.get(request_id)
            if host_blocks is None or any(
                request_id not in m.req_to_blocks for m in self.resident_managers
            ):
                continue
            position, end = num_computed, num_computed + num_scheduled
            while position < end:
                page_idx, offset = divmod(position, block_size)
                num_rows = min(block_size - offset, end - position)
                position += num_rows
                blocks = [m.get_resident_page(request_id, page_idx) for m in self.resident_managers]
                if page_idx >= len(host_blocks) or host_blocks[page_idx].is_null:
                    continue
                starts = tuple(b.block_id * block_size + offset for b in blocks if b is not None)
                if len(starts) != len(blocks):
                    continue
                mirrors.append(
                    SparseKVRowMirror(
                        source_starts=starts,
                        destination_start=host_blocks[page_idx].block_id * block_size + offset,
                        num_rows=num_rows,
                    )
                )
        return tuple(mirrors)

    def all_context_pages_resident(self, requests: Iterable[tuple[str, int, int]]) -> bool:
        """Whether every scheduled ``(request id, computed tokens, scheduled tokens)`` reads
        only device pages (so the step needs no host reads)."""
        if not self.resident_managers:
            return False
        first = self.resident_managers[0]
        for request_id, num_computed, num_scheduled in requests:
            num_pages = cdiv(num_computed + num_scheduled, first.block_size)
            if len(first.req_to_blocks.get(request_id, ())) < num_pages:
                return False
            if request_id in self._resident_requests:
                continue
            if any(
                block.is_null
                for manager in self.resident_managers
                for block in manager.get_residency_row(request_id)
            ):
                return False
            self._resident_requests.add(request_id)
        return True

    def take_residency_updates(
        self, request_ids: Iterable[str]
    ) -> dict[str, SparseKVResidencyUpdate]:
        """What the worker lacks of the scheduled requests' residency: pages changed since
        it was last told, and pages appended since. Unscheduled requests keep theirs."""
        updates: dict[str, SparseKVResidencyUpdate] = {}
        if not self.resident_managers:
            return updates
        first = self.resident_managers[0]
        for request_id in request_ids:
            state = self._get_request_state(request_id)
            num_pages = len(first.req_to_blocks.get(request_id, ()))
            start = state.synced_pages
            if not state.stale_pages and start >= num_pages:
                continue
            stale = sorted(state.stale_pages)
            block_ids: list[list[int]] = []
            for manager in self.resident_managers:
                null_id = manager.block_pool.null_block.block_id
                ids = []
                for page_idx in stale:
                    block = manager.get_resident_page(request_id, page_idx)
                    ids.append(null_id if block is None else block.block_id)
                ids.extend(b.block_id for b in manager.get_residency_row(request_id, start))
                block_ids.append(ids)
            updates[request_id] = SparseKVResidencyUpdate(
                pages=[*stale, *range(start, num_pages)], block_ids=tuple(block_ids)
            )
            state.stale_pages.clear()
            state.synced_pages = num_pages
        return updates
