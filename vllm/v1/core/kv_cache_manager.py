"""KVCacheManager: the scheduler's view of the paged KV cache.

A scheduler asks three things per request: which leading pages are already cached
(:meth:`KVCacheManager.get_computed_blocks`), whether pages for the next tokens can be had
(:meth:`KVCacheManager.allocate_slots`, None when the pool is short) and to give everything back
(:meth:`KVCacheManager.free`). Pages travel as :class:`KVCacheBlocks`, one list per KV cache
group, whose block ids index the caches ``init_kv_cache`` allocates.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Literal, overload

from vllm.distributed.kv_events import BlockStored, KVCacheEvent
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_block import KVCacheBlock, KVCacheBlockCopy
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.core.mamba_manager import MambaManager
from vllm.v1.core.truncated_hits import truncate_hit_blocks
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

logger = logging.getLogger(__name__)

__all__ = ["KVCacheBlocks", "KVCacheManager", "Request"]


@dataclass
class KVCacheBlocks:
    """Pages handed between the manager and the scheduler: ``blocks[g][j]`` is page ``j`` of
    KV cache group ``g`` (groups may hold different page counts). A group without pages may be
    an empty tuple."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Group-wise concatenation."""
        return KVCacheBlocks(
            tuple(list(chain(a, b)) for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    @overload
    def get_block_ids(
        self, allow_none: Literal[False] = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...]: ...

    @overload
    def get_block_ids(
        self, allow_none: Literal[True] = True, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None: ...

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        """Block ids per group (only ``group_ids``, in that order, when given); None instead of
        all-empty lists when ``allow_none``."""
        if group_ids is None:
            groups = self.blocks
        else:
            bad = [g for g in group_ids if not 0 <= g < len(self.blocks)]
            if bad:
                raise ValueError(
                    f"group_ids: expected ids in [0, {len(self.blocks)}), got {list(group_ids)}"
                )
            groups = tuple(self.blocks[g] for g in group_ids)
        if allow_none and not any(groups):
            return None
        return tuple([b.block_id for b in group] for group in groups)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the not-yet-published pages of the only group."""
        if len(self.blocks) != 1:
            raise ValueError(f"blocks: expected 1 KV cache group, got {len(self.blocks)}")
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Ids of the not-yet-published pages per group (null pages left out)."""
        return [
            [b.block_id for b in group if b.block_hash is None and not b.is_null]
            for group in self.blocks
        ]

    def new_empty(self) -> KVCacheBlocks:
        """The same number of groups, no pages."""
        return KVCacheBlocks(tuple(() for _ in self.blocks))


class KVCacheManager:
    """Allocation, prefix caching and freeing of KV cache pages for a scheduler.

    ``max_model_len`` / ``scheduler_block_size`` / ``hash_block_size`` /
    ``max_in_flight_tokens`` are in tokens. ``scheduler_block_size`` (the scheduling
    granularity, a multiple of every group's block size) defaults to the LCM of the groups'
    block sizes. ``max_in_flight_tokens`` (tokens scheduled but not yet settled; v0.22 named it
    ``max_num_batched_tokens``, still accepted) defaults to ``max_model_len`` (then the
    sliding-window admission cap never binds). ``num_hash_lookahead_tokens`` (tokens after
    each block that its hash covers, as the requests' hasher was built) and
    ``num_prefill_lookahead``: see
    :class:`~vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator`. ``log_stats`` keeps
    :class:`PrefixCacheStats`; ``enable_kv_cache_events`` records BlockStored / BlockRemoved /
    AllBlocksCleared for :meth:`take_events`.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int | None = None,
        hash_block_size: int | None = None,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: KVCacheMetricsCollector | None = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        *,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        if hash_block_size is None:
            raise TypeError("hash_block_size: expected tokens per block hash, got None")
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or watermark < 0:
            raise ValueError(f"watermark: expected a fraction of the pool >= 0, got {watermark!r}")
        if max_in_flight_tokens is not None and max_num_batched_tokens is not None:
            raise TypeError(
                "max_num_batched_tokens: expected only max_in_flight_tokens (its v0.33 name), "
                "got both"
            )
        if max_in_flight_tokens is None:
            max_in_flight_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config=kv_cache_config,
            max_model_len=max_model_len,
            max_in_flight_tokens=(
                max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
            ),
            use_eagle=use_eagle,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            scheduler_block_size=scheduler_block_size,
            num_prefill_lookahead=num_prefill_lookahead,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            hash_block_size=hash_block_size,
            metrics_collector=metrics_collector,
        )
        # Mamba states at shared-prefix junctions (the scheduler ends a chunk there): only for
        # EAGLE-flagged models with partial hash hits and no multi-module MTP re-prefill
        # (cache_blocks would not see the chunk end).
        self.mamba_shared_prefix_checkpoint = (
            enable_mamba_shared_prefix_checkpoint
            and bool(self.coordinator.eagle_group_ids)
            and getattr(self.coordinator, "enable_partial_hash_hits", False)
            and self.coordinator.num_reprefillable_tokens == 0
        )
        for manager in self.coordinator.single_type_managers:
            if isinstance(manager, MambaManager):
                manager.shared_prefix_checkpoint = self.mamba_shared_prefix_checkpoint
        self.kv_cache_config = kv_cache_config
        # Free pages an admission (a waiting or preempted request) must leave, so admitting
        # one does not force preempting another soon after.
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        # Groups whose hits come back uncut (HiSparse sources): allocation trims them.
        self.retained_hit_group_ids = tuple(
            m.kv_cache_group_id
            for m in self.coordinator.single_type_managers
            if m.retains_longer_hit
        )
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        # Per group: (spec kind, sliding window) stamped on BlockStored events, so the pool
        # emits structural events without knowing specs.
        self.kv_cache_event_metadata = tuple(
            (
                get_kv_cache_spec_kind(g.kv_cache_spec).value,
                get_kv_cache_spec_sliding_window(g.kv_cache_spec),
            )
            for g in kv_cache_config.kv_cache_groups
        )
        # One shared, immutable "no pages" answer instead of a new object per call.
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )

    @property
    def usage(self) -> float:
        """Fraction of the pool's pages in use (0.0 to 1.0)."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats gathered since the last call (and start new ones); None without
        ``log_stats``."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The cached full pages of the request's longest usable prefix, its length in tokens
        (at most ``max_cache_hit_length``; by default never the whole prompt: the last token is
        recomputed for its logits), and the shared-prefix boundary (tokens): where a group
        hit further than the reconciled hit, the prefix a lagging group (Mamba, a window) has
        not cached yet and that retention should keep for the next sharer; 0 when none. No
        lookup with caching off or when the request skips the prefix cache (prompt logprobs,
        all-token pooling)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        blocks, num_hit_tokens, num_uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        # A request asking for "full" reports learns of its hit blocks too, not only of the
        # blocks it stores (the request carries the mode from its sampling params' extra_args).
        if num_hit_tokens and request.kv_cache_report_mode == "full":
            self.coordinator.emit_cached_block_events(request, blocks)
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                num_tokens=request.num_tokens,
                num_hits=num_hit_tokens,
                preempted=request.num_preemptions > 0,
            )
        boundary = num_hit_tokens + num_uncached if num_uncached else 0
        return self.create_kv_cache_blocks(blocks), num_hit_tokens, boundary

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        skip_zeroing_group_ids: tuple[int, ...] = (),
        has_scheduled_reqs: bool = True,
    ) -> KVCacheBlocks | None:
        """Slots for ``num_new_tokens`` tokens to compute (drafts included) after the request's
        computed tokens, its ``num_new_computed_tokens`` prefix-hit tokens
        (``new_computed_blocks``, from :meth:`get_computed_blocks`) and the connector's
        ``num_external_computed_tokens``; plus ``num_lookahead_tokens`` speculative slots and,
        for cross-attention, ``num_encoder_tokens``. Returns the newly allocated pages, or None
        (nothing taken) when the pool cannot supply them. ``full_sequence_must_fit``: also
        refuse unless the whole request would fit (an admission gate for chunked prefill);
        ``delay_cache_blocks``: do not publish yet (KV arriving later from a remote instance);
        ``reserved_blocks``: free pages this allocation must leave to sequences already in
        flight (an async connector load must not take what a running prefill relies on);
        ``skip_zeroing_group_ids``: groups whose connector pages an async load writes (not
        listed for zeroing, which would race the load). Admitting a waiting or preempted request
        also leaves the ``watermark`` share of the pool free, unless nothing else is scheduled
        this step (``has_scheduled_reqs`` False).

        Pages leaving an attention window are freed first, even when the answer is None."""
        # A step may only adopt computed tokens (an async load, a chunk ending in a hit).
        if num_new_tokens == 0 and num_external_computed_tokens + num_new_computed_tokens == 0:
            raise ValueError(
                "num_new_tokens: expected > 0 when there are no computed tokens to adopt, got 0"
            )
        if isinstance(reserved_blocks, bool) or not isinstance(reserved_blocks, int):
            raise TypeError(f"reserved_blocks: expected an int >= 0, got {reserved_blocks!r}")
        if reserved_blocks < 0:
            raise ValueError(f"reserved_blocks: expected an int >= 0, got {reserved_blocks}")
        hit_blocks = (
            new_computed_blocks.blocks
            if new_computed_blocks is not None
            else self.empty_kv_cache_blocks.blocks
        )
        if new_computed_blocks is not None and self.retained_hit_group_ids:
            # A retained longer hit is kept only as far as the local and external hits reuse.
            reused = num_new_computed_tokens + num_external_computed_tokens
            trimmed = list(hit_blocks)
            for group_id in self.retained_hit_group_ids:
                block_size = self.coordinator.single_type_managers[group_id].block_size
                trimmed[group_id] = trimmed[group_id][: cdiv(reused, block_size)]
            hit_blocks = tuple(trimmed)
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        num_computed = num_local_computed + num_external_computed_tokens
        total_computed = min(num_computed, self.max_model_len)
        # Where the scheduler ends the prefill (a resumed request replays its outputs too).
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        admitting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        watermark = self.watermark_blocks if has_scheduled_reqs and admitting else 0

        def fits(
            num_tokens: int, computed: int, main_model: int, cap: bool, reserved: int = 0
        ) -> bool:
            need = self.coordinator.get_num_blocks_to_allocate(
                request_id=request.request_id,
                num_tokens=num_tokens,
                new_computed_blocks=hit_blocks,
                num_encoder_tokens=num_encoder_tokens,
                total_computed_tokens=computed,
                num_local_computed_tokens=num_local_computed,
                num_tokens_main_model=main_model,
                apply_admission_cap=cap,
                prefill_end=prefill_end,
            )
            return need <= self.block_pool.get_num_free_blocks() - reserved

        if full_sequence_must_fit:
            num_full = min(request.num_tokens, self.max_model_len)
            if not fits(num_full, total_computed, num_full, cap=True, reserved=watermark):
                return None
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)
        # Freeing out-of-window pages first lowers what must be evicted below.
        self.coordinator.remove_skipped_blocks(request.request_id, total_computed)
        # The reservation gates only this step's pages: the whole-sequence gate above asks
        # whether the request can ever finish, not whether it may start now.
        if not fits(
            num_tokens_need_slot,
            num_computed,
            num_tokens_main_model,
            False,
            reserved_blocks + watermark,
        ):
            return None
        if hit_blocks is not self.empty_kv_cache_blocks.blocks or num_external_computed_tokens > 0:
            # Take the hits before the new pages so a hit cannot be evicted to make room.
            self.coordinator.allocate_new_computed_blocks(
                request_id=request.request_id,
                new_computed_blocks=hit_blocks,
                num_local_computed_tokens=num_local_computed,
                num_external_computed_tokens=num_external_computed_tokens,
                skip_zeroing_group_ids=skip_zeroing_group_ids,
            )
        new_blocks = self.coordinator.allocate_new_blocks(
            request.request_id, num_tokens_need_slot, num_tokens_main_model, num_encoder_tokens
        )
        if self.enable_caching and not delay_cache_blocks:
            # Unverified draft tokens beyond request.num_tokens are not published.
            self.coordinator.cache_blocks(
                request, min(total_computed + num_new_tokens, request.num_tokens)
            )
        return self.create_kv_cache_blocks(new_blocks)

    def free(self, request: Request) -> None:
        """Give back the request's pages, tail first (evicted before shared heads)."""
        self.coordinator.free(request.request_id)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request and return its pages (group after group, each in table order)
        without freeing them: the caller frees them, tail first, once nothing reads them.
        Its pending boundary-state offers are dropped with it."""
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Free the pages no later token reads once ``processed_computed_tokens`` tokens are
        computed and settled (``num_prompt_tokens``: for R-SWA's gap between prompt and
        decode windows)."""
        self.coordinator.remove_skipped_blocks(
            request_id, processed_computed_tokens, num_prompt_tokens
        )

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop these pages from the prefix cache (e.g. their contents are known bad)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (after a weight update, or between benchmarks). False
        (nothing changed) while requests still hold pages."""
        if not self.coordinator.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading pages shared by every request that holds pages (for cascade
        attention). Requests that hold pages but are not scheduled this step count too, so this
        may be 0 although all scheduled requests share a prefix."""
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's KV events since the last call; BlockStored events get their group's spec
        kind and sliding window."""
        events = self.block_pool.take_events()
        for event in events:
            if not isinstance(event, BlockStored) or event.group_idx is None:
                continue
            if not 0 <= event.group_idx < len(self.kv_cache_event_metadata):
                logger.warning("Group index `%s` not in KV cache metadata", event.group_idx)
                continue
            kind, window = self.kv_cache_event_metadata[event.group_idx]
            event.kv_cache_spec_kind = kind
            event.kv_cache_spec_sliding_window = window
        return events

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's pages, per group."""
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, per group."""
        return self.get_blocks(request_id).get_block_ids()

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the full pages among the first ``num_computed_tokens`` tokens (no-op with
        caching off)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Wrap per-group pages; the shared empty answer when there are none."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """A lookup result (from :meth:`get_computed_blocks`) cut to its first
        ``num_computed_tokens`` tokens, a multiple of every prefix-cacheable group's page. A
        Mamba group's hit may end short of it (an external load supplies that state); every
        other group's must reach it. A view: ``blocks`` and reference counts are untouched."""
        return self.create_kv_cache_blocks(
            truncate_hit_blocks(
                blocks.blocks,
                self.kv_cache_config.kv_cache_groups,
                self.coordinator.single_type_managers,
                num_computed_tokens,
            )
        )

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Drain the Mamba (align mode) states offered since the last call, for a KV
        connector to offload: ``{request id: [(group id, block id, boundary tokens), ...]}``
        (a prompt tail ending inside its page is offered as the copy its next step makes).
        A block is valid only until its request is freed."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for manager in self.coordinator.single_type_managers:
            for (
                request_id,
                group_id,
                block,
                boundary,
            ) in manager.take_pending_boundary_state_offloads():
                offloads.setdefault(request_id, []).append((group_id, block.block_id, boundary))
        return offloads

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """For a finishing request, ``(group id, block id, boundary tokens)`` of each prompt
        tail it published inside a state page and has not offered yet: the table page itself,
        valid only when the request stopped exactly at the boundary with nothing in flight.
        Each tail is consumed by the first call; the connector must pin the page before the
        request is freed."""
        offloads: list[tuple[int, int, int]] = []
        for manager in self.coordinator.single_type_managers:
            tail = manager.finalize_partial_tail_offload(
                request.request_id, request.num_computed_tokens, request.num_in_flight_tokens
            )
            if tail is not None:
                group_id, block, boundary = tail
                offloads.append((group_id, block.block_id, boundary))
        return offloads

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """Drain the page copies queued since the last call (copy-on-write of prefix hits
        ending inside a page) and the pages they keep referenced: the caller runs the copies
        before the step's forward pass, then frees every returned page once."""
        managers = self.coordinator.single_type_managers
        pairs = [pair for m in managers for pair in m.take_pending_cow_copies()]
        copies = [KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pairs]
        return copies, [block for pair in pairs for block in pair]

    def take_new_block_ids(self) -> list[int]:
        """Ids of attention pages handed out since the last call (to zero before use)."""
        return [i for m in self.coordinator.single_type_managers for i in m.take_new_block_ids()]

    def new_step_starts(self) -> None:
        """Call at the start of every scheduler step."""
        self.coordinator.new_step_starts()
