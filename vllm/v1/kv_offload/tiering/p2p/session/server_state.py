"""Records kept by the serving side of a peer session (see :mod:`.server`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.v1.kv_offload.base import OffloadKey, ReqContext


class StoreResult(NamedTuple):
    """A finished store job (blocks sent to the peer, or given up), reported by poll."""

    job_id: int
    success: bool


class _MatchResult(NamedTuple):
    """Supply matched with demand: write local block ``local_idxs[i]`` into the peer's
    ``remote_idxs[i]``; ``job_ids`` are the store jobs that supplied them."""

    local_idxs: list[int]
    remote_idxs: list[int]
    job_ids: set[int]


@dataclass
class _OutboundRequestState:
    """One fetch round being served: blocks stored here (supply) against blocks the peer
    asked for (demand)."""

    # Supply came from probe pins: nothing more will be stored, so unmet demand fails now.
    lookup_supplied: bool = False
    demand_received: bool = False
    # key -> (store job id, local block index): stored, not yet asked for.
    available: dict[OffloadKey, tuple[int, int]] = field(default_factory=dict)
    # key -> peer block index: asked for, not yet stored.
    demanded: dict[OffloadKey, int] = field(default_factory=dict)
    remaining: int = 0  # demanded blocks not yet written
    finishing: bool = False  # the request ended locally: no more supply will come
    inflight: int = 0  # transfers submitted and not yet terminal
    # Failed or aborted while transfers may still write: jobs fail, but a job keeps its pin
    # until every transfer reading it is terminal (a started WRITE cannot be recalled).
    cancelled: bool = False
    last_cancel_at: float | None = None  # monotonic time of the last wait-mode cancel
    # Store jobs that supplied this round and have not been reported yet.
    pending_job_ids: set[int] = field(default_factory=set)

    def add_stored_blocks(
        self, keys: Sequence[OffloadKey], block_ids: Sequence[int], job_id: int
    ) -> _MatchResult:
        """Add supply; return the part that meets demand already recorded."""
        self.pending_job_ids.add(job_id)
        local: list[int] = []
        remote: list[int] = []
        for key, local_idx in zip(keys, block_ids, strict=True):
            remote_idx = self.demanded.pop(key, None)
            if remote_idx is None:
                self.available[key] = (job_id, local_idx)
            else:
                local.append(local_idx)
                remote.append(remote_idx)
        return _MatchResult(local, remote, {job_id} if local else set())

    def add_fetch_demand(
        self, keys: Sequence[OffloadKey], block_indexes: Sequence[int]
    ) -> _MatchResult:
        """Record the peer's demand; return the part that supply already covers."""
        self.demand_received = True
        self.remaining = len(keys)
        local: list[int] = []
        remote: list[int] = []
        job_ids: set[int] = set()
        for key, remote_idx in zip(keys, block_indexes, strict=True):
            supplied = self.available.pop(key, None)
            if supplied is None:
                self.demanded[key] = remote_idx
            else:
                job_ids.add(supplied[0])
                local.append(supplied[1])
                remote.append(remote_idx)
        return _MatchResult(local, remote, job_ids)


@dataclass
class _InflightXfer:
    """One submitted data-plane transfer (by transfer id)."""

    kv_request_id: str
    block_count: int
    job_ids: set[int]
    # The round it serves and that round's key; counts apply only while it is registered.
    round: _OutboundRequestState = field(default_factory=_OutboundRequestState)
    round_key: int = 0


@dataclass
class _ActiveLookup:
    """One inbound LookupMsg being answered; exactly one LookupRespMsg goes back, with the
    keys in wire order, once every key is settled or ``deadline`` (monotonic) passed."""

    lookup_id: int
    kv_request_id: str
    ctx: ReqContext
    round_seq: int = 0
    keys: list[OffloadKey] = field(default_factory=list)
    resolved: dict[OffloadKey, bool] = field(default_factory=dict)  # key -> hit
    pending: set[OffloadKey] = field(default_factory=set)  # HIT_PENDING / RETRY so far
    deadline: float = 0.0


class _PendingLookup(NamedTuple):
    """A received LookupMsg not yet looked at (that needs the parent handle)."""

    keys: list[OffloadKey]
    enqueued_at: float
    round_seq: int = 0


@dataclass
class _ServerRequestState:
    """What the serving side tracks for one kv_request_id; dropped once all of it is idle."""

    outbound: dict[int, _OutboundRequestState] = field(default_factory=dict)  # by round
    pending_lookups: list[_PendingLookup] = field(default_factory=list)
    lookups: dict[int, _ActiveLookup] = field(default_factory=dict)  # by lookup_id
    # Ids of this request's entries in ServerRole._inflight, kept in step with it.
    inflight_tids: set[int] = field(default_factory=set)
