"""HiSparse's scheduler-side coordinator (upstream's ``vllm.v1.hisparse.coordinator``).

One :class:`HiSparseCoordinator` serves a KV cache manager's HiSparse groups: it gives the
source group its host pool, writes sealed resident pages back to the host (page transfers
the worker runs), publishes host pages in the prefix cache only once their copies are
durable, and keeps device residency (:mod:`vllm.v1.hisparse.residency`): resident pages are
a write-back cache of the host tier, released to the pool once clean and reused by it.
Residency changes reach the worker as residency updates, never through the block table,
which stays append-only.

Units: token counts in tokens; page indices count ``block_size``-token pages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.hisparse_managers import (
    HiSparseHotManager,
    HiSparseResidentManager,
    HiSparseSourceManager,
)
from vllm.v1.core.kv_cache_block import KVCacheBlock, KVCacheBlockCopy
from vllm.v1.core.single_type_manager_base import SingleTypeKVCacheManager
from vllm.v1.hisparse.residency import (
    HiSparseRequestState,
    HiSparseResidency,
    PendingPublication,
)
from vllm.v1.hisparse.types import SparseKVOffloadCommand, SparseKVPageTransfer
from vllm.v1.kv_cache_interface import HiSparseResidentSpec, KVCacheConfig
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

__all__ = ["HiSparseCoordinator", "get_hisparse_coordinator"]


@dataclass
class _PendingSpill:
    """A page transfer handed to the workers, with what it keeps referenced."""

    transfer_id: int
    page: tuple[str, int]
    request_state: HiSparseRequestState
    host_block: KVCacheBlock
    resident_blocks: tuple[KVCacheBlock, ...]
    restore: bool = False
    expected_worker_completions: int = 0
    worker_completions: int = 0
    enqueue_applied: bool = False


class HiSparseCoordinator(HiSparseResidency):
    """Host allocation, host publication, page transfers and device residency of the
    HiSparse groups of one KV cache manager (``managers``: its per-group managers, in
    group order)."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        managers: tuple[SingleTypeKVCacheManager, ...],
        max_model_len: int,
        *,
        num_reprefillable_tokens: int,
    ) -> None:
        self.managers = managers
        self.max_model_len = max_model_len
        # Multi-module MTP re-prefills these last tokens: they are not final, not written back.
        self.num_reprefillable_tokens = num_reprefillable_tokens
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != len(managers):
            raise ValueError(
                f"managers: expected one per KV cache group ({len(groups)}), got {len(managers)}"
            )
        resident: list[HiSparseResidentManager] = []
        hot: list[HiSparseHotManager] = []
        resident_group_ids: list[int] = []
        self.host_manager = None
        self.host_group_id: int | None = None
        for group_id, (group, manager) in enumerate(zip(groups, managers, strict=True)):
            if isinstance(group.kv_cache_spec, HiSparseResidentSpec):
                if not isinstance(manager, HiSparseResidentManager):
                    raise TypeError(
                        f"managers[{group_id}]: expected a HiSparseResidentManager for a "
                        f"HiSparseResidentSpec group, got {type(manager).__name__}"
                    )
                resident.append(manager)
                resident_group_ids.append(group_id)
            if isinstance(manager, HiSparseHotManager):
                hot.append(manager)
            if isinstance(manager, (HiSparseHotManager, HiSparseResidentManager)):
                if group.host_resident:
                    raise ValueError(
                        f"kv_cache_groups[{group_id}].host_resident: expected False for a "
                        "HiSparse device group, got True"
                    )
                manager.coordinator = self
            elif isinstance(manager, HiSparseSourceManager):
                self._bind_host_group(kv_cache_config, group_id, manager)
        self.resident_managers = tuple(resident)
        self.hot_managers = tuple(hot)
        self.has_host_cache = self.host_manager is not None
        self.gpu_pool: BlockPool | None = None
        self.transition_watermark = 0
        self.max_spill_pages = 0
        if self.resident_managers:
            self._check_resident_groups(resident_group_ids)
            block_size = self.resident_managers[0].block_size
            self.max_spill_pages = max_model_len // block_size
            self.gpu_pool = self.resident_managers[0].block_pool
            # Requests switch to host reads once the shared pool runs this low, so
            # admissions find reusable pages instead of pinned ones.
            hot_pages = sum(m.blocks_per_request for m in self.hot_managers)
            self.transition_watermark = max(hot_pages, kv_cache_config.num_blocks // 10)
        # Host copy-on-write pairs handed to the worker, by destination block id, until it
        # reports them done.
        self._retained_copies: dict[int, tuple[KVCacheBlock, KVCacheBlock]] = {}
        # request id -> prefix (tokens) an external load is still filling in.
        self._pending_imports: dict[str, int] = {}
        self._resident_requests = set()
        self.spills_to_send: list[SparseKVPageTransfer] = []
        self.pending_spills: dict[int, _PendingSpill] = {}
        self.request_states = {}
        self.next_spill_id = 0
        self.copies = {}
        self._copy_by_block = {}
        self._owners = {}

    def _bind_host_group(
        self, kv_cache_config: KVCacheConfig, group_id: int, manager: HiSparseSourceManager
    ) -> None:
        if self.host_manager is not None:
            raise ValueError(
                f"kv_cache_groups[{group_id}]: expected one HiSparse source group, got a second"
            )
        num_host_blocks = kv_cache_config.hisparse_host_num_blocks
        if num_host_blocks is None:
            raise ValueError(
                "kv_cache_config.hisparse_host_num_blocks: expected host pages for the "
                "HiSparse source group, got None"
            )
        self.host_group_id = group_id
        self.host_manager = manager
        manager.coordinator = self
        manager.bind_host_pool(num_host_blocks)

    def _check_resident_groups(self, resident_group_ids: list[int]) -> None:
        if self.host_manager is None or self.host_group_id is None:
            raise ValueError(
                "kv_cache_config: expected a HiSparse source group with the resident groups, "
                "got none"
            )
        if self.host_group_id > min(resident_group_ids):
            raise ValueError(
                f"kv_cache_groups: expected the HiSparse source group before the resident "
                f"groups {resident_group_ids}, got it at {self.host_group_id}"
            )
        sizes = {m.block_size for m in self.resident_managers}
        if len(sizes) != 1:
            raise ValueError(
                f"kv_cache_groups: expected one block size for the resident groups, got {sizes}"
            )
        if self.host_manager.block_size not in sizes:
            raise ValueError(
                f"kv_cache_groups: expected the source group's block size "
                f"{self.host_manager.block_size} to match the resident groups' {sizes}"
            )

    def commit_computed_blocks(self, request_id: str, num_host_pages: int) -> None:
        """Note a prefix hit of ``num_host_pages`` host pages the request now holds: they
        are clean, and their device copies are adopted after the admitting allocation
        (adopting takes pages out of the free pool admission counted on)."""
        self._resident_requests.discard(request_id)
        if not self.resident_managers or self.host_manager is None:
            return
        num_host_pages = min(
            num_host_pages, len(self.host_manager.req_to_blocks.get(request_id, ()))
        )
        if num_host_pages == 0:
            return
        state = self._get_request_state(request_id)
        state.valid_pages.update(range(num_host_pages))
        state.ready_prefix_pages = max(num_host_pages, state.ready_prefix_pages)
        state.pages_to_adopt = max(state.pages_to_adopt, num_host_pages)
        state.copies_recorded_blocks = max(state.copies_recorded_blocks, num_host_pages)

    # Host copy-on-write (a prefix hit ending inside a host page).

    def take_host_block_copies(self) -> tuple[KVCacheBlockCopy, ...]:
        """Drain the host copies the worker runs in the step that carries them; both pages
        of each stay referenced until :meth:`release_completed_host_copies`."""
        if self.host_manager is None:
            return ()
        pairs = self.host_manager.take_host_cow_copies()
        for source, destination in pairs:
            self._retained_copies[destination.block_id] = (source, destination)
        return tuple(KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pairs)

    def release_completed_host_copies(self, dst_block_ids: Iterable[int]) -> None:
        """Release both pages of each host copy the worker reports run (by destination)."""
        blocks: list[KVCacheBlock] = []
        for dst_block_id in dst_block_ids:
            blocks.extend(self._retained_copies.pop(dst_block_id, ()))
        if blocks:
            assert self.host_manager is not None
            self.host_manager.block_pool.free_blocks(reversed(blocks))

    def get_host_block_pool(self) -> BlockPool | None:
        return None if self.host_manager is None else self.host_manager.block_pool

    # Write-back and publication.

    def advance_scheduled(self, requests: Iterable[tuple[str, int]]) -> None:
        """One step's residency work for each scheduled ``(request id, tokens computed once
        the step completes)``; the last ``num_reprefillable_tokens`` are not written back."""
        if not self.resident_managers:
            return
        for request_id, num_tokens in requests:
            self.plan_prefix_materialization(
                request_id, max(0, num_tokens - self.num_reprefillable_tokens)
            )
            self.update_residency(request_id)

    def plan_prefix_materialization(self, request_id: str, num_computed_tokens: int) -> None:
        """Plan a write-back of every sealed page without a host copy yet, within the
        per-step transfer budget (``max_spill_pages`` in flight to the workers)."""
        if not self.resident_managers:
            return
        assert self.host_manager is not None
        block_size = self.host_manager.block_size
        state = self._get_request_state(request_id)
        importing = cdiv(self._pending_imports.get(request_id, 0), block_size)
        budget = max(self.max_spill_pages - len(self.spills_to_send), 0)
        for page_idx in range(
            max(state.ready_prefix_pages, importing), num_computed_tokens // block_size
        ):
            if budget == 0:
                break
            if page_idx in state.pending_pages or page_idx in state.valid_pages:
                continue
            if any(
                m.get_resident_page(request_id, page_idx) is None for m in self.resident_managers
            ):
                continue
            if self._plan_page_transfer(request_id, page_idx, after_forward=True):
                budget -= 1

    def publish_when_ready(
        self,
        request: Request,
        num_computed_tokens: int,
        retention_interval: int | None,
        *,
        replay_boundaries: Sequence[int],
    ) -> None:
        """Publish the host pages of the first ``num_computed_tokens`` tokens as their copies
        become durable (now for those already are)."""
        if self.host_manager is None:
            return
        self._get_request_state(request.request_id).publication = PendingPublication(
            request=request,
            num_computed_tokens=num_computed_tokens,
            num_pages=num_computed_tokens // self.host_manager.block_size,
            retention_interval=retention_interval,
            replay_boundaries=replay_boundaries,
        )
        self._publish_host_blocks_if_ready(request.request_id)

    def _publish_host_blocks_if_ready(self, request_id: str) -> None:
        """Publish the durable prefix of the pending publication. Host copies trail a long
        prefill by about a chunk: waiting for all of it would publish nothing until the
        prefill ends, and a prefill preempted before then would start over."""
        state = self.request_states.get(request_id)
        if state is None or state.publication is None:
            return
        publication = state.publication
        assert self.host_manager is not None
        num_tokens = min(
            publication.num_computed_tokens,
            state.ready_prefix_pages * self.host_manager.block_size,
        )
        self.host_manager.publish_blocks(
            publication.request,
            num_tokens,
            retention_interval=publication.retention_interval,
            replay_boundaries=publication.replay_boundaries,
        )
        self._record_copies(request_id, num_tokens)
        if state.ready_prefix_pages >= publication.num_pages:
            state.publication = None

    def record_pending_host_import(self, request_id: str, num_tokens: int) -> None:
        """Note that an external load fills the request's host pages up to ``num_tokens``."""
        self._resident_requests.discard(request_id)
        self._pending_imports[request_id] = num_tokens

    def finish_host_import(self, request_id: str, *, failed: bool) -> None:
        """The external load of the request ended (``failed``: its pages are garbage)."""
        num_tokens = self._pending_imports.pop(request_id, None)
        if num_tokens is not None and not failed:
            self.complete_host_import(request_id, num_tokens)

    def complete_host_import(self, request_id: str, num_computed_tokens: int) -> None:
        """The loaded host pages are valid: publish them and restore the last (the request
        writes on into it) to its device page."""
        if not self.resident_managers:
            return
        block_size = self.resident_managers[0].block_size
        num_pages = num_computed_tokens // block_size
        state = self._get_request_state(request_id)
        state.valid_pages = set(range(num_pages))
        state.ready_prefix_pages = num_pages
        if num_computed_tokens:
            self._plan_page_transfer(
                request_id,
                (num_computed_tokens - 1) // block_size,
                after_forward=False,
                restore=True,
            )
        self._publish_host_blocks_if_ready(request_id)

    def _plan_page_transfer(
        self, request_id: str, page_idx: int, *, after_forward: bool, restore: bool = False
    ) -> bool:
        """Queue one page transfer, referencing both ends until it completes; False when the
        page has no host page or device page, or one is in flight."""
        assert self.host_manager is not None
        state = self._get_request_state(request_id)
        if page_idx in state.pending_pages:
            return False
        host_blocks = self.host_manager.req_to_blocks.get(request_id)
        if host_blocks is None or page_idx >= len(host_blocks) or host_blocks[page_idx].is_null:
            return False
        host_block = host_blocks[page_idx]
        blocks: list[KVCacheBlock] = []
        for manager in self.resident_managers:
            block = manager.get_resident_page(request_id, page_idx)
            if block is None:
                return False
            blocks.append(block)
        self.host_manager.block_pool.touch([host_block])
        for manager, block in zip(self.resident_managers, blocks, strict=True):
            manager.block_pool.touch([block])
        transfer_id = self.next_spill_id
        self.next_spill_id += 1
        self.pending_spills[transfer_id] = _PendingSpill(
            transfer_id=transfer_id,
            page=(request_id, page_idx),
            request_state=state,
            host_block=host_block,
            resident_blocks=tuple(blocks),
            restore=restore,
        )
        state.pending_pages[page_idx] = transfer_id
        self.spills_to_send.append(
            SparseKVPageTransfer(
                transfer_id=transfer_id,
                host_block_id=host_block.block_id,
                resident_block_ids=tuple(b.block_id for b in blocks),
                after_forward=after_forward,
                restore=restore,
            )
        )
        return True

    # Transfers in flight.

    def build_offload_command(self) -> SparseKVOffloadCommand | None:
        """The transfers planned since the last call, for the workers (None: no HiSparse
        resident groups)."""
        if not self.resident_managers:
            return None
        command = SparseKVOffloadCommand(page_transfers=self.spills_to_send)
        self.spills_to_send = []
        return command

    def has_pending_reclamation(self) -> bool:
        """Whether a transfer in flight frees device or host pages when it completes."""
        return any(
            pending.host_block.ref_cnt == 1
            or (
                pending.page[0] in self.request_states and self._can_read_from_host(pending.page[0])
            )
            for pending in self.pending_spills.values()
        )

    def has_pending_work(self) -> bool:
        return bool(self.spills_to_send or self.pending_spills or self._retained_copies)

    def update_spills(
        self, enqueued_counts: Mapping[int, int], completed_counts: Mapping[int, int]
    ) -> None:
        """Take the workers' reports (transfer id -> how many workers enqueued it / how many
        completed it); a transfer is done once all that enqueued it completed it."""
        for transfer_id, count in enqueued_counts.items():
            pending = self.pending_spills.get(transfer_id)
            if pending is not None and pending.expected_worker_completions == 0:
                pending.expected_worker_completions = count
        for transfer_id, count in completed_counts.items():
            pending = self.pending_spills.get(transfer_id)
            if pending is not None:
                pending.worker_completions += count
        done = [p for p in self.pending_spills.values() if self._all_workers_done(p)]
        for pending in done:
            if not pending.enqueue_applied:
                for manager, block in zip(
                    self.resident_managers, pending.resident_blocks, strict=True
                ):
                    manager.block_pool.free_blocks([block])
                pending.enqueue_applied = True
        self._complete_host_writes(done)

    @staticmethod
    def _all_workers_done(pending: _PendingSpill) -> bool:
        expected = pending.expected_worker_completions
        return bool(expected) and pending.worker_completions >= expected

    def _complete_host_writes(self, completed: list[_PendingSpill]) -> None:
        assert completed == [] or self.host_manager is not None
        completed_requests: set[str] = set()
        for pending in completed:
            self.pending_spills.pop(pending.transfer_id, None)
            request_id, page_idx = pending.page
            state = pending.request_state
            state.pending_pages.pop(page_idx, None)
            if self.request_states.get(request_id) is state:
                if not pending.restore:
                    state.valid_pages.add(page_idx)
                if page_idx in state.valid_pages:
                    self._page_became_clean(request_id, state, page_idx)
                    if pending.restore:
                        self._record_copy(request_id, page_idx, pending.host_block)
                completed_requests.add(request_id)
            elif state.publication is not None:
                if not pending.restore:
                    state.valid_pages.add(page_idx)
                self._publish_detached_blocks(state)
            assert self.host_manager is not None
            self.host_manager.block_pool.free_blocks([pending.host_block])
        for request_id in completed_requests:
            state = self.request_states[request_id]
            while state.ready_prefix_pages in state.valid_pages:
                state.ready_prefix_pages += 1
            self._publish_host_blocks_if_ready(request_id)

    def _publish_detached_blocks(self, state: HiSparseRequestState) -> None:
        """Publish a finished request's host prefix once its last copy landed, then drop the
        references that kept it alive. Only sealed pages with complete copies outlive it."""
        publication = state.publication
        if publication is None or state.pending_pages or publication.detached_blocks is None:
            return
        assert self.host_manager is not None
        while state.ready_prefix_pages in state.valid_pages:
            state.ready_prefix_pages += 1
        blocks = publication.detached_blocks
        self.host_manager.block_pool.cache_full_blocks(
            request=publication.request,
            blocks=blocks,
            num_cached_blocks=publication.num_cached_blocks,
            num_full_blocks=min(state.ready_prefix_pages, publication.num_pages),
            block_size=self.host_manager.block_size,
            kv_cache_group_id=self.host_manager.kv_cache_group_id,
        )
        self.host_manager.block_pool.free_blocks(reversed(blocks))
        state.publication = None

    def free(self, request_id: str) -> None:
        """Detach the request. Its clean pages stay in the pool as readable copies; a finished
        request with copies in flight keeps its host prefix until they land."""
        self._resident_requests.discard(request_id)
        self._pending_imports.pop(request_id, None)
        state = self.request_states.pop(request_id, None)
        if state is None:
            return
        publication = state.publication
        if publication is not None and publication.request.is_finished() and state.pending_pages:
            assert self.host_manager is not None
            blocks = self.host_manager.req_to_blocks[request_id][: publication.num_pages]
            publication.detached_blocks = blocks
            publication.num_cached_blocks = self.host_manager.num_cached_block.get(request_id, 0)
            # The landed pages need a reference too: an allocation could evict them before
            # the remaining copies finish and the prefix is published.
            self.host_manager.block_pool.touch(blocks)
        else:
            # A preemption can cancel a step whose transfers were planned: their copies do
            # not prove the KV was computed.
            state.publication = None
        for manager in self.resident_managers:
            row = manager.get_residency_row(request_id)
            # The tail first, so a shared prefix loses its tail pages before its head.
            for page_idx in reversed(range(len(row))):
                block = row[page_idx]
                if block.is_null:
                    continue
                if page_idx in state.unpinned_pages:
                    self._owners.get(block.block_id, set()).discard((request_id, page_idx))
                elif page_idx in state.valid_pages and page_idx not in state.pending_pages:
                    manager.block_pool.unpin_blocks([block], self._on_block_reused)
                else:
                    continue
                manager.drop_resident_page(request_id, page_idx)


def get_hisparse_coordinator(kv_cache_manager: KVCacheManager) -> HiSparseCoordinator:
    """The coordinator of ``kv_cache_manager``'s HiSparse groups, built on the first call
    (which must come before the first request is admitted) and kept on the managers it
    binds. ``ValueError`` when the manager has no HiSparse source group."""
    managers = tuple(kv_cache_manager.coordinator.single_type_managers)
    for manager in managers:
        coordinator = getattr(manager, "coordinator", None)
        if isinstance(coordinator, HiSparseCoordinator):
            return coordinator
    coordinator = HiSparseCoordinator(
        kv_cache_manager.kv_cache_config,
        managers,
        kv_cache_manager.max_model_len,
        num_reprefillable_tokens=kv_cache_manager.coordinator.num_reprefillable_tokens,
    )
    if coordinator.host_manager is None:
        raise ValueError(
            "kv_cache_manager: expected a KV cache manager with a HiSparse source group, "
            "got one without"
        )
    return coordinator
