"""The tiering manager's bookkeeping records: jobs in flight, promotions waiting for the end
of the step, per-request state, and the :class:`ParentManager` a tier serving external
requests is handed."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import ParentManager, TransferJob


class JobMetadata(NamedTuple):
    """A registered job and the index of the secondary tier it runs on (v0.33's
    ``tiering.manager.JobMetadata``; v0.22's name of :class:`TransferJob` lives on in
    ``tiering.base``)."""

    transfer_job: TransferJob
    tier_idx: int


@dataclass
class PendingPromotion:
    """Keys of one request waiting to be promoted from one tier, and their primary chunks."""

    req_context: ReqContext
    keys: list[OffloadKey] = field(default_factory=list)
    chunk_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestState:
    """What the manager tracks per request between ``on_new_request`` and its finalization.

    ``pending_primary_stores``: GPU -> primary stores prepared and not yet completed (their
    completion may still cascade, so tiers are told the request finished only after);
    ``request_level_tiers``: indices of tiers that want every chunk of the request;
    ``pending_cascade_keys``: chunks for those tiers whose primary write was still in flight.
    """

    req_context: ReqContext
    pending_primary_stores: int = 0
    is_finished: bool = False
    request_level_tiers: set[int] | None = None
    pending_cascade_keys: list[OffloadKey] = field(default_factory=list)


class _TieringManager(Protocol):
    """What :class:`SecondaryTierFacingParent` calls on the tiering manager (its methods that
    can leave one tier out)."""

    def on_new_request(
        self, req_context: ReqContext, *, exclude_tier_idx: int | None = None
    ) -> RequestOffloadingContext: ...

    def lookup(
        self, key: OffloadKey, req_context: ReqContext, *, exclude_tier_idx: int | None = None
    ) -> LookupResult: ...

    def create_store_job(
        self, keys: Collection[OffloadKey], req_context: ReqContext, tier_idx: int = 0
    ) -> TransferJob: ...

    def on_request_finished(
        self, req_context: ReqContext, *, exclude_tier_idx: int | None = None
    ) -> None: ...


class SecondaryTierFacingParent(ParentManager):
    """The manager as tier ``tier_idx`` sees it: every call leaves that tier out."""

    __slots__ = ("_manager", "_origin_idx")

    def __init__(self, manager: _TieringManager, tier_idx: int) -> None:
        self._manager = manager
        self._origin_idx = tier_idx

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self._manager.on_new_request(req_context, exclude_tier_idx=self._origin_idx)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self._manager.lookup(key, req_context, exclude_tier_idx=self._origin_idx)

    def create_store_job(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> TransferJob:
        return self._manager.create_store_job(keys, req_context, self._origin_idx)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._manager.on_request_finished(req_context, exclude_tier_idx=self._origin_idx)


__all__ = ["JobMetadata", "PendingPromotion", "RequestState", "SecondaryTierFacingParent"]
