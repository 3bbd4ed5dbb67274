"""The tiering manager's request lifecycle: which tiers want a request's every chunk
(``REQUEST_LEVEL``), cascading chunks the primary tier held already to them, and telling the
tiers a request finished once none of its completions can cascade any more."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.jobs import RequestState
from vllm.v1.kv_offload.tiering.metrics import TieringMetricsTracker
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.primary import CPUPrimaryTierOffloadingManager


class RequestLifecycleMixin:
    """The request half of :class:`~vllm.v1.kv_offload.tiering.manager.TieringOffloadingManager`
    (which owns the state below)."""

    primary_tier: CPUPrimaryTierOffloadingManager
    secondary_tiers: list[SecondaryTierManager]
    _req_state: dict[str, RequestState]
    _request_load_sources: dict[str, dict[OffloadKey, CacheHitSource]]
    _metrics: TieringMetricsTracker

    def _should_store_to_tier(self, tier: SecondaryTierManager, num_blocks: int) -> bool:
        return tier.bp_detector is None or tier.bp_detector.should_store(num_blocks)

    # (keys, req_context, tier_idx) -> the registered cascade job, pinning the keys.
    create_store_job: Callable[[Collection[OffloadKey], ReqContext, int], TransferJob]

    def on_new_request(
        self, req_context: ReqContext, *, exclude_tier_idx: int | None = None
    ) -> RequestOffloadingContext:
        """``REQUEST_LEVEL`` if any tier wants the request's every chunk."""
        state = RequestState(req_context)
        self._metrics.on_new_request(req_context)
        for tier_idx, tier in enumerate(self.secondary_tiers):
            if tier_idx == exclude_tier_idx:
                continue
            if tier.on_new_request(req_context).policy is OffloadPolicy.REQUEST_LEVEL:
                state.request_level_tiers = (state.request_level_tiers or set()) | {tier_idx}
        self._req_state[req_context.req_id] = state
        if state.request_level_tiers:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def on_request_finished(
        self, req_context: ReqContext, *, exclude_tier_idx: int | None = None
    ) -> None:
        self.primary_tier.on_request_finished(req_context)
        state = self._req_state.get(req_context.req_id)
        if state is None:
            raise RuntimeError(f"request {req_context.req_id!r}: finished but never started")
        state.is_finished = True
        self._maybe_finalize_request(req_context.req_id, exclude_tier_idx)

    def _maybe_finalize_request(self, req_id: str, exclude_tier_idx: int | None = None) -> None:
        state = self._req_state[req_id]
        if not state.is_finished or state.pending_primary_stores or state.pending_cascade_keys:
            return
        self._finalize_request(state, exclude_tier_idx)
        self._request_load_sources.pop(req_id, None)
        del self._req_state[req_id]

    def _finalize_request(self, state: RequestState, exclude_tier_idx: int | None = None) -> None:
        for tier_idx, tier in enumerate(self.secondary_tiers):
            if tier_idx != exclude_tier_idx:
                tier.on_request_finished(state.req_context)
        self._metrics.on_request_finished(state.req_context)

    def _cascade_existing_chunks_to_request_level_tiers(
        self, keys: Sequence[OffloadKey], req_context: ReqContext, request_level_tiers: set[int]
    ) -> None:
        """Cascade chunks the primary tier held already to the request's request-level tiers.

        A chunk whose primary write is in flight is parked and retried next step (nothing else
        would offer it again); a missing one is dropped. The primary tier never answers
        ``RETRY`` for a key: parking on it could never drain, so it is an error.
        """
        state = self._req_state[req_context.req_id]
        ready = []
        for key in keys:
            found = self.primary_tier.lookup(key, req_context)
            if found is LookupResult.HIT:
                ready.append(key)
            elif found is LookupResult.HIT_PENDING:
                state.pending_cascade_keys.append(key)
            elif found is not LookupResult.MISS:
                raise AssertionError(f"primary tier answered {found} for cascade key {key!r}")
        if not ready:
            return
        for tier_idx in sorted(request_level_tiers):
            tier = self.secondary_tiers[tier_idx]
            if self._should_store_to_tier(tier, len(ready)):
                tier.submit_store(self.create_store_job(ready, req_context, tier_idx))

    def _flush_pending_cascades(self) -> None:
        for req_id, state in list(self._req_state.items()):
            if state.pending_cascade_keys:
                keys, state.pending_cascade_keys = state.pending_cascade_keys, []
                self._cascade_existing_chunks_to_request_level_tiers(
                    keys, state.req_context, state.request_level_tiers or set()
                )
                self._maybe_finalize_request(req_id)


__all__ = ["RequestLifecycleMixin"]
